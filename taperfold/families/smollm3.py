"""SmolLM3: Llama's layout and norms (the layers without RoPE are its modeling code's business)."""

from dataclasses import replace

from taperfold.families.llama import FAMILY as LLAMA

FAMILY = replace(LLAMA, name="smollm3", model_types=("smollm3",))
