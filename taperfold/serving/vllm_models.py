"""vLLM's model classes for folded checkpoints (`export --vllm`), imported by vLLM where it builds a model (the
plugin registers them by name: taperfold.serving.vllm_plugin).

Each is vLLM's own class of the family (found in vLLM's registry under the family's architecture: its own model file,
or for families it has none for, SmolLM3, OLMo 2 and GPT-NeoX, its Transformers backend, which builds transformers'
model without its head through AutoModel: taperfold.serving.transformers_models registers it), with each norm
config.json lists as folded (`taperfold_folded_norms`) or kept whole (`taperfold_kept_norms`) replaced by its kind's
served form (taperfold.norms.NormKind.served: the residual add alone for a folded RMS norm or LayerNorm, tanh(α·h) for
a folded DyT, the whole DyT for one kept), and each linear layer a β gave a bias (`taperfold_added_biases`) given
vLLM's own bias parameter; everything else, the real norms (the final norm, the scale anchor; per-head q/k norms)
included, stays vLLM's: its attention, kernels, weight loading (the checkpoint holds what the served forms hold, a
DyT's α, and no folded weight the model no longer asks for), tensor and pipeline parallel sharding.

vLLM's decoder layers call a norm `norm(x)` (the first layer's input norm; a post-norm on a sub-block's output; every
norm of a layer transformers writes, which adds the residual outside) and expect the normalized x, or
`norm(x, residual)` (its fused add-and-normalize) and expect (normalized sum, sum): the served forms answer both
(taperfold.nn.ServedNorm).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm import ModelRegistry
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.models.utils import PPMissingLayer
from vllm.model_executor.utils import set_weight_attrs

from taperfold.serving import BIAS_KEY, SERVED, ServedFamily, served_norm, served_norms


def _norm_free(served: ServedFamily) -> type[nn.Module]:
    """vLLM's class of `served`'s family, its folded and kept norms replaced after it is built."""
    base = ModelRegistry.models[served.model_class].load_model_cls()

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        hf_config = vllm_config.model_config.hf_config
        for checkpoint_path, folded in served_norms(hf_config):
            path = _module_path(self, checkpoint_path)
            if _on_this_rank(self, path):
                self.set_submodule(path, served_norm(hf_config, self.get_submodule(path), folded))
        for checkpoint_path in getattr(hf_config, BIAS_KEY, []):
            path = _module_path(self, checkpoint_path)  # q_proj -> the fused qkv_proj, gate_proj -> gate_up_proj
            if _on_this_rank(self, path):
                _give_bias(self.get_submodule(path))

    return type(served.architecture, (base,), {"__init__": __init__, "__module__": __name__})


def _give_bias(layer: nn.Module) -> None:
    """The bias parameter vLLM's linear layer makes with bias=True (this rank's part of the output, loaded by the
    layer's own weight loader, shard by shard for a fused layer): a LayerNorm's or a DyT's β folded into a layer the
    family builds without one (`taperfold_added_biases`). A fused layer is listed once per part: given one bias."""
    if not isinstance(layer, LinearBase):
        raise TypeError(f"{type(layer).__name__}: a fold's bias goes to one of vLLM's linear layers")
    if layer.bias is not None:
        return
    size = getattr(layer, "output_size_per_partition", layer.output_size)  # column-parallel: its shard
    bias = nn.Parameter(torch.zeros(size, dtype=layer.params_dtype, device=layer.weight.device), requires_grad=False)
    set_weight_attrs(bias, {"output_dim": 0, "weight_loader": layer.weight_loader})
    layer.bias, layer.has_bias = bias, True


def _module_path(model: nn.Module, checkpoint_path: str) -> str:
    """Where vLLM's class holds the module the checkpoint names `checkpoint_path`: its own weights mapper's name for
    the module's weight (the Transformers backend holds the family's model as `model`, where the checkpoint has the
    family's prefix, GPT-NeoX's `gpt_neox.`); the checkpoint's path where the class maps no names."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapped = mapper.map_name(f"{checkpoint_path}.weight") if mapper is not None else None
    return mapped.removesuffix(".weight") if mapped is not None else checkpoint_path


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
