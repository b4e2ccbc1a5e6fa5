"""Mistral: Llama's layout (sliding-window attention does not touch the norms)."""

from taperfold.hf.families import Family, register
from taperfold.hf.families.llama import FAMILY as LLAMA

FAMILY = register(Family(**{**LLAMA.__dict__, "name": "mistral", "model_types": ("mistral",)}))
