"""transformers' classes for a folded checkpoint (`export --vllm`): after `register_with_transformers()`,
`AutoModelForCausalLM.from_pretrained(OUT/vllm/folded)` loads it, without remote code.

For each served family (taperfold.serving.SERVED), a config class of the family's with taperfold's model type
(`TaperfoldLlamaConfig`), and the family's own causal LM (`TaperfoldLlamaForCausalLM`) with each norm config.json
lists as folded (`taperfold_folded_norms`) or kept whole (`taperfold_kept_norms`) its kind's served form
(taperfold.norms.NormKind.served), called `norm(x)`: transformers' decoder layers add the residual outside the norm.
A folded RMS norm or LayerNorm is the identity there, a folded DyT tanh(α·h); the norm's map is in the weights of the
layers reading it (each layer listed in `taperfold_added_biases` given the bias a β folded into). The real norms (the
final norm, per-head q/k norms) stay transformers' own. The classes are this module's attributes, so that processes
that pickle a config (vLLM's engine) find them by name.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

from taperfold.serving import BIAS_KEY, SERVED, ServedFamily, served_norm, served_norms


def _folded_classes(served: ServedFamily) -> tuple[type, type]:
    """The config and causal LM classes of a folded checkpoint of `served`'s family."""
    base_config = getattr(transformers, served.config_class)
    base_model = getattr(transformers, served.model_class)
    config = type(
        f"Taperfold{served.config_class}", (base_config,), {"model_type": served.model_type, "__module__": __name__}
    )

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        base_model.__init__(self, config, *args, **kwargs)
        for path, folded in served_norms(config):
            self.set_submodule(path, served_norm(config, self.get_submodule(path), folded))
        for path in getattr(config, BIAS_KEY, []):
            give_bias(self.get_submodule(path))

    model = type(
        served.architecture, (base_model,), {"config_class": config, "__init__": __init__, "__module__": __name__}
    )
    return config, model


def give_bias(layer: nn.Module) -> None:
    """The bias parameter nn.Linear(..., bias=True) would have: a LayerNorm's or a DyT's β folded into a layer built
    without one (the checkpoint holds it: `taperfold_added_biases`)."""
    if not isinstance(layer, nn.Linear) or layer.bias is not None:
        raise TypeError(f"{type(layer).__name__}: a fold's bias goes to an nn.Linear without one")
    layer.bias = nn.Parameter(torch.zeros(layer.out_features, dtype=layer.weight.dtype, device=layer.weight.device))


def _base_class(served: ServedFamily, config: type) -> type:
    """The family's model without its head, for the folded config (what vLLM's Transformers backend builds through
    AutoModel, whose registration asks for the model's config class to be the config's): its norms as they are, the
    backend's caller replaces the folded ones (taperfold.serving.vllm_models)."""
    base = getattr(transformers, served.base_model_class)
    name = f"Taperfold{served.base_model_class}"
    return type(name, (base,), {"config_class": config, "__module__": __name__})


CLASSES = {family: _folded_classes(served) for family, served in SERVED.items()}
BASE_CLASSES = {family: _base_class(SERVED[family], config) for family, (config, _) in CLASSES.items()}
for _config, _model in CLASSES.values():
    globals()[_config.__name__], globals()[_model.__name__] = _config, _model
for _base in BASE_CLASSES.values():
    globals()[_base.__name__] = _base


def register_with_transformers() -> None:
    """Make every served family's folded checkpoint loadable by AutoConfig and AutoModelForCausalLM (again: no-op)."""
    for family, (config, model) in CLASSES.items():
        transformers.AutoConfig.register(SERVED[family].model_type, config, exist_ok=True)
        transformers.AutoModelForCausalLM.register(config, model, exist_ok=True)
        # vLLM's Transformers backend builds the family's model without its head through AutoModel
        transformers.AutoModel.register(config, BASE_CLASSES[family], exist_ok=True)
        served = SERVED[family]
        family_type = getattr(transformers, served.config_class).model_type
        _share_conversion_mapping(served.model_type, family_type)
        _share_conversion_mapping(served.architecture, served.model_class)  # by class (a legacy name)


def _share_conversion_mapping(ours: str, family: str) -> None:
    """The family's checkpoint conversion mapping (its MoE experts stored one by one, stacked on loading; a legacy
    name) for taperfold's model type or class too (`ours`), which transformers and vLLM's Transformers backend look
    mappings up by: the folded checkpoint stores the family's names (taperfold.artifacts.vllm_checkpoint). A
    transformers without such mappings stores the modules' names."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:
        return
    mapping = get_checkpoint_conversion_mapping(family)
    if mapping is not None:
        register_checkpoint_conversion_mapping(ours, mapping, overwrite=True)
