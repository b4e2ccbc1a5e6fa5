"""Gemma 3 (text: Gemma3ForCausalLM): Gemma 2's sandwich norms plus per-head RMSNorms on q and k, as Qwen3's."""

from dataclasses import replace

from taperfold.families.gemma2 import FAMILY as GEMMA2
from taperfold.families.qwen3 import PER_HEAD_QK

FAMILY = replace(
    GEMMA2, name="gemma3", model_types=("gemma3_text",), untapered={"q_norm": PER_HEAD_QK, "k_norm": PER_HEAD_QK}
)
