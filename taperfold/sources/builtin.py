"""taperfold's own checkpoints, a model source: save and load safely, in three layouts (docs/checkpoint-format.md).

- `NAME.pt`: a plain dict read only with `torch.load(weights_only=True)`, which refuses any pickle
  that would construct objects or run code.
- `NAME.safetensors`: the tensors, with config, gate and step as JSON strings in the metadata.
- a directory holding `config.json` and `model.safetensors` (Hugging Face's layout).

Every problem with a file is a `TaperfoldError` naming the file and the key; nothing in a file runs.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch

from taperfold.errors import TaperfoldError, first_line
from taperfold.families import Family, family_for
from taperfold.fsutil import Output, atomic_dir, atomic_path, read_json_object, refuse_hub_cache
from taperfold.models import CausalLM, ModelConfig, baseline_of, build_model, build_with_weights
from taperfold.numeric import is_finite_number
from taperfold.sources.base import ModelSource, SourceKind, read_safetensors
from taperfold.sources.checks import MAX_PARAMETERS_RATIO, check_state, implied_parameters

FORMAT = "taperfold-checkpoint"
FORMAT_VERSION = 1


@dataclass
class Checkpoint(ModelSource):
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    gate: float
    step: int
    meta: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def family(self) -> Family:
        return family_for(self.config.arch, "config")

    @property
    def arch(self) -> str:
        return self.config.arch

    @property
    def how_to_taper(self) -> str:
        return "trained with --taper none; `taperfold train --taper internal` trains a tapered one"

    def build(self, gate: float | None = None) -> CausalLM:
        """The model in eval mode at the stored gate (or `gate`), weights checked. It holds the checkpoint's
        tensors themselves (no copy: models built from one checkpoint share them, and none is changed in place)."""
        model = _load_into(self.config, self.state_dict, self.path)
        model.set_gate(self.gate if gate is None else gate)
        return model.eval()

    def build_baseline(self) -> CausalLM:
        """The same weights with plain norms (nn.RMSNorm / nn.LayerNorm, γ and β kept)."""
        return baseline_of(self.build(gate=0.0))


def checkpoint_from_model(model: CausalLM, step: int, meta: dict | None = None) -> Checkpoint:
    return Checkpoint(model.cfg, model.state_dict(), model.gate.value, step, dict(meta or {}))


# ---- saving ----------------------------------------------------------------------------------------


def _tensors_for_saving(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    # A tied lm_head is the embedding itself: store it once, as Hugging Face does.
    sd = {k: v.detach().cpu().contiguous() for k, v in ckpt.state_dict.items()}
    if ckpt.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _header(ckpt: Checkpoint) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": ckpt.config.to_dict(),
        "gate": float(ckpt.gate),
        "step": int(ckpt.step),
        "meta": ckpt.meta,
    }


def save_checkpoint(ckpt: Checkpoint, path: str | Path) -> Path:
    """Write `ckpt` atomically; the layout follows the name: .pt, .safetensors, or else a directory."""
    from safetensors.torch import save_file

    path = Path(path)
    refuse_hub_cache(path, str(path), whole=path.suffix not in (".pt", ".safetensors"))
    tensors, header = _tensors_for_saving(ckpt), _header(ckpt)
    if path.suffix == ".pt":
        with atomic_path(path) as tmp:
            torch.save({**header, "state_dict": tensors}, tmp)
    elif path.suffix == ".safetensors":
        meta = {k: json.dumps(v) for k, v in header.items()}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
    else:
        with atomic_dir(path) as tmp:  # both files or neither; an earlier checkpoint there is replaced whole
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(header, indent=2) + "\n")
    return path


def is_checkpoint_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def checkpoint_output(path: str | Path, option: str) -> Output:
    """What `save_checkpoint(ckpt, path)` will write, for checking before a long training run."""
    if Path(path).suffix in (".pt", ".safetensors"):
        return Output(path, option)
    return Output(path, option, directory="taperfold checkpoint", owned=is_checkpoint_dir)


# ---- loading ---------------------------------------------------------------------------------------


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and validate a taperfold checkpoint; raise `TaperfoldError` naming the file and key on any problem.
    (taperfold.sources.open_source opens any model source: this, or a Hugging Face directory.)"""
    path = Path(path)
    if not path.exists():
        raise TaperfoldError(f"{path}: no such file or directory")
    if path.is_dir():
        header, tensors = _read_directory(path)
    elif path.suffix == ".safetensors":
        header, tensors = _read_safetensors(path)
    else:
        header, tensors = _read_pt(path)
    ckpt = _from_parts(path, header, tensors)
    _check_tensors(path, ckpt)
    return ckpt


def _read_pt(path: Path) -> tuple[dict, dict]:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TaperfoldError(f"{path}: cannot read ({e.strerror})") from None
    if not magic.startswith((b"PK", b"\x80")):  # a zip archive (torch.save) or a pickle (the legacy format)
        raise TaperfoldError(
            f"{path}: not a readable checkpoint: not a PyTorch file (neither a zip archive nor a "
            "pickle); taperfold reads .pt, .safetensors and checkpoint directories"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e) or "GLOBAL" in str(e):
            raise TaperfoldError(
                f"{path}: refused: the file holds a pickle that would construct objects or "
                "run code; taperfold only loads tensors and plain data"
            ) from None
        detail = next((ln.split("error:", 1)[-1].strip() for ln in str(e).splitlines() if "Unpickler error" in ln), "")
        raise TaperfoldError(f"{path}: not a readable checkpoint ({detail or 'not a PyTorch file'})") from None
    except Exception as e:  # noqa: BLE001 - weights_only=True ran nothing; whatever torch's parser raised: corrupt
        raise TaperfoldError(f"{path}: not a readable checkpoint: truncated or corrupt ({first_line(e)})") from None
    if not isinstance(obj, dict):
        raise TaperfoldError(f"{path}: not a taperfold checkpoint (top level is {type(obj).__name__}, not a dict)")
    tensors = obj.get("state_dict")
    if not isinstance(tensors, dict):
        raise TaperfoldError(f"{path}: not a taperfold checkpoint (key 'state_dict' missing or not a dict)")
    return {k: v for k, v in obj.items() if k != "state_dict"}, tensors


def _read_safetensors_file(path: Path) -> tuple[dict, dict]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise TaperfoldError(f"{path}: not a readable safetensors file: truncated or corrupt ({e})") from None
    tensors = read_safetensors(path)
    return meta, tensors


def _read_safetensors(path: Path) -> tuple[dict, dict]:
    meta, tensors = _read_safetensors_file(path)
    header = {}
    for key, text in meta.items():
        try:
            header[key] = json.loads(text)
        except json.JSONDecodeError:
            raise TaperfoldError(f"{path}: metadata key '{key}' is not valid JSON") from None
    return header, tensors


def _read_directory(path: Path) -> tuple[dict, dict]:
    config_file, weights = path / "config.json", path / "model.safetensors"
    for f in (config_file, weights):
        if not f.exists():
            raise TaperfoldError(f"{f}: missing (a checkpoint directory holds config.json and model.safetensors)")
    return read_json_object(config_file), _read_safetensors_file(weights)[1]


def _from_parts(path: Path, header: dict, tensors: dict) -> Checkpoint:
    if header.get("format") != FORMAT:
        raise TaperfoldError(
            f"{path}: not a taperfold checkpoint (key 'format' is {header.get('format')!r}, expected {FORMAT!r})"
        )
    if header.get("format_version") != FORMAT_VERSION:
        raise TaperfoldError(
            f"{path}: key 'format_version' is {header.get('format_version')!r}; "
            f"this taperfold reads version {FORMAT_VERSION}"
        )
    for key in ("config", "gate", "step"):
        if key not in header:
            raise TaperfoldError(f"{path}: missing key '{key}'")
    if not isinstance(header["config"], dict):
        raise TaperfoldError(f"{path}: key 'config' is not a mapping")
    try:
        config = ModelConfig.from_dict(header["config"])
    except (TypeError, ValueError) as e:
        raise TaperfoldError(f"{path}: key 'config': {e}") from None
    gate = header["gate"]
    if not is_finite_number(gate) or not 0 <= gate <= 1:
        raise TaperfoldError(f"{path}: key 'gate' must be a number in [0, 1], got {gate!r}")
    if isinstance(header["step"], bool) or not isinstance(header["step"], int) or header["step"] < 0:
        raise TaperfoldError(f"{path}: key 'step' must be a non-negative integer, got {header['step']!r}")
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TaperfoldError(f"{path}: key 'state_dict.{key}' is a {type(value).__name__}, not a tensor")
    return Checkpoint(config, tensors, float(gate), header["step"], header.get("meta") or {}, path)


def _check_tensors(path: Path, ckpt: Checkpoint) -> None:
    """The tensors against the model the config describes (taperfold.sources.checks)."""
    config = ckpt.config
    present = sum(t.numel() for t in ckpt.state_dict.values())
    implied = implied_parameters(
        vocab_size=config.vocab_size,
        hidden=config.d_model,
        layers=config.n_layers,
        attention=config.n_heads * config.head_dim,
        intermediate=config.d_ff,
    )
    # Before building anything, even on the meta device (a config of 10^9 layers would hang there): a config
    # far larger than the tensors is refused here; smaller mismatches get the exact key below.
    if implied > MAX_PARAMETERS_RATIO * present:
        raise TaperfoldError(
            f"{path}: key 'config' describes a model of at least {implied:,} parameters, but the "
            f"file holds {present:,} values; the config does not match the tensors"
        )
    with torch.device("meta"):  # shapes only: no memory, no init
        expected = build_model(config).state_dict()
    described = f"a {config.arch} model with taper={config.taper}"
    check_state(
        ckpt.state_dict,
        expected,
        path,
        unexpected=lambda key, name: f"unexpected key '{name}' (not in {described})",
        optional={"lm_head.weight"} if config.tie_embeddings else set(),
        norms=set(ckpt.family.norm_paths(config.n_layers, "all")),
    )


def _load_into(config: ModelConfig, state: dict, path) -> CausalLM:
    model, missing, unexpected = build_with_weights(config, state)
    if missing or unexpected:
        raise TaperfoldError(
            f"{path}: state dict does not match the model (missing {sorted(missing)}, unexpected {sorted(unexpected)})"
        )
    return model


# Claims every path no other kind claims; its manifest configs are ModelConfigs (a transformers model's names
# its source).
KIND = SourceKind(
    "taperfold",
    claims=lambda path: True,
    open=read_checkpoint,
    wrote_config=lambda config: "source" not in config,
    config_from_dict=ModelConfig.from_dict,
)
