"""Qwen2: Llama's layout; q, k and v carry biases (a fold keeps them)."""

from taperfold.hf.families import Family, register
from taperfold.hf.families.llama import FAMILY as LLAMA

FAMILY = register(Family(**{**LLAMA.__dict__, "name": "qwen2", "model_types": ("qwen2",)}))
