"""The Hugging Face directory as a model source: what `save_pretrained` writes, plus a `taperfold` block in
config.json when the model is tapered.

    DIR/config.json                      transformers' config + "taperfold": {format_version, gate, taper,
                                         step, schedule, aux[, calibration][, norm][, family]}
                                         (taperfold.hf.taper_block)
    DIR/model.safetensors                or model-0000i-of-0000n.safetensors + model.safetensors.index.json
                                         (taperfold.hf.weights)
    DIR/tokenizer.json ...               optional: the tokenizer, as save_pretrained writes it

Loading never runs code from the directory: the model class comes from transformers' own registry for
`model_type` (AutoModelForCausalLM.from_config; a config asking for its own code through `auto_map` is
refused), the weights are read with safetensors only. A directory without the block is a plain
(untapered) model. See docs/checkpoint-format.md. A model_type no family is shipped for gets one by tracing
transformers' model (taperfold.hf.trace); a tapered directory records it as data (`taperfold.family`), so it
is read back, not traced again. Experts that save_pretrained writes one by one (MoE: `experts.0.w1.weight`) are
stacked by transformers' own conversion mapping for the model type, applied to the tensors read.

A directory is input and is checked as taperfold's own checkpoints are, each problem one `TaperfoldError` naming
the file and the key: config.json's numeric keys (types and ranges) before transformers reads them, the parameter
count the config implies against the values the weights hold before a model is built (even on the meta device)
(taperfold.hf.config_check), the names and shapes of the tensors, then NaN and Inf in any floating-point tensor and
each tapered norm's c in (0, 1e6] (taperfold.sources.checks, shared with taperfold's own checkpoints).
`save_hf_directory` (taperfold.hf.save) writes nothing that loading would refuse.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from taperfold.errors import TaperfoldError, first_line
from taperfold.families import Family, family_for, is_registered
from taperfold.fsutil import read_json_object
from taperfold.hf.config_check import check_size, transformers_config
from taperfold.hf.config_values import decoded_floats
from taperfold.hf.export_patches import export_patches
from taperfold.hf.hub import TOKENIZER_FILES
from taperfold.hf.model import HFCausalLM, HFModelInfo, cached_heads, position_table_context
from taperfold.hf.progress import no_progress_bars
from taperfold.hf.taper_block import BLOCK, TaperBlock, parse_block, taper_as_recorded
from taperfold.hf.tokenizer import has_tokenizer, load_tokenizer, save_byte_tokenizer
from taperfold.hf.trace import check_family_paths, traced_family
from taperfold.hf.weights import read_weights, to_model_names, weights_file
from taperfold.manifest_source import HUGGINGFACE, ManifestSource
from taperfold.models import assign_weights, parameters_on_meta
from taperfold.sources.base import ModelSource
from taperfold.sources.checks import check_state

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
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


def _new_model(hf_config, where: Path, device=None):
    """transformers' causal LM for `hf_config` (on `device`); a model type with no causal-LM class, or a config its
    constructor refuses, is one line naming config.json (`where`)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = hf_config.model_type
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TaperfoldError(
            f"{where}: key 'model_type' is {model_type!r}, for which transformers has no causal language model "
            "(AutoModelForCausalLM); taperfold exports causal LMs"
        )
    try:
        with torch.device(device) if device else contextlib.nullcontext():
            return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers' constructors raise many types for a config they refuse
        raise TaperfoldError(
            f"{where}: transformers cannot build a {model_type} model from this config alone ({first_line(e)})"
        ) from None


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

    def export_context(self) -> contextlib.AbstractContextManager:
        return export_patches(str(self.hf_config_dict.get("model_type")))

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

    def encode_text(self, text: bytes) -> np.ndarray:
        if self.config.tokenizer != "hf":
            return super().encode_text(text)
        return np.array(load_tokenizer(self.path)(text.decode("utf-8"))["input_ids"], dtype=np.int64)

    def hf_model(self, tapered: bool = True, gate: float | None = None):
        """The transformers model with the directory's weights (its original norms when not `tapered`). It holds the
        tensors read from the directory themselves: its parameters are made on the meta device, then given those
        tensors (taperfold.models.assign_weights), so a model built adds no copy of the weights (nor a random
        initialisation) and the models built from one directory share them; none changes them in place, except a
        model trained from the directory (train_hf_directory, the one model it builds)."""
        with parameters_on_meta():
            model = _new_model(
                transformers_config(self.hf_config_dict, self.path / CONFIG, self.family), self.path / CONFIG
            )
        # outside: a norm without a weight (OLMo's) is tapered from ones made on the CPU
        tapering = taper_as_recorded(model, self.block, self.family, str(self.path)) if tapered else None
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

    def write_plain_directory(self, out: Path, replace: dict[str, torch.Tensor] | None = None) -> None:
        """save_pretrained of the directory's plain model (its own norms, no taperfold block), with `replace`'s
        tensors in place of the parameters they name, and the directory's generation config and tokenizer files (a
        byte-level model without any: its byte tokenizer, which onnxruntime-genai's builder needs)."""
        model = self.hf_model(tapered=False)
        state = model.state_dict()
        for name, tensor in (replace or {}).items():
            if name not in state or state[name].shape != tensor.shape:
                raise TaperfoldError(f"{self.path}: the model has no parameter {name} of shape {list(tensor.shape)}")
            tied = [k for k, v in state.items() if k != name and v.data_ptr() == state[name].data_ptr()]
            if tied:
                raise TaperfoldError(f"{self.path}: {name} is tied to {tied[0]}: a changed copy cannot be saved tied")
            state[name] = tensor.to(state[name].dtype)  # the model's own tensors stay as they are
        model.config.__dict__.pop(BLOCK, None)
        with no_progress_bars():
            model.save_pretrained(out, state_dict=state)
        for name in (GENERATION_CONFIG, *TOKENIZER_FILES):
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, out / name)
        if self.config.tokenizer == "bytes":
            save_byte_tokenizer(out)

    def manifest_source(self) -> ManifestSource:
        return ManifestSource(
            format=HUGGINGFACE,
            family=self.family.name,
            family_traced=self.family.traced,
            model_type=self.config.arch,
            taper=self.config.taper,
            untapered=self.untapered,
            # what a runtime folder written from the export carries (onnxruntime-genai's config, tokenizer)
            special_tokens=special_tokens(self.path, self.hf_config_dict, self.config.vocab_size),
            tokenizer_files=tuple(name for name in TOKENIZER_FILES if (self.path / name).is_file()),
        )


def special_tokens(path: Path, config: dict, vocab_size: int) -> dict:
    """bos_token_id, eos_token_id (one id or several) and pad_token_id as generation_config.json, else config.json,
    gives them; ids that are no token of the vocabulary are left out."""
    generation = path / GENERATION_CONFIG
    sources = [read_json_object(generation)] if generation.is_file() else []
    tokens = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = next((s[key] for s in [*sources, config] if s.get(key) is not None), None)
        ids = value if isinstance(value, list) else [value]
        if ids and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
            tokens[key] = value
    return tokens


def load_hf_directory(path: str | Path) -> HFCheckpoint:
    """Read and validate a save_pretrained directory (tapered or plain); `TaperfoldError` on any problem."""
    path = Path(path)
    config_file = path / CONFIG
    if not path.is_dir():
        raise TaperfoldError(f"{path}: not a directory")
    if not config_file.is_file():
        raise TaperfoldError(f"{config_file}: missing (a Hugging Face directory holds config.json and weights)")
    require_transformers(f"{path} (a Hugging Face directory)")
    config = decoded_floats(read_json_object(config_file))
    if "auto_map" in config:
        raise TaperfoldError(
            f"{config_file}: key 'auto_map' asks for the directory's own modeling code; "
            "taperfold never runs code from a checkpoint (only transformers' built-in models)"
        )
    model_type = config.get("model_type")
    shipped = family_for(model_type, str(config_file)) if is_registered(model_type) else None
    # a model_type other than a string: transformers_config refuses it next, whatever a traced family is named
    named = model_type if isinstance(model_type, str) else ""
    block = parse_block(config[BLOCK], config_file, named) if BLOCK in config else None
    hf_config = transformers_config(config, config_file, shipped)
    if shipped is not None:
        why_not = shipped.check(hf_config)
        if why_not:
            raise TaperfoldError(f"{config_file}: {why_not}")
    tensors, origin = read_weights(path)
    check_size(
        hf_config,
        sum(t.numel() for t in tensors.values()),
        config_file,
        weights_file(path),
    )
    with torch.device("meta"):  # shapes only: no memory, no init
        expected_model = _new_model(hf_config, config_file)
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
        tapering = taper_as_recorded(expected_model, block, family, str(config_file))
    tensors, origin, stored = to_model_names(expected_model, tensors, origin)
    _check_state(path, tensors, origin, stored, expected_model, set(tapering.norms) if tapering else None)
    tokenizer = "hf" if has_tokenizer(path) else "bytes"
    info = HFModelInfo.from_config(
        hf_config,
        family,
        block.taper if block else "none",
        bool(block and block.aux is not None),
        tokenizer,
        cached_heads(expected_model),
        position_table_context(expected_model),
        block.norm if block else None,
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


def _check_state(path: Path, tensors: dict, origin: dict, stored: dict, model, norms: set[str] | None) -> None:
    """The tensors against the model config.json describes (`norms`: its tapered norms, None for a plain directory),
    as taperfold.sources.checks checks every source's; unknown keys the model ignores on load are left out."""
    expected = model.state_dict()
    ignore = [re.compile(p) for p in (model._keys_to_ignore_on_load_unexpected or [])]
    known = {key: value for key, value in tensors.items() if key in expected or not any(p.search(key) for p in ignore)}

    def unexpected(key: str, name: str) -> str:
        if norms is None and key.rpartition(".")[2] in TAPER_KEYS:
            return (
                f"holds tapered key '{name}' but {path / CONFIG} has no '{BLOCK}' block; restore the block or save "
                "the model again"
            )
        return f"unexpected key '{name}' (not in the model config.json describes)"

    check_state(
        known,
        expected,
        weights_file(path),
        unexpected=unexpected,
        optional=set(model.all_tied_weights_keys),
        norms=norms,
        origin=origin,
        stored=stored,
    )
