"""What every model source is (`ModelSource`) and how a kind of source registers (`SourceKind`)."""

from __future__ import annotations

import abc
import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from taperfold.errors import TaperfoldError
from taperfold.families import Family
from taperfold.fsutil import sha256_file
from taperfold.taper import ModelShape, TaperedLM

if TYPE_CHECKING:
    from taperfold.manifest_source import ManifestSource


class ModelSource(abc.ABC):
    """One model, validated, its weights in memory. `config` gives its shape as every tool reads it
    (arch, vocab_size, d_model, n_layers, n_heads, kv_heads, head_dim, max_seq_len, taper, norm_kind,
    tie_embeddings, aux, tokenizer; `to_dict()` for manifests and reports)."""

    path: Path | None
    config: ModelShape
    meta: dict  # what training recorded: val_loss, schedule, ...

    # Read-only to a source's readers: a kind keeps each as a dataclass field or computes it. Properties to the type
    # checker only: at run time a dataclass field would take an inherited property for its default.
    if TYPE_CHECKING:

        @property
        def family(self) -> Family: ...
        @property
        def gate(self) -> float: ...  # the gate the weights were saved at (1 for a plain model)
        @property
        def step(self) -> int: ...

    @property
    def tapered(self) -> bool:
        return self.config.taper != "none"

    @property
    @abc.abstractmethod
    def arch(self) -> str:
        """The architecture as `taperfold inspect` names it."""

    @property
    @abc.abstractmethod
    def how_to_taper(self) -> str:
        """For a plain (untapered) model: how a user gets a tapered one."""

    @abc.abstractmethod
    def build(self, gate: float | None = None) -> TaperedLM:
        """The model in eval mode at the stored gate (or `gate`): what verify holds the exports to, and what they
        are exported from."""

    @abc.abstractmethod
    def build_baseline(self) -> TaperedLM:
        """The same weights with the model's own untapered norms (γ, β kept): what the paper compares with."""

    def encode_text(self, text: bytes) -> np.ndarray:
        """`text` as the model's token ids (verify --text): its bytes for a byte-level model (config.tokenizer
        "bytes"); a kind with a tokenizer of its own encodes with it. UnicodeDecodeError where that needs UTF-8."""
        if self.config.tokenizer != "bytes":
            raise TaperfoldError(f"{self.path}: its {self.config.tokenizer!r} tokenizer is not one taperfold reads")
        return np.frombuffer(text, dtype=np.uint8).astype(np.int64)

    def export_context(self) -> contextlib.AbstractContextManager:
        """What to hold while the model is traced for ONNX: a kind whose modeling code torch.onnx cannot translate
        gives an equal form to trace (taperfold.hf.export_patches); nothing by default."""
        return contextlib.nullcontext()

    def manifest_source(self) -> ManifestSource | None:
        """What an export's manifest records of this source beyond its checkpoint block (manifest `source`, which the
        folders and builds made later from the export read); None: nothing."""
        return None

    def write_plain_directory(self, out: Path, replace: dict[str, torch.Tensor] | None = None) -> None:
        """Write the model untapered, in its own format's layout for other tools (onnxruntime-genai's builder reads a
        Hugging Face directory), with the tensors named in `replace` (by the model's own parameter names) swapped
        in. Only a kind whose format another tool reads implements it."""
        raise TaperfoldError(
            f"{self.path}: {self.arch} is no format another tool builds from (a Hugging Face directory)"
        )


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or one line naming the file."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise TaperfoldError(f"{path}: not a readable safetensors file: truncated or corrupt ({e})") from None


def checkpoint_digest(path: Path) -> str:
    """sha256 of a checkpoint file; for a directory, of its files in name order."""
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode())
    return h.hexdigest()


class FineTuned(Protocol):
    """What a kind's `fine_tune` returns (`taperfold train --from`), and `taperfold.train.train` too."""

    @property
    def gate(self) -> float: ...
    @property
    def val_loss(self) -> float: ...
    @property
    def seconds(self) -> float: ...
    @property
    def tokenizer_name(self) -> str:  # "bytes", or "hf" for a transformers directory's own tokenizer
        ...

    def save(self, out: str | Path) -> Path:
        """Write the trained model in its source's format."""


@dataclass(frozen=True)
class SourceKind:
    name: str
    claims: Callable[[Path], bool]  # is this path one of mine (reads a header at most)
    open: Callable[[Path], ModelSource]
    wrote_config: Callable[[dict], bool]  # is this manifest `config` one a source of mine wrote
    config_from_dict: Callable[[dict], ModelShape]
    # (path, TrainOptions, data files, taper=, aux=, on_step=) -> FineTuned: `taperfold train --from`
    fine_tune: Callable[..., FineTuned] | None = None
    # a name that is no path (a Hub model id) -> the local directory it stands for, or None when it is not one
    resolve: Callable[[str], Path | None] | None = None
