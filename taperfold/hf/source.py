"""The Hugging Face directory as a model source: what `save_pretrained` writes, plus a `taperfold` block in
config.json when the model is tapered.

    DIR/config.json                      transformers' config + "taperfold": {format_version, gate, taper,
                                         step, schedule, aux, calibration[, family]}
    DIR/model.safetensors                or model-0000i-of-0000n.safetensors + model.safetensors.index.json
    DIR/tokenizer.json ...               optional: the tokenizer, as save_pretrained writes it

Loading never runs code from the directory: the model class comes from transformers' own registry for
`model_type` (AutoModelForCausalLM.from_config; a config asking for its own code through `auto_map` is
refused), the weights are read with safetensors only. A directory without the block is a plain
(untapered) model. See docs/checkpoint-format.md. A model_type no family is shipped for gets one by tracing
transformers' model (taperfold.hf.trace); a tapered directory records it as data (`taperfold.family`), so it
is read back, not traced again. Experts that save_pretrained writes one by one (MoE: `experts.0.w1.weight`) are
stacked by transformers' own conversion mapping for the model type, applied to the tensors read.

A directory is input and is checked as taperfold's own checkpoints are (taperfold.sources.builtin), each problem
one `TaperfoldError` naming the file and the key: config.json's numeric keys (types and ranges) before
transformers reads them, the parameter count the config implies against the values the weights hold before a
model is built (even on the meta device), the names and shapes of the tensors, then NaN and Inf in any
floating-point tensor and each tapered norm's c in (0, 1e6]. `save_hf_directory` writes nothing that loading
would refuse (NaN or Inf in a parameter or buffer, a block out of range).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from taperfold.errors import TaperfoldError, first_line
from taperfold.families import Family, family_for, is_registered
from taperfold.families.serialize import family_from_data, family_to_data
from taperfold.fsutil import atomic_dir, read_json_object
from taperfold.hf.model import HFCausalLM, HFModelInfo, cached_heads
from taperfold.hf.taper import taper_model, tapering_of
from taperfold.hf.trace import GUIDE, check_family_paths, shipped_note, traced_family
from taperfold.models import assign_weights, parameters_on_meta
from taperfold.sources.base import ModelSource, read_safetensors
from taperfold.sources.builtin import C_RANGE
from taperfold.taper import TAPERS

BLOCK = "taperfold"
BLOCK_VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
TAPER_KEYS = ("weight_tilde", "c", "ema_num", "ema_den", "ema_count", "calibrated")  # what tapering adds
INSTALL_HINT = "pip install 'taperfold[hf]'"


def require_transformers(what: str = "a Hugging Face directory") -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise TaperfoldError(f"{what} needs transformers, which is not installed: {INSTALL_HINT}") from None


def is_hf_directory(path: str | Path) -> bool:
    """A directory whose config.json is a transformers config (not a taperfold-checkpoint header)."""
    config = Path(path) / CONFIG
    if not Path(path).is_dir() or not config.is_file():
        return False
    try:
        header = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError):  # not JSON Python reads: the checkpoint reader names the file
        return False
    return isinstance(header, dict) and "format" not in header


# ---- the taperfold block ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaperBlock:
    gate: float
    taper: str
    step: int = 0
    schedule: dict | None = None  # {"taper_start": int, "taper_end": int}
    aux: dict | None = None  # {"weight": λ, "target": s_tgt or null}
    calibration: dict = field(default_factory=lambda: {"momentum": 0.1, "delta": 1e-8})
    family: Family | None = None  # a traced family (no shipped one for the model_type), as it was tapered with
    format_version: int = BLOCK_VERSION

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "gate": self.gate,
            "taper": self.taper,
            "step": self.step,
            "schedule": self.schedule,
            "aux": self.aux,
            "calibration": self.calibration,
            **({"family": family_to_data(self.family)} if self.family is not None else {}),
        }


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_BLOCK_KEYS = ("format_version", "gate", "taper", "step", "schedule", "aux", "calibration", "family")


def parse_block(raw, where: Path, model_type: str = "") -> TaperBlock:
    """Validate config.json's `taperfold` block; one error naming the file and the key otherwise."""

    def bad(key: str, why: str):
        return TaperfoldError(f"{where}: key '{BLOCK}.{key}' {why}")

    if not isinstance(raw, dict):
        raise TaperfoldError(f"{where}: key '{BLOCK}' must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_BLOCK_KEYS))
    if unknown:
        raise bad(unknown[0], f"is not a known key ({', '.join(_BLOCK_KEYS)})")
    if raw.get("format_version") != BLOCK_VERSION:
        raise bad("format_version", f"is {raw.get('format_version')!r}; this taperfold reads version {BLOCK_VERSION}")
    gate = raw.get("gate")
    if not _number(gate) or not 0.0 <= gate <= 1.0:
        raise bad("gate", f"must be a number in [0, 1], got {gate!r}")
    if raw.get("taper") not in TAPERS:
        raise bad("taper", f"must be one of {', '.join(TAPERS)}, got {raw.get('taper')!r}")
    step = raw.get("step", 0)
    if not _int(step):
        raise bad("step", f"must be a non-negative integer, got {step!r}")
    schedule = raw.get("schedule")
    if schedule is not None:
        if not isinstance(schedule, dict) or set(schedule) != {"taper_start", "taper_end"}:
            raise bad("schedule", "must be null or an object with taper_start and taper_end")
        start, end = schedule["taper_start"], schedule["taper_end"]
        if not (_int(start) and _int(end) and start < end):
            raise bad("schedule", f"needs integers 0 <= taper_start < taper_end, got {start!r}, {end!r}")
    aux = raw.get("aux")
    if aux is not None:
        if not isinstance(aux, dict) or not _number(aux.get("weight")) or aux["weight"] < 0:
            raise bad("aux", "must be null or an object with a non-negative number 'weight'")
        if aux.get("target") is not None and not _number(aux["target"]):
            raise bad("aux.target", f"must be a number or null, got {aux['target']!r}")
    calibration = raw.get("calibration", {"momentum": 0.1, "delta": 1e-8})
    if not isinstance(calibration, dict):
        raise bad("calibration", "must be an object with 'momentum' and 'delta'")
    for key in ("momentum", "delta"):
        value = calibration.get(key)
        if not _number(value) or not (0 < value < 1 if key == "momentum" else value >= 0):
            raise bad(
                f"calibration.{key}",
                f"must be a number in {'(0, 1)' if key == 'momentum' else '[0, ∞)'}, got {value!r}",
            )
    family = family_from_data(raw["family"], model_type, bad) if "family" in raw else None
    return TaperBlock(float(gate), raw["taper"], step, schedule, aux, dict(calibration), family)


# ---- weights --------------------------------------------------------------------------------------------


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a directory, single file or sharded, and the file each came from."""
    single, index = folder / WEIGHTS, folder / INDEX
    if index.is_file():
        return _read_sharded(folder, index)
    if single.is_file():
        tensors = read_safetensors(single)
        return tensors, dict.fromkeys(tensors, single)
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise TaperfoldError(
            f"{folder}: holds PyTorch pickle weights only; taperfold reads safetensors "
            "(save with save_pretrained(..., safe_serialization=True))"
        )
    raise TaperfoldError(f"{folder}: no weights ({WEIGHTS} or {INDEX}); save the model with save_pretrained")


def _read_sharded(folder: Path, index: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise TaperfoldError(f"{index}: key 'weight_map' missing or empty")
    shards: dict[str, str] = {}  # shard file -> the first key naming it
    for key, shard_name in weight_map.items():
        if not isinstance(shard_name, str) or Path(shard_name).name != shard_name:
            raise TaperfoldError(
                f"{index}: key 'weight_map.{_printable(key)}' must be the name of a shard file in "
                f"{folder}, got {_short(shard_name)}"
            )
        shards.setdefault(shard_name, key)
    tensors, origin = {}, {}
    for shard_name, key in sorted(shards.items()):
        shard = folder / shard_name
        if not shard.is_file():
            raise TaperfoldError(
                f"{index}: key 'weight_map.{_printable(key)}': shard {_printable(shard_name)} is missing"
            )
        for name, tensor in read_safetensors(shard).items():
            if name in tensors:
                raise TaperfoldError(f"{shard}: key '{_printable(name)}' is also in {origin[name]}")
            tensors[name], origin[name] = tensor, shard
    for key, shard_name in weight_map.items():
        if key not in tensors:
            raise TaperfoldError(
                f"{index}: key 'weight_map.{_printable(key)}': tensor not found in {_printable(shard_name)}"
            )
    return tensors, origin


def _read_json(path: Path) -> dict:
    """read_json_object, and one line too for JSON that Python's parser refuses other than by JSONDecodeError
    (an integer of more than 4300 digits: ValueError; nesting thousands deep: RecursionError)."""
    try:
        return read_json_object(path)
    except (ValueError, RecursionError) as e:
        raise TaperfoldError(f"{path}: not valid JSON ({first_line(e)})") from None


def _printable(name) -> str:
    """A key from a file as one line of text: control characters (a newline) escaped."""
    name = str(name)
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def _short(value) -> str:
    text = _printable(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


# ---- the config -----------------------------------------------------------------------------------------

# Types and ranges of the numeric keys taperfold and transformers' model construction read, as transformers
# names them (`attribute_map` gives a family's own spelling: GPT-2's n_embd, n_layer, n_head, n_positions).
# Checked on config.json itself, before transformers builds a config object (some build a list per layer) or
# a model, even on the meta device: a config is input, and a wrong one must fail in one line, not in a
# ZeroDivisionError or after minutes of building 10^9 layers. The bounds are taperfold.models.config's, far
# above any real model (Llama 3.1 405B: hidden 16384, 126 layers, 128k context).
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
}
_FLOAT_KEYS = {  # name -> (low, excluded; high, included)
    "rms_norm_eps": (0.0, 1.0),
    "layer_norm_eps": (0.0, 1.0),
    "layer_norm_epsilon": (0.0, 1.0),  # GPT-2
    "rope_theta": (0.0, 1e12),
    "rotary_emb_base": (0.0, 1e12),  # GPT-NeoX's rope_theta, as older configs spell it
    "partial_rotary_factor": (0.0, 1.0),
    "rotary_pct": (0.0, 1.0),  # GPT-NeoX's partial_rotary_factor, as older configs spell it
}
_ROPE_BLOCKS = ("rope_parameters", "rope_scaling")  # objects holding rope_theta / partial_rotary_factor
_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")
_MAX_PARAMETERS_RATIO = 2  # a config implying more than twice the values the weights hold is refused


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _check_int(where: Path, key: str, value, low: int, high: int, nullable: bool) -> None:
    if value is None and nullable:
        return
    if not _is_int(value) or not low <= value <= high:
        raise TaperfoldError(
            f"{where}: key '{key}' must be {'null or ' if nullable else ''}an integer in "
            f"[{low}, {high}], got {_short(value)}"
        )


def _check_float(where: Path, key: str, value, low: float, high: float) -> None:
    if not _is_number(value) or not low < value <= high:
        raise TaperfoldError(f"{where}: key '{key}' must be a number in ({low:g}, {high:g}], got {_short(value)}")


def _json_names(config_class, name: str) -> list[str]:
    """The spellings of a key config.json may use: transformers' standard name and the family's own."""
    alias = (getattr(config_class, "attribute_map", None) or {}).get(name)
    return [name] if not isinstance(alias, str) or alias == name else [name, alias]


def _json_name(config_class, name: str) -> str:
    return _json_names(config_class, name)[-1]


def _check_config_json(config: dict, config_class, where: Path, head_dim_frees_hidden: bool = True) -> None:
    """The numeric keys of config.json, as written, before transformers reads them. With a `head_dim`, the hidden
    size need not be a multiple of the heads (Gemma, Qwen3) unless `head_dim_frees_hidden` is false: after
    transformers refused the config (its Llama requires it anyway), to name the key."""
    for name, (low, high, nullable) in _INT_KEYS.items():
        for key in _json_names(config_class, name):
            if key in config:
                _check_int(where, key, config[key], low, high, nullable)
    for name, (low, high) in _FLOAT_KEYS.items():
        for key in _json_names(config_class, name):
            if key in config:
                _check_float(where, key, config[key], low, high)
    for block in _ROPE_BLOCKS:
        value = config.get(block)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise TaperfoldError(f"{where}: key '{block}' must be null or an object, got {_short(value)}")
        # one set of parameters, or one per attention type ({"full_attention": {...}, ...})
        for prefix, params in [(block, value)] + [
            (f"{block}.{_printable(k)}", v) for k, v in value.items() if isinstance(v, dict)
        ]:
            for name in _ROPE_KEYS:
                if name in params:
                    _check_float(where, f"{prefix}.{name}", params[name], *_FLOAT_KEYS[name])

    def given(name):  # the value config.json gives for a standard name, or None
        return next((config[k] for k in reversed(_json_names(config_class, name)) if config.get(k) is not None), None)

    heads, kv_heads, hidden = given("num_attention_heads"), given("num_key_value_heads"), given("hidden_size")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise TaperfoldError(
            f"{where}: key '{_json_name(config_class, 'num_key_value_heads')}' is {kv_heads}, "
            f"which does not divide '{_json_name(config_class, 'num_attention_heads')}' ({heads})"
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
            f"{where}: key '{_json_name(config_class, 'hidden_size')}' is {hidden}, not a multiple "
            f"of '{_json_name(config_class, 'num_attention_heads')}' ({heads}); {why}"
        )
    vocab, pad = given("vocab_size") or getattr(config_class, "vocab_size", None), config.get("pad_token_id")
    if pad is not None and _is_int(vocab) and not (_is_int(pad) and -vocab <= pad < vocab):
        raise TaperfoldError(
            f"{where}: key 'pad_token_id' must be null or a token id, an integer in "
            f"[{-vocab}, {vocab - 1}], got {_short(pad)}"
        )


def _check_config_object(hf_config, where: Path, context: int | None) -> None:
    """The same keys as transformers' config object holds them: its defaults included, and the ones it derives
    (`context`: the family's, for configs that state none)."""
    cls = type(hf_config)
    required = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        *(() if context else ("max_position_embeddings",)),
    )
    for name in required:
        if getattr(hf_config, name, None) is None:
            raise TaperfoldError(
                f"{where}: key '{_json_name(cls, name)}' is missing (transformers' "
                f"{cls.__name__} has no default for it)"
            )
    for name, (low, high, nullable) in _INT_KEYS.items():
        if hasattr(hf_config, name):
            _check_int(where, _json_name(cls, name), getattr(hf_config, name), low, high, nullable)
    heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise TaperfoldError(
            f"{where}: key '{_json_name(cls, 'num_key_value_heads')}' is {kv_heads}, which does "
            f"not divide '{_json_name(cls, 'num_attention_heads')}' ({heads})"
        )
    if getattr(hf_config, "head_dim", None) is None and hidden % heads:
        raise TaperfoldError(
            f"{where}: key '{_json_name(cls, 'hidden_size')}' is {hidden}, not a multiple of "
            f"'{_json_name(cls, 'num_attention_heads')}' ({heads})"
        )


def _intermediate(hf_config) -> tuple[str, int]:
    for name in ("intermediate_size", "ffn_dim", "n_inner"):
        if getattr(hf_config, name, None):
            return _json_name(type(hf_config), name), getattr(hf_config, name)
    return "n_inner", 4 * hf_config.hidden_size  # GPT-2's default


def implied_parameters(hf_config) -> int:
    """A lower bound on the parameters of any family's model of this config: the embedding, and per layer the
    query and output projections (hidden × heads · head_dim each) and two MLP matrices (hidden × intermediate
    each). As taperfold.models.implied_parameters, compared with the weights before a model is built."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    return hf_config.vocab_size * hidden + hf_config.num_hidden_layers * 2 * hidden * (
        heads * head_dim + _intermediate(hf_config)[1]
    )


def _check_size(hf_config, present: int, where: Path, weights: Path) -> None:
    """Refuse a config far larger than the weights before anything is built, even on the meta device; smaller
    mismatches get the exact tensor from _check_state."""
    implied = implied_parameters(hf_config)
    if implied <= _MAX_PARAMETERS_RATIO * present:
        return
    cls = type(hf_config)
    sizes = [
        (_json_name(cls, name), getattr(hf_config, name))
        for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim")
        if hasattr(hf_config, name)
    ]
    keys = ", ".join(
        f"'{key}' = {value}"
        for key, value in (*sizes, _intermediate(hf_config), (_json_name(cls, "vocab_size"), hf_config.vocab_size))
    )
    raise TaperfoldError(
        f"{where}: keys {keys} describe a model of at least {implied:,} parameters, but {weights} "
        f"holds {present:,} values; config.json does not match the weights"
    )


# ---- the checkpoint -------------------------------------------------------------------------------------


def _hf_config(config: dict, where: Path, family: Family | None):
    """transformers' config object for config.json (`family`: the shipped one, None for a model_type traced)."""
    from transformers import CONFIG_MAPPING

    plain = {k: v for k, v in config.items() if k != BLOCK}
    try:
        config_class = CONFIG_MAPPING[plain["model_type"]]
    except (KeyError, TypeError):  # a model type this transformers does not know (a family may be registered for it)
        raise TaperfoldError(
            f"{where}: key 'model_type' is {_short(plain.get('model_type'))}, which this "
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


def _new_model(hf_config, device=None):
    from transformers import AutoModelForCausalLM

    with torch.device(device) if device else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def _taper(model, block: TaperBlock | None, family: Family, where: str):
    if block is None:
        return None
    aux = block.aux or {}
    tapering = taper_model(
        model,
        block.taper,
        family=family,
        aux=block.aux is not None,
        aux_weight=aux.get("weight", 0.1),
        momentum=block.calibration["momentum"],
        delta=block.calibration["delta"],
        where=where,
    )
    tapering.set_gate(block.gate)
    if tapering.scale_loss is not None and aux.get("target") is not None:
        tapering.scale_loss.target.fill_(aux["target"])
        tapering.scale_loss.frozen.fill_(True)
    return tapering


@dataclass
class HFCheckpoint(ModelSource):
    """A save_pretrained directory, validated: a model source (taperfold.sources) run by transformers' own code."""

    path: Path
    config: HFModelInfo
    hf_config_dict: dict
    family: Family
    block: TaperBlock | None
    state_dict: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)
    untapered: dict[str, str] = field(default_factory=dict)  # norm-like modules the tapering leaves alone, and why

    @property
    def gate(self) -> float:
        return self.block.gate if self.block else 1.0

    @property
    def step(self) -> int:
        return self.block.step if self.block else 0

    @property
    def arch(self) -> str:
        if self.family.traced:
            return (
                f"{self.config.arch} (transformers; no shipped family: its norms and their readers were found by "
                "tracing the model)"
            )
        return f"{self.config.arch} (transformers)"

    @property
    def how_to_taper(self) -> str:
        return f"`taperfold train --from {self.path} -o DIR` tapers it and fine-tunes it through the taper"

    def hf_model(self, tapered: bool = True, gate: float | None = None):
        """The transformers model with the directory's weights (its original norms when not `tapered`). It holds the
        tensors read from the directory themselves: its parameters are made on the meta device, then given those
        tensors (taperfold.models.assign_weights), so a model built adds no copy of the weights (nor a random
        initialisation) and the models built from one directory share them; none changes them in place, except a
        model trained from the directory (train_hf_directory, the one model it builds)."""
        with parameters_on_meta():
            model = _new_model(_hf_config(self.hf_config_dict, self.path / CONFIG, self.family))
        # outside: a norm without a weight (OLMo's) is tapered from ones made on the CPU
        tapering = _taper(model, self.block, self.family, str(self.path)) if tapered else None
        state = self.state_dict if tapered else {k: v for k, v in self.state_dict.items() if k in model.state_dict()}
        missing, _ = assign_weights(model, state)
        if missing:
            raise TaperfoldError(f"{self.path}: weights do not match the model (missing {sorted(missing)[:3]})")
        if tapering is not None and gate is not None:
            tapering.set_gate(gate)
        return model.eval()

    def build(self, gate: float | None = None) -> HFCausalLM:
        """The model as taperfold's tools use it (its plain forward is transformers' own), at `gate`."""
        return HFCausalLM(self.hf_model(gate=gate), self.config, self.family).eval()

    def build_baseline(self) -> HFCausalLM:
        """The same directory with its original norms (γ, β kept): the benchmark's baseline."""
        info = HFModelInfo(**{**self.config.to_dict(), "taper": "none", "aux": False})
        return HFCausalLM(self.hf_model(tapered=False), info, self.family).eval()

    def manifest_block(self) -> dict:
        return {
            "source": {
                "format": "huggingface",
                "family": self.family.name,
                "family_traced": self.family.traced,
                "model_type": self.config.arch,
                "taper": self.config.taper,
                "untapered": self.untapered,
            }
        }


def load_hf_directory(path: str | Path) -> HFCheckpoint:
    """Read and validate a save_pretrained directory (tapered or plain); `TaperfoldError` on any problem."""
    path = Path(path)
    config_file = path / CONFIG
    if not path.is_dir():
        raise TaperfoldError(f"{path}: not a directory")
    if not config_file.is_file():
        raise TaperfoldError(f"{config_file}: missing (a Hugging Face directory holds config.json and weights)")
    require_transformers(f"{path} (a Hugging Face directory)")
    config = _read_json(config_file)
    if "auto_map" in config:
        raise TaperfoldError(
            f"{config_file}: key 'auto_map' asks for the directory's own modeling code; "
            "taperfold never runs code from a checkpoint (only transformers' built-in models)"
        )
    model_type = config.get("model_type")
    shipped = family_for(model_type, str(config_file)) if is_registered(model_type) else None
    block = parse_block(config[BLOCK], config_file, model_type) if BLOCK in config else None
    hf_config = _hf_config(config, config_file, shipped)
    if shipped is not None:
        why_not = shipped.check(hf_config)
        if why_not:
            raise TaperfoldError(f"{config_file}: {why_not}")
    tensors, origin = read_weights(path)
    _check_size(
        hf_config,
        sum(t.numel() for t in tensors.values()),
        config_file,
        path / INDEX if (path / INDEX).is_file() else path / WEIGHTS,
    )
    with torch.device("meta"):  # shapes only: no memory, no init
        expected_model = _new_model(hf_config)
    if shipped is not None:
        family = shipped.for_config(hf_config)
    elif block is not None and block.family is not None:  # as the directory was tapered: read, not traced again
        family = block.family
        check_family_paths(
            expected_model, family, lambda key, why: TaperfoldError(f"{config_file}: key '{BLOCK}.{key}' {why}")
        )
    else:
        family = traced_family(hf_config, str(config_file))
    with torch.device("meta"):
        tapering = _taper(expected_model, block, family, str(config_file))
    tensors, origin, stored = _renamed(expected_model, tensors, origin)
    _check_state(path, tensors, origin, stored, expected_model, set(tapering.norms) if tapering else None)
    tokenizer = "hf" if any((path / f).is_file() for f in TOKENIZER_FILES) else "bytes"
    info = HFModelInfo.from_config(
        hf_config,
        family,
        block.taper if block else "none",
        bool(block and block.aux is not None),
        tokenizer,
        cached_heads(expected_model),
    )
    return HFCheckpoint(
        path,
        info,
        config,
        family,
        block,
        tensors,
        {"schedule": block.schedule if block else None},
        untapered=tapering.untapered if tapering else {},
    )


def _renamed(model, tensors: dict, origin: dict) -> tuple[dict, dict, dict]:
    """Checkpoint names -> the model's, with transformers' own conversion mapping for the model type: renamings
    (GPT-NeoX stores its `lm_head` as `embed_out`; save_pretrained writes that legacy name, from_pretrained maps it
    back) and weight conversions (MoE experts saved one by one, `experts.0.w1.weight`, stacked into the model's
    `experts.gate_up_proj`), applied to the tensors read, as from_pretrained applies them; nothing from the
    directory runs. Returns the tensors and their files under the model's names, and each model name's name in
    the file (for a stacked tensor: its first and last source key)."""
    same = {key: key for key in tensors}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # an older transformers: names are stored as the modules have them
        return tensors, origin, same
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return tensors, origin, same
    meta = model.state_dict()
    renamed, new_origin, stored = {}, {}, {}
    stacks: dict[str, tuple] = {}  # model name -> (its converter, {source pattern: [checkpoint keys]})
    for key in sorted(tensors, key=dot_natural_key):  # experts in index order, as from_pretrained stacks them
        new_key, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if pattern is None:
            renamed[new_key], new_origin[new_key], stored[new_key] = tensors[key], origin[key], key
            continue
        if new_key not in stacks:
            converter = next(c for c in converters if pattern in c.source_patterns)
            stacks[new_key] = (copy.deepcopy(converter), {})
        converter, sources = stacks[new_key]
        converter.add_tensor(new_key, key, pattern, tensors[key])
        sources.setdefault(pattern, []).append(key)
    for new_key, (converter, sources) in stacks.items():
        keys = [key for group in sources.values() for key in group]
        _check_expert_indices(sources, origin)
        try:
            converted = converter.convert(new_key, model=model, config=model.config)
        except Exception as e:  # noqa: BLE001 - transformers' ops raise what torch raises (mismatched shapes)
            raise TaperfoldError(
                f"{origin[keys[0]]}: keys '{_printable(keys[0])}' ... '{_printable(keys[-1])}' do "
                f"not stack into '{new_key}' ({first_line(e)})"
            ) from None
        for name, value in converted.items():
            renamed[name] = value[0] if isinstance(value, list) else value
            new_origin[name], stored[name] = origin[keys[0]], f"{keys[0]} ... {keys[-1]}"
    return renamed, new_origin, stored


def _check_expert_indices(sources: dict[str, list[str]], origin: dict) -> None:
    """Each pattern's keys number the experts 0, 1, ..., n - 1, the same n for every pattern: a gap would stack the
    next expert in its place, with the right shape."""
    count = None
    for pattern, keys in sources.items():
        found = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
        indices = [int(m.group(1)) if (m := found.search(key)) else -1 for key in keys]
        if indices != list(range(len(keys))) or (count is not None and len(keys) != count):
            wrong = next((key for i, key in zip(range(len(keys)), keys) if indices[i] != i), keys[-1])
            raise TaperfoldError(
                f"{origin[wrong]}: key '{_printable(wrong)}' does not continue experts 0 ... "
                f"{len(keys) - 1} of '{pattern}' (every expert, numbered from 0, once)"
            )
        count = len(keys)


def _check_state(path: Path, tensors: dict, origin: dict, stored: dict, model, norms: set[str] | None) -> None:
    """Names and shapes against the model config.json describes (`norms`: its tapered norms, None for a plain
    directory), then every floating-point tensor finite, then each tapered norm's c in C_RANGE."""
    tapered = norms is not None
    expected = model.state_dict()
    index = path / INDEX
    where = index if index.is_file() else path / WEIGHTS
    optional = set(model.all_tied_weights_keys)
    ignore = [re.compile(p) for p in (model._keys_to_ignore_on_load_unexpected or [])]
    for key in expected:
        if key not in tensors and key not in optional:
            raise TaperfoldError(f"{where}: missing key '{key}'")
    for key, value in tensors.items():
        file = origin.get(key, where)
        name = _printable(stored.get(key, key))  # as the file has it
        if key not in expected:
            if any(p.search(key) for p in ignore):
                continue
            if not tapered and key.rpartition(".")[2] in TAPER_KEYS:
                raise TaperfoldError(
                    f"{file}: holds tapered key '{name}' but {path / CONFIG} has no "
                    f"'{BLOCK}' block; restore the block or save the model again"
                )
            raise TaperfoldError(f"{file}: unexpected key '{name}' (not in the model config.json describes)")
        if tuple(value.shape) != tuple(expected[key].shape):
            raise TaperfoldError(
                f"{file}: key '{name}' has shape {list(value.shape)}, expected {list(expected[key].shape)}"
            )
    for key, value in tensors.items():  # values only once every name and shape is right
        if key not in expected:
            continue
        file, name = origin.get(key, where), _printable(stored.get(key, key))
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise TaperfoldError(f"{file}: key '{name}' contains NaN or Inf")
        if tapered and key.endswith(".c") and key[:-2] in norms and not C_RANGE[0] < float(value) <= C_RANGE[1]:
            raise TaperfoldError(
                f"{file}: key '{name}' is {float(value):g}; a tapered norm's scale c must lie in "
                f"({C_RANGE[0]:g}, {C_RANGE[1]:g}]"
            )


# ---- saving ---------------------------------------------------------------------------------------------


def save_hf_directory(
    model,
    out_dir: str | Path,
    *,
    step: int = 0,
    schedule=None,
    tokenizer_from: Path | None = None,
    max_shard_size: str | int | None = None,
) -> Path:
    """Write a tapered model as save_pretrained does, with the `taperfold` block; atomically per file.
    `tokenizer_from`: a directory whose tokenizer files are copied as they are.
    Refuses, writing nothing, what load_hf_directory would refuse to read back: NaN or Inf in a parameter or
    buffer, a block out of range."""
    tapering = tapering_of(model)
    loss = tapering.scale_loss
    out_dir = Path(out_dir)
    _check_finite(model, out_dir)
    first = next(iter(tapering.norms.values()))
    block = TaperBlock(
        gate=float(tapering.gate.value),
        taper=tapering.taper,
        step=int(step),
        schedule=None if schedule is None else {"taper_start": schedule.taper_start, "taper_end": schedule.taper_end},
        aux=None
        if loss is None
        else {"weight": loss.weight, "target": float(loss.target) if bool(loss.frozen) else None},
        calibration={"momentum": first.momentum, "delta": first.delta},
        family=tapering.family if tapering.family.traced else None,
    )
    parse_block(block.to_dict(), out_dir / CONFIG, model.config.model_type)  # as it will be read back (a NaN gate
    # or target included)
    model.config.taperfold = block.to_dict()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    with atomic_dir(out_dir) as tmp, _no_progress_bars():
        model.save_pretrained(tmp, **kwargs)
        for name in TOKENIZER_FILES if tokenizer_from is not None else ():
            if (Path(tokenizer_from) / name).is_file():
                shutil.copyfile(Path(tokenizer_from) / name, tmp / name)
    return out_dir


def _check_finite(model, out_dir: Path) -> None:
    """One line naming the first parameter or buffer holding NaN or Inf (a diverged run), before anything is
    written."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor.detach()).all()):
            kind = "parameter" if isinstance(tensor, torch.nn.Parameter) else "buffer"
            raise TaperfoldError(f"{out_dir}: not written: the model's {kind} '{name}' contains NaN or Inf")


@contextlib.contextmanager
def _no_progress_bars():
    """transformers draws a progress bar per save; taperfold's own output stays one line per stage."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
