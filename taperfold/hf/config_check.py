"""config.json of a Hugging Face directory, checked before transformers reads it, and transformers' config object for
it (`transformers_config`). Each problem is one `TaperfoldError` naming the file and the key.

Checked on config.json itself, before transformers builds a config object (some build a list per layer) or a model,
even on the meta device: a config is input, and a wrong one must fail in one line, not in a ZeroDivisionError or
after minutes of building 10^9 layers. Then the same keys as the config object holds them (its defaults included),
and the parameters they imply against the values the weights hold (`check_size`), before any model is built.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TypeGuard

from taperfold.errors import TaperfoldError
from taperfold.families import Family
from taperfold.hf.config_values import config_value, context_length, language_config
from taperfold.hf.taper_block import BLOCK
from taperfold.hf.trace import GUIDE, shipped_note
from taperfold.numeric import is_finite_number
from taperfold.sources.checks import MAX_PARAMETERS_RATIO, implied_parameters, printable, short

# Types and ranges of the numeric keys taperfold and transformers' model construction read, as transformers
# names them (`attribute_map` gives a family's own spelling: GPT-2's n_embd, n_layer, n_head, n_positions).
# The bounds are taperfold.models.config's, far above any real model (Llama 3.1 405B: hidden 16384, 126 layers,
# 128k context).
_INT_KEYS = {  # name -> (low, high, null allowed)
    "vocab_size": (1, 1 << 24, False),
    "hidden_size": (1, 1 << 16, False),
    "num_hidden_layers": (1, 1024, False),
    "num_attention_heads": (1, 1024, False),
    "num_key_value_heads": (1, 1024, True),
    "head_dim": (1, 1 << 16, True),
    "intermediate_size": (1, 1 << 18, False),
    "ffn_dim": (1, 1 << 18, False),  # OPT's intermediate size
    "n_inner": (1, 1 << 18, True),  # GPT-2's (null: 4 × n_embd)
    "word_embed_proj_dim": (1, 1 << 16, True),  # OPT
    "max_position_embeddings": (1, 1 << 20, False),
    "original_max_position_embeddings": (1, 1 << 20, True),  # Phi-3
    "max_seq_len": (1, 1 << 20, True),  # MPT's context
}
_MISSING = object()
TEXT_CONFIG = "text_config"  # a multimodal model's language model config, nested in its own
_PER_LAYER_KEYS = ("intermediate_size",)  # may be a list, one value per layer (Gemma 3n)
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # routed experts, as families name them
_FLOAT_KEYS = {  # name -> (low, excluded; high, included)
    "rms_norm_eps": (0.0, 1.0),
    "layer_norm_eps": (0.0, 1.0),
    "layer_norm_epsilon": (0.0, 1.0),  # GPT-2
    "rope_theta": (0.0, 1e12),
    "rotary_emb_base": (0.0, 1e12),  # GPT-NeoX's rope_theta, as older configs spell it
    "partial_rotary_factor": (0.0, 1.0),
    "rotary_pct": (0.0, 1.0),  # GPT-NeoX's partial_rotary_factor, as older configs spell it
}
# a norm epsilon a config may leave null where its norms use another key's, or their own (Cohere 2 MoE)
_NULLABLE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
_ROPE_BLOCKS = ("rope_parameters", "rope_scaling")  # objects holding rope_theta / partial_rotary_factor
_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(
    where: Path, key: str, value, low: int, high: int, nullable: bool, layers=None, per_layer: bool = False
) -> None:
    """An integer key in [low, high]; for a per-layer key (_PER_LAYER_KEYS, or any with `per_layer`: a value read
    from a heterogeneous config's layers) a list of them, one per layer (`layers`: num_hidden_layers where known),
    is checked element by element."""
    if value is None and nullable:
        return
    if isinstance(value, list) and (per_layer or key in _PER_LAYER_KEYS):
        if not value or (_is_int(layers) and len(value) != layers):
            raise TaperfoldError(
                f"{where}: key '{key}' is a list of {len(value)} values; a per-layer list needs one per layer "
                f"({layers if _is_int(layers) else 'num_hidden_layers'})"
            )
        for i, element in enumerate(value):
            _check_int(where, f"{key}[{i}]", element, low, high, nullable=False)
        return
    if not _is_int(value) or not low <= value <= high:
        raise TaperfoldError(
            f"{where}: key '{key}' must be {'null or ' if nullable else ''}an integer in "
            f"[{low}, {high}], got {short(value)}"
        )


def _check_float(where: Path, key: str, value, low: float, high: float) -> None:
    if not is_finite_number(value) or not low < value <= high:
        raise TaperfoldError(f"{where}: key '{key}' must be a number in ({low:g}, {high:g}], got {short(value)}")


def _json_names(config_class, name: str) -> list[str]:
    """The spellings of a key config.json may use: transformers' standard name and the family's own."""
    alias = (getattr(config_class, "attribute_map", None) or {}).get(name)
    return [name] if not isinstance(alias, str) or alias == name else [name, alias]


def _json_name(config_class, name: str) -> str:
    return _json_names(config_class, name)[-1]


def _check_config_json(
    config: dict, config_class, where: Path, head_dim_frees_hidden: bool = True, prefix: str = ""
) -> None:
    """The numeric keys of config.json, as written, before transformers reads them. With a `head_dim`, the hidden
    size need not be a multiple of the heads (Gemma, Qwen3) unless `head_dim_frees_hidden` is false: after
    transformers refused the config (its Llama requires it anyway), to name the key. A multimodal model's nested
    text config (`text_config`) is checked the same way, its keys named under it (`prefix`)."""
    layers = next((config[k] for k in _json_names(config_class, "num_hidden_layers") if k in config), None)
    for name, (low, high, nullable) in _INT_KEYS.items():
        for key in _json_names(config_class, name):
            if key in config:
                _check_int(where, prefix + key, config[key], low, high, nullable, layers)
    _check_experts(where, config, prefix)
    for name, (above, up_to) in _FLOAT_KEYS.items():
        for key in _json_names(config_class, name):
            if key in config and not (config[key] is None and name in _NULLABLE_FLOATS):
                _check_float(where, prefix + key, config[key], above, up_to)
    for block in _ROPE_BLOCKS:
        value = config.get(block)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise TaperfoldError(f"{where}: key '{prefix}{block}' must be null or an object, got {short(value)}")
        # one set of parameters, or one per attention type ({"full_attention": {...}, ...})
        for block_name, params in [(prefix + block, value)] + [
            (f"{prefix}{block}.{printable(k)}", v) for k, v in value.items() if isinstance(v, dict)
        ]:
            for name in _ROPE_KEYS:
                if name in params:
                    _check_float(where, f"{block_name}.{name}", params[name], *_FLOAT_KEYS[name])

    def given(name):  # the value config.json gives for a standard name, or None
        return next((config[k] for k in reversed(_json_names(config_class, name)) if config.get(k) is not None), None)

    def json_name(name):
        return prefix + _json_name(config_class, name)

    heads, kv_heads, hidden = given("num_attention_heads"), given("num_key_value_heads"), given("hidden_size")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise TaperfoldError(
            f"{where}: key '{json_name('num_key_value_heads')}' is {kv_heads}, "
            f"which does not divide '{json_name('num_attention_heads')}' ({heads})"
        )
    if (
        heads is not None
        and hidden is not None
        and hidden % heads
        and (given("head_dim") is None or not head_dim_frees_hidden)
    ):
        why = (
            "the head dimension is their quotient"
            if given("head_dim") is None
            else f"transformers' {config_class.__name__} requires it"
        )
        raise TaperfoldError(
            f"{where}: key '{json_name('hidden_size')}' is {hidden}, not a multiple "
            f"of '{json_name('num_attention_heads')}' ({heads}); {why}"
        )
    vocab, pad = given("vocab_size") or getattr(config_class, "vocab_size", None), config.get("pad_token_id")
    if pad is not None and _is_int(vocab) and not (_is_int(pad) and -vocab <= pad < vocab):
        raise TaperfoldError(
            f"{where}: key '{prefix}pad_token_id' must be null or a token id, an integer in "
            f"[{-vocab}, {vocab - 1}], got {short(pad)}"
        )
    text = config.get(TEXT_CONFIG)
    text_class = _sub_config_class(config_class, text)
    if not prefix and isinstance(text, dict) and text_class is not None:
        _check_config_json(text, text_class, where, head_dim_frees_hidden, prefix=f"{TEXT_CONFIG}.")


def _sub_config_class(config_class, text):
    """The config class of a nested text config (`text`: as config.json holds it): the one its model_type names,
    else the one the outer class declares; None where there is no such config."""
    from transformers import CONFIG_MAPPING

    if not isinstance(text, dict):
        return None
    model_type = text.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    declared = (getattr(config_class, "sub_configs", None) or {}).get(TEXT_CONFIG)
    return declared if isinstance(declared, type) else None


def _check_config_object(hf_config, where: Path, context: int | None) -> None:
    """The same keys as transformers' config object holds them: its defaults included, and the ones it derives
    (`context`: the family's, for configs that state none). Of a multimodal model, its language model's."""
    config = language_config(hf_config)
    cls, prefix = type(config), "" if config is hf_config else f"{TEXT_CONFIG}."

    def json_name(name):
        return prefix + _json_name(cls, name)

    # an attention-free model (Mamba) states no heads, nor a context: its recurrence takes any length
    attention_free = config_value(config, "num_attention_heads") is None
    stated_context = context or attention_free or context_length(config)
    required = [
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        *([] if stated_context else ["max_position_embeddings"]),
    ]
    for name in required:
        if config_value(config, name) is None:
            raise TaperfoldError(
                f"{where}: key '{json_name(name)}' is missing (transformers' {cls.__name__} has no default for it)"
            )
    hidden, layers = config.hidden_size, config.num_hidden_layers
    for name, (low, high, nullable) in _INT_KEYS.items():
        value = config_value(config, name, _MISSING)
        if value is not _MISSING:
            _check_int(where, json_name(name), value, low, high, nullable, layers, per_layer=True)
    _check_experts(
        where, {k: getattr(config, k) for k in (*_EXPERT_KEYS, "num_experts_per_tok") if hasattr(config, k)}, prefix
    )
    if attention_free:
        return
    # per layer: a heterogeneous config's layers may differ in heads (dots.llm3's latent-attention layers)
    all_heads = _each_layer(config_value(config, "num_attention_heads"), layers)
    all_kv_heads = _each_layer(config_value(config, "num_key_value_heads"), layers)
    all_head_dims = _each_layer(config_value(config, "head_dim"), layers)
    for layer, (heads, kv_heads, head_dim) in enumerate(zip(all_heads, all_kv_heads, all_head_dims)):
        at = f" in layer {layer}" if len(set(all_heads)) > 1 or len(set(all_kv_heads)) > 1 else ""
        if heads % (kv_heads or heads):
            raise TaperfoldError(
                f"{where}: key '{json_name('num_key_value_heads')}' is {kv_heads}{at}, which does "
                f"not divide '{json_name('num_attention_heads')}' ({heads})"
            )
        if head_dim is None and hidden % heads:
            raise TaperfoldError(
                f"{where}: key '{json_name('hidden_size')}' is {hidden}, not a multiple of "
                f"'{json_name('num_attention_heads')}' ({heads}{at})"
            )


def _each_layer(value, layers: int) -> list:
    """A per-layer list as it is, one value repeated for every layer."""
    return value if isinstance(value, list) else [value] * layers


def _smallest(value):
    """A per-layer list's smallest value (a lower bound on the parameters), else the value."""
    return min(value) if isinstance(value, list) else value


def _check_experts(where: Path, config: dict, prefix: str = "") -> None:
    """A MoE config's routed experts and the number each token picks: integers, the second no more than the first
    (a router's top-k of more experts than there are fails deep inside the model's forward)."""
    experts = next(((prefix + k, config[k]) for k in _EXPERT_KEYS if config.get(k) is not None), None)
    per_token = config.get("num_experts_per_tok")
    if experts is not None:
        _check_int(where, experts[0], experts[1], 0, 1 << 16, nullable=False)  # 0: a dense model (some families)
    if per_token is None:
        return
    _check_int(where, f"{prefix}num_experts_per_tok", per_token, 1, 1 << 16, nullable=False)
    if experts is not None and 0 < experts[1] < per_token:
        raise TaperfoldError(
            f"{where}: key '{prefix}num_experts_per_tok' is {per_token}, more than the {experts[1]} experts "
            f"'{experts[0]}' gives: each token picks that many of them"
        )


def _intermediate(hf_config) -> tuple[str, int]:
    """The MLP's intermediate size (per-layer list: the smallest, for a lower bound on the parameters)."""
    for name in ("intermediate_size", "ffn_dim", "n_inner"):
        value = config_value(hf_config, name)
        if value:
            return _json_name(type(hf_config), name), _smallest(value)
    return "n_inner", 4 * hf_config.hidden_size  # GPT-2's default


def check_size(hf_config, present: int, where: Path, weights: Path) -> None:
    """Refuse a config far larger than the weights before anything is built, even on the meta device; smaller
    mismatches get the exact tensor from taperfold.sources.checks.check_state. Of a multimodal model, the language
    model's size is the lower bound."""
    config = language_config(hf_config)
    cls, prefix = type(config), "" if config is hf_config else f"{TEXT_CONFIG}."
    hidden, layers = config.hidden_size, config.num_hidden_layers
    attention = min(  # the narrowest layer's, for a lower bound on the parameters (none: attention-free)
        heads * (head_dim or hidden // heads) if heads else 0
        for heads, head_dim in zip(
            _each_layer(config_value(config, "num_attention_heads"), layers),
            _each_layer(config_value(config, "head_dim"), layers),
        )
    )
    implied = implied_parameters(
        vocab_size=config.vocab_size,
        hidden=hidden,
        layers=layers,
        attention=attention,
        intermediate=_intermediate(config)[1],
    )
    if implied <= MAX_PARAMETERS_RATIO * present:
        return
    sizes = [
        (_json_name(cls, name), config_value(config, name))
        for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim")
        if config_value(config, name, _MISSING) is not _MISSING
    ]
    keys = ", ".join(
        f"'{prefix}{key}' = {value}"
        for key, value in (*sizes, _intermediate(config), (_json_name(cls, "vocab_size"), config.vocab_size))
    )
    raise TaperfoldError(
        f"{where}: keys {keys} describe a model of at least {implied:,} parameters, but {weights} "
        f"holds {present:,} values; config.json does not match the weights"
    )


def transformers_config(config: dict, where: Path, family: Family | None):
    """transformers' config object for config.json (`family`: the shipped one, None for a model_type traced)."""
    from transformers import CONFIG_MAPPING

    plain = {k: v for k, v in config.items() if k != BLOCK}
    try:
        config_class = CONFIG_MAPPING[plain["model_type"]]
    except (KeyError, TypeError):  # a model type this transformers does not know (a family may be registered for it)
        raise TaperfoldError(
            f"{where}: key 'model_type' is {short(plain.get('model_type'))}, which this "
            f"transformers has no config class for ({shipped_note()}; {GUIDE} says how to add "
            "one)"
        ) from None
    _check_config_json(plain, config_class, where)
    try:
        hf_config = config_class.from_dict(plain)
    except Exception as e:  # noqa: BLE001 - transformers' validation (huggingface_hub's strict dataclasses among
        # others) refused the config, which is input: one line, whatever it raised, naming the key where it can
        _check_config_json(plain, config_class, where, head_dim_frees_hidden=False)
        detail = " ".join(str(e).split())
        field_name = re.search(r"field '(\w+)'", detail)
        key = f"key '{field_name.group(1)}': " if field_name and field_name.group(1) in plain else ""
        raise TaperfoldError(f"{where}: {key}not a valid {plain['model_type']} config ({detail})") from None
    _check_config_object(hf_config, where, family.context if family is not None else None)
    return hf_config
