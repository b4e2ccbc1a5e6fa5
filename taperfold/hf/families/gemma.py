"""Gemma: Llama's layout, but the norm computes x / r(x) · (1 + w): γ is stored as an offset from 1."""

from taperfold.hf.families import Family, register
from taperfold.hf.families.llama import FAMILY as LLAMA

FAMILY = register(Family(**{**LLAMA.__dict__, "name": "gemma", "model_types": ("gemma",), "gain_offset": 1.0}))
