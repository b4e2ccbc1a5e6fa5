"""vLLM's model classes for folded checkpoints (`export --vllm`), imported by vLLM where it builds a model (the
plugin registers them by name: taperfold.serving.vllm_plugin).

Each is vLLM's own class of the family (found in vLLM's registry under the family's architecture: its own model file,
or for families it has none for, SmolLM3 and OLMo 2, its Transformers backend, which builds transformers' model
without its head through AutoModel: taperfold.serving.transformers_models registers it), with each norm
config.json lists as folded (`taperfold_folded_norms`) replaced by `ResidualAdd`; everything else, the real norms
(the final norm, the scale anchor; per-head q/k norms) included, stays vLLM's: its attention, kernels, weight loading
(the folded norms' weights are not in the checkpoint, and the model no longer asks for them), tensor and pipeline
parallel sharding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm import ModelRegistry
from vllm.model_executor.models.utils import PPMissingLayer

from taperfold.serving import CONFIG_KEY, SERVED, ServedFamily


class ResidualAdd(nn.Module):
    """What a folded norm leaves in a vLLM decoder layer. vLLM's layers call a norm as `norm(x)` (the first layer's
    input norm; a post-norm on a sub-block's output; every norm of a layer transformers writes, which adds the
    residual outside) and expect the normalized x, or as `norm(x, residual)` (its fused add-and-normalize) and expect
    (normalized sum, sum); the norm's map now lives in the weights of the layers reading (or producing) its input, so
    x, or the sum twice."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return x
        total = x + residual
        return total, total


def _norm_free(served: ServedFamily) -> type[nn.Module]:
    """vLLM's class of `served`'s family, its folded norms replaced after it is built."""
    base = ModelRegistry.models[served.model_class].load_model_cls()

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        for path in getattr(vllm_config.model_config.hf_config, CONFIG_KEY):
            if _on_this_rank(self, path):
                self.set_submodule(path, ResidualAdd())

    return type(served.architecture, (base,), {"__init__": __init__, "__module__": __name__})


def _on_this_rank(model: nn.Module, path: str) -> bool:
    """Whether the module at `path` is built in this process (pipeline parallel leaves other stages' layers out as
    PPMissingLayer); a path that names nothing at all is an error, never skipped."""
    module = model
    for part in path.split("."):
        if isinstance(module, PPMissingLayer):
            return False
        module = module.get_submodule(part)
    return not isinstance(module, PPMissingLayer)


for _served in SERVED.values():
    globals()[_served.architecture] = _norm_free(_served)
