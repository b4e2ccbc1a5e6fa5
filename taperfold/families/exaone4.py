"""EXAONE 4: OLMo 2's post-norms (folding backwards into o_proj and down_proj) with per-head q/k norms, as Qwen3's."""

from dataclasses import replace

from taperfold.families.olmo2 import FAMILY as OLMO2
from taperfold.families.qwen3 import PER_HEAD_QK

FAMILY = replace(
    OLMO2, name="exaone4", model_types=("exaone4",), untapered={"q_norm": PER_HEAD_QK, "k_norm": PER_HEAD_QK}
)
