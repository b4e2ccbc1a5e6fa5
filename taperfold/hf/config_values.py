"""Reading a transformers config as transformers writes it.

transformers 5 configs can be heterogeneous (`per_layer_config`: Gemma 4's full-attention layers have their own
head_dim); reading such a per-layer attribute on the global config raises transformers'
AmbiguousGlobalPerLayerAttributeError instead of returning a value. `config_value` reads it either way.

A multimodal model (Gemma 3, Fuyu, GOT-OCR 2) holds its language model's config as `text_config`; taperfold exports
that language model, and reads its sizes from `language_config`.

config.json holds a float JSON cannot (inf, nan) as `{"__float__": "Infinity"}` (Bamba's time_step_limit: [0.0,
inf]); transformers decodes it when it reads the file, and so does `decoded_floats` for taperfold, which reads the
file itself.
"""

from __future__ import annotations

from typing import Any

_FLOAT_TAG = "__float__"
_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decoded_floats(value: Any) -> Any:
    """`value` (config.json's parsed contents) with transformers' tagged floats as floats."""
    if isinstance(value, dict):
        if set(value) == {_FLOAT_TAG} and value[_FLOAT_TAG] in _FLOATS:
            return _FLOATS[value[_FLOAT_TAG]]
        return {k: decoded_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decoded_floats(v) for v in value]
    return value


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


def layer_zero(value: Any) -> Any:
    """Layer 0's value of what `config_value` read (a per-layer list), else the value."""
    return value[0] if isinstance(value, list) else value


def language_config(config) -> Any:
    """The config of a multimodal model's language model (its nested text config), else the config itself."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config(decoder=True) if get_text_config is not None else config


# The names a config gives its context under: transformers' standard one, and MPT's (ALiBi, trained at that length)
CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len")


def context_length(config) -> int | None:
    """The context `config` states (CONTEXT_KEYS), else None."""
    return next((v for k in CONTEXT_KEYS if isinstance(v := getattr(config, k, None), int)), None)


def attention_window(config) -> int | None:
    """The fewest keys any attention layer of `config`'s language model sees, where a layer sees a window of them (a
    sliding window, or a chunk), as transformers' cache reads it: the layers `layer_types` names sliding or chunked
    (Gemma 2/3, gpt-oss; Qwen2's `use_sliding_window` sets them), or each layer where a config with a `sliding_window`
    names none (Mistral); else None."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    _, per_layer = get_layer_types_and_kwargs(language_config(config))
    windows = [k["sliding_window"] for k in per_layer if isinstance(k.get("sliding_window"), int)]
    return min(windows, default=None)
