"""Reading a transformers config whose values may differ per layer.

transformers 5 configs can be heterogeneous (`per_layer_config`: Gemma 4's full-attention layers have their own
head_dim); reading such a per-layer attribute on the global config raises transformers'
AmbiguousGlobalPerLayerAttributeError instead of returning a value. `config_value` reads it either way.
"""

from __future__ import annotations

from typing import Any


def config_value(config, name: str, default: Any = None) -> Any:
    """`config.name` (`default` where the config has none); for an attribute that differs per layer, the list of its
    values, layer by layer (one value where every layer has the same)."""
    try:
        return getattr(config, name, default)
    except RuntimeError as e:  # AmbiguousGlobalPerLayerAttributeError (matched by name: older transformers lack it)
        if type(e).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
    values = [getattr(layer, name, default) for layer in config.per_layer_config]
    return values[0] if all(v == values[0] for v in values) else values
