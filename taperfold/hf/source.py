"""The Hugging Face directory as a model source: what `save_pretrained` writes, plus a `taperfold` block in
config.json when the model is tapered.

    DIR/config.json                      transformers' config + "taperfold": {format_version, gate, taper,
                                         step, schedule, aux, calibration}
    DIR/model.safetensors                or model-0000i-of-0000n.safetensors + model.safetensors.index.json
    DIR/tokenizer.json ...               optional: the tokenizer, as save_pretrained writes it

Loading never runs code from the directory: the model class comes from transformers' own registry for
`model_type` (AutoModelForCausalLM.from_config; a config asking for its own code through `auto_map` is
refused), the weights are read with safetensors only. A directory without the block is a plain
(untapered) model. See docs/checkpoint-format.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from taperfold.errors import TaperfoldError
from taperfold.families import Family, family_for
from taperfold.fsutil import atomic_dir, read_json_object
from taperfold.hf.model import HFCausalLM, HFModelInfo
from taperfold.hf.taper import taper_model, tapering_of
from taperfold.sources.base import ModelSource, read_safetensors
from taperfold.taper import TAPERS

BLOCK = "taperfold"
BLOCK_VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")
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
    except (OSError, ValueError):
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
    format_version: int = BLOCK_VERSION

    def to_dict(self) -> dict:
        return {"format_version": self.format_version, "gate": self.gate, "taper": self.taper, "step": self.step,
                "schedule": self.schedule, "aux": self.aux, "calibration": self.calibration}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_block(raw, where: Path) -> TaperBlock:
    """Validate config.json's `taperfold` block; one error naming the file and the key otherwise."""

    def bad(key: str, why: str):
        return TaperfoldError(f"{where}: key '{BLOCK}.{key}' {why}")

    if not isinstance(raw, dict):
        raise TaperfoldError(f"{where}: key '{BLOCK}' must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"format_version", "gate", "taper", "step", "schedule", "aux", "calibration"})
    if unknown:
        raise bad(unknown[0], "is not a known key (format_version, gate, taper, step, schedule, aux, calibration)")
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
            raise bad(f"calibration.{key}", f"must be a number in {'(0, 1)' if key == 'momentum' else '[0, ∞)'}, "
                                            f"got {value!r}")
    return TaperBlock(float(gate), raw["taper"], step, schedule, aux, dict(calibration))


# ---- weights --------------------------------------------------------------------------------------------


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a directory, single file or sharded, and the file each came from."""
    single, index = folder / WEIGHTS, folder / INDEX
    if index.is_file():
        return _read_sharded(folder, index)
    if single.is_file():
        tensors = read_safetensors(single)
        return tensors, {key: single for key in tensors}
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise TaperfoldError(f"{folder}: holds PyTorch pickle weights only; taperfold reads safetensors "
                             "(save with save_pretrained(..., safe_serialization=True))")
    raise TaperfoldError(f"{folder}: no weights ({WEIGHTS} or {INDEX}); save the model with save_pretrained")


def _read_sharded(folder: Path, index: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise TaperfoldError(f"{index}: key 'weight_map' missing or empty")
    tensors, origin = {}, {}
    for shard_name in sorted(set(weight_map.values()), key=str):
        key = next(k for k, v in weight_map.items() if v == shard_name)
        if not isinstance(shard_name, str) or Path(shard_name).name != shard_name:
            raise TaperfoldError(f"{index}: key 'weight_map.{key}' names {shard_name!r}, not a file in {folder}")
        shard = folder / shard_name
        if not shard.is_file():
            raise TaperfoldError(f"{index}: key 'weight_map.{key}': shard {shard_name} is missing")
        for name, tensor in read_safetensors(shard).items():
            tensors[name], origin[name] = tensor, shard
    for key, shard_name in weight_map.items():
        if key not in tensors:
            raise TaperfoldError(f"{index}: key 'weight_map.{key}': tensor not found in {shard_name}")
    return tensors, origin


# ---- the checkpoint -------------------------------------------------------------------------------------


def _hf_config(config: dict, where: Path):
    from transformers import CONFIG_MAPPING

    plain = {k: v for k, v in config.items() if k != BLOCK}
    try:
        return CONFIG_MAPPING[plain["model_type"]].from_dict(plain)
    except (TypeError, ValueError, KeyError) as e:
        raise TaperfoldError(f"{where}: not a valid {plain['model_type']} config ({e})") from None


def _new_model(hf_config, device=None):
    from transformers import AutoModelForCausalLM

    with torch.device(device) if device else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def _taper(model, block: "TaperBlock | None", where: str):
    if block is None:
        return None
    aux = block.aux or {}
    tapering = taper_model(model, block.taper, aux=block.aux is not None, aux_weight=aux.get("weight", 0.1),
                           momentum=block.calibration["momentum"], delta=block.calibration["delta"], where=where)
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
        return f"{self.config.arch} (transformers)"

    @property
    def plain_norm_reason(self) -> str:
        return f"plain model: no '{BLOCK}' block in config.json"

    def hf_model(self, tapered: bool = True, gate: float | None = None):
        """The transformers model with the directory's weights (its original norms when not `tapered`)."""
        model = _new_model(_hf_config(self.hf_config_dict, self.path / CONFIG))
        tapering = _taper(model, self.block, str(self.path)) if tapered else None
        state = self.state_dict if tapered else {k: v for k, v in self.state_dict.items()
                                                 if k in model.state_dict()}
        missing, _ = model.load_state_dict(state, strict=False)
        if set(missing) - set(model.all_tied_weights_keys):
            raise TaperfoldError(f"{self.path}: weights do not match the model (missing {sorted(missing)[:3]})")
        if tapering is not None and gate is not None:
            tapering.set_gate(gate)
        return model.eval()

    def build(self, gate: float | None = None, reference: bool = True) -> HFCausalLM:
        """The model as taperfold's tools use it (its plain forward is transformers' own), at `gate`."""
        return HFCausalLM(self.hf_model(gate=gate), self.config, self.family, reference).eval()

    def build_baseline(self, reference: bool = True) -> HFCausalLM:
        """The same directory with its original norms (γ, β kept): the benchmark's baseline."""
        info = HFModelInfo(**{**self.config.to_dict(), "taper": "none", "aux": False})
        return HFCausalLM(self.hf_model(tapered=False), info, self.family, reference).eval()

    def manifest_block(self) -> dict:
        return {"source": {"format": "huggingface", "family": self.family.name, "model_type": self.config.arch,
                           "taper": self.config.taper, "untapered": self.untapered}}


def load_hf_directory(path: str | Path) -> HFCheckpoint:
    """Read and validate a save_pretrained directory (tapered or plain); `TaperfoldError` on any problem."""
    path = Path(path)
    config_file = path / CONFIG
    if not path.is_dir():
        raise TaperfoldError(f"{path}: not a directory")
    if not config_file.is_file():
        raise TaperfoldError(f"{config_file}: missing (a Hugging Face directory holds config.json and weights)")
    require_transformers(f"{path} (a Hugging Face directory)")
    config = read_json_object(config_file)
    if "auto_map" in config:
        raise TaperfoldError(f"{config_file}: key 'auto_map' asks for the directory's own modeling code; "
                             "taperfold never runs code from a checkpoint (only transformers' built-in models)")
    family = family_for(config.get("model_type"), str(config_file))
    block = parse_block(config[BLOCK], config_file) if BLOCK in config else None
    hf_config = _hf_config(config, config_file)
    why_not = family.check(hf_config)
    if why_not:
        raise TaperfoldError(f"{config_file}: {why_not}")
    tensors, origin = read_weights(path)
    with torch.device("meta"):  # shapes only: no memory, no init
        expected_model = _new_model(hf_config)
        tapering = _taper(expected_model, block, str(config_file))
    tensors, origin = _renamed(expected_model, tensors, origin)
    _check_state(path, tensors, origin, expected_model, block is not None)
    tokenizer = "hf" if any((path / f).is_file() for f in TOKENIZER_FILES) else "bytes"
    info = HFModelInfo.from_config(hf_config, family, block.taper if block else "none",
                                   bool(block and block.aux is not None), tokenizer)
    return HFCheckpoint(path, info, config, family, block, tensors, {"schedule": block.schedule if block else None},
                        untapered=tapering.untapered if tapering else {})


def _renamed(model, tensors: dict, origin: dict) -> tuple[dict, dict]:
    """Checkpoint names -> the model's, with transformers' own renamings (e.g. GPT-NeoX stores its
    `lm_head` as `embed_out`; save_pretrained writes that legacy name, from_pretrained maps it back)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # an older transformers: names are stored as the modules have them
        return tensors, origin
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return tensors, origin
    meta = model.state_dict()
    renamed, new_origin = {}, {}
    for key, value in tensors.items():
        new_key, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if converter is not None:
            raise TaperfoldError(f"{origin[key]}: key '{key}' needs transformers' weight conversion "
                                 f"({converter}), which taperfold does not apply; save the model again")
        renamed[new_key], new_origin[new_key] = value, origin[key]
    return renamed, new_origin


def _check_state(path: Path, tensors: dict, origin: dict, model, tapered: bool) -> None:
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
        if key not in expected:
            if any(p.search(key) for p in ignore):
                continue
            if not tapered and key.rpartition(".")[2] in TAPER_KEYS:
                raise TaperfoldError(f"{file}: holds tapered key '{key}' but {path / CONFIG} has no "
                                     f"'{BLOCK}' block; restore the block or save the model again")
            raise TaperfoldError(f"{file}: unexpected key '{key}' (not in the model config.json describes)")
        if tuple(value.shape) != tuple(expected[key].shape):
            raise TaperfoldError(f"{file}: key '{key}' has shape {list(value.shape)}, "
                                 f"expected {list(expected[key].shape)}")
        if tapered and key.rpartition(".")[2] in ("weight_tilde", "c") and not torch.isfinite(value).all():
            raise TaperfoldError(f"{file}: key '{key}' contains NaN or Inf")


# ---- saving ---------------------------------------------------------------------------------------------


def save_hf_directory(model, out_dir: str | Path, *, step: int = 0, schedule=None, tokenizer_from: Path | None = None,
                      max_shard_size: str | int | None = None) -> Path:
    """Write a tapered model as save_pretrained does, with the `taperfold` block; atomically per file.
    `tokenizer_from`: a directory whose tokenizer files are copied as they are."""
    tapering = tapering_of(model)
    loss = tapering.scale_loss
    first = next(iter(tapering.norms.values()))
    block = TaperBlock(
        gate=float(tapering.gate.value), taper=tapering.taper, step=int(step),
        schedule=None if schedule is None else {"taper_start": schedule.taper_start, "taper_end": schedule.taper_end},
        aux=None if loss is None else {"weight": loss.weight,
                                       "target": float(loss.target) if bool(loss.frozen) else None},
        calibration={"momentum": first.momentum, "delta": first.delta})
    model.config.taperfold = block.to_dict()
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    with atomic_dir(out_dir) as tmp, _no_progress_bars():
        model.save_pretrained(tmp, **kwargs)
        for name in TOKENIZER_FILES if tokenizer_from is not None else ():
            if (Path(tokenizer_from) / name).is_file():
                shutil.copyfile(Path(tokenizer_from) / name, tmp / name)
    return out_dir


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
