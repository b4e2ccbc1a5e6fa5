"""Gemma: Llama's layout, but the norm computes x / r(x) · (1 + w): γ is stored as an offset from 1."""

from dataclasses import replace

from taperfold.families.llama import FAMILY as LLAMA

FAMILY = replace(LLAMA, name="gemma", model_types=("gemma",), gain_offset=1.0)
