"""Granite: Llama's layout and norms. Its embedding, residual, attention and logit multipliers are its modeling code's
business: they are in the exported graph because its own forward runs."""

from dataclasses import replace

from taperfold.families.llama import FAMILY as LLAMA

FAMILY = replace(LLAMA, name="granite", model_types=("granite",))
