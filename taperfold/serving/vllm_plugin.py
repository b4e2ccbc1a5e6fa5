"""vLLM's entry point into taperfold (pyproject.toml, group `vllm.general_plugins`), which vLLM calls in each of its
processes before it reads a model: every served family's folded checkpoint gets its architecture registered, by name
only (the class is imported where vLLM builds the model, taperfold.serving.vllm_models), and its config class
registered with transformers, through whose AutoConfig vLLM reads config.json."""

from __future__ import annotations

from taperfold.serving import SERVED

MODELS = "taperfold.serving.vllm_models"


def register() -> None:
    from vllm import ModelRegistry

    from taperfold.serving.transformers_models import register_with_transformers

    register_with_transformers()
    for served in SERVED.values():
        ModelRegistry.register_model(served.architecture, f"{MODELS}:{served.architecture}")
