"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention with a sparse MoE MLP beside a shared expert. `post_attention_layernorm`
is read by the router, every routed expert (stacked), the shared expert's gate and up projections and the
shared expert's gate (a one-output linear layer)."""

from taperfold.families import Family
from taperfold.families.mixtral import ATTENTION, ROUTED_EXPERTS, dense_layers

FAMILY = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    norm="rms",
    layers="model.layers",
    internal={
        "input_layernorm": ATTENTION,
        "post_attention_layernorm": (
            *ROUTED_EXPERTS,
            "mlp.shared_expert.gate_proj",
            "mlp.shared_expert.up_proj",
            "mlp.shared_expert_gate",
        ),
    },
    final="model.norm",
    check=dense_layers,
)
