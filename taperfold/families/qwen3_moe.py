"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, never tapered) with a sparse MoE MLP: `post_attention_layernorm`
is read by the router and every expert (stacked), as Mixtral's."""

from dataclasses import replace

from taperfold.families.mixtral import FAMILY as MIXTRAL
from taperfold.families.mixtral import dense_layers
from taperfold.families.qwen3 import PER_HEAD_QK

FAMILY = replace(
    MIXTRAL,
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    check=dense_layers,
    untapered={"q_norm": PER_HEAD_QK, "k_norm": PER_HEAD_QK},
)
