"""Mistral: Llama's layout (sliding-window attention does not touch the norms)."""

from dataclasses import replace

from taperfold.families.llama import FAMILY as LLAMA

FAMILY = replace(LLAMA, name="mistral", model_types=("mistral",))
