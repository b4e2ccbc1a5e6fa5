"""Where a model comes from, behind one interface: taperfold's own checkpoints and transformers directories.

    source = open_source(path)       # NAME.pt, NAME.safetensors, a checkpoint directory, or a save_pretrained
                                     # directory (tapered or plain)
    source.build(gate=0.0)           # the model (taperfold.taper.TaperedLM) with the source's weights
    source.build_baseline()          # the same weights with the model's own untapered norms

Everything downstream (describe, variants, export, verify, bench, train) speaks to `ModelSource` only. Each
kind of source is one `SourceKind` in `SOURCE_KINDS`; this module is the one door into the transformers
wing (taperfold.hf), which nothing else outside the wing imports.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from taperfold.errors import TaperfoldError
from taperfold.sources import builtin
from taperfold.sources.base import FineTuned, ModelSource, SourceKind, checkpoint_digest

__all__ = [
    "FineTuned",
    "ModelSource",
    "SourceKind",
    "checkpoint_digest",
    "config_from_dict",
    "fine_tune",
    "local_path",
    "open_source",
    "register",
]


def _transformers() -> SourceKind:
    from taperfold import hf  # the transformers wing: entered here and nowhere else

    return hf.KIND


# Asked in order, the first that claims a path opens it; taperfold's own format claims every path the others do not.
SOURCE_KINDS: list[Callable[[], SourceKind]] = [_transformers, lambda: builtin.KIND]


def register(kind: SourceKind) -> SourceKind:
    """Ask `kind` before taperfold's own format, the fallback."""
    SOURCE_KINDS.insert(len(SOURCE_KINDS) - 1, lambda: kind)
    return kind


def open_source(path: str | Path) -> ModelSource:
    """Read and validate the model at `path` (or the one a name such as a Hub model id stands for); one
    `TaperfoldError` naming the file and key on any problem."""
    path = local_path(path)
    return _kind_of(path).open(path)


def local_path(name: str | Path) -> Path:
    """`name` as an existing path: itself, or what a kind resolves it to (a Hub model id: its cached snapshot)."""
    path = Path(name)
    if path.exists():
        return path
    for kind in (get() for get in SOURCE_KINDS):
        if kind.resolve is not None and (resolved := kind.resolve(str(name))) is not None:
            return resolved
    raise TaperfoldError(f"{path}: no such file or directory")


def _kind_of(path: Path) -> SourceKind:
    return next(kind for kind in (get() for get in SOURCE_KINDS) if kind.claims(path))


def fine_tune(path: str | Path, opts, data_files: list[Path] | None, taper: str, aux: bool, on_step=None) -> FineTuned:
    """Taper the plain model at `path` and train it through the whole taper (`taperfold train --from`); the
    result's `save(out)` writes it in its source's format."""
    path = local_path(path)
    kind = _kind_of(path)
    if kind.fine_tune is None:
        raise TaperfoldError(
            f"{path}: `train --from` takes a plain Hugging Face directory; a taperfold checkpoint "
            "is trained with --preset"
        )
    return kind.fine_tune(path, opts, data_files, taper=taper, aux=aux, on_step=on_step)


def config_from_dict(config: dict):
    """A manifest's `config`, as the kind of source that wrote it reads it; ValueError when none did."""
    for kind in (get() for get in SOURCE_KINDS):
        if kind.wrote_config(config):
            return kind.config_from_dict(config)
    raise ValueError("not a model config taperfold wrote")
