"""Qwen2: Llama's layout; q, k and v carry biases (a fold keeps them)."""

from dataclasses import replace

from taperfold.families.llama import FAMILY as LLAMA

FAMILY = replace(LLAMA, name="qwen2", model_types=("qwen2",))
