"""Mixtral: Mistral's attention with a sparse MoE MLP. `post_attention_layernorm` is read by the router
(`mlp.gate`, a bare weight applied with F.linear) and by every expert (`mlp.experts.gate_up_proj`, the experts'
gate and up projections stacked [experts, 2·intermediate, hidden]): the fold rewrites the router and each
expert's matrix alike."""

from taperfold.families import Family

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
ROUTED_EXPERTS = ("mlp.gate.weight", "mlp.experts.gate_up_proj")


def dense_layers(config) -> str | None:
    """Qwen-MoE configurations where some layers have a dense MLP instead of experts (their norm's readers differ)."""
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        return (
            "mlp_only_layers / decoder_sparse_step give some layers a dense MLP: taperfold maps MoE models whose "
            "every layer has experts"
        )
    return None


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    norm="rms",
    layers="model.layers",
    internal={"input_layernorm": ATTENTION, "post_attention_layernorm": ROUTED_EXPERTS},
    final="model.norm",
)
