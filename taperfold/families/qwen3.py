"""Qwen3: Llama's layout plus per-head RMSNorms on q and k, after the projections."""

from dataclasses import replace

from taperfold.families.llama import FAMILY as LLAMA

PER_HEAD_QK = (
    "normalises each head of the projected queries/keys, which feed RoPE and the attention scores, "
    "not a linear layer: nothing to fold into, never tapered"
)

FAMILY = replace(LLAMA, name="qwen3", model_types=("qwen3",), untapered={"q_norm": PER_HEAD_QK, "k_norm": PER_HEAD_QK})
