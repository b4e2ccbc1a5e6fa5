"""What the benchmark runs, resolved once from the command line: an export directory, a checkpoint, or a
preset (random weights at g = 0 with random c and γ̃: a timing model that needs no training).

Engines that run exported graphs read the directory's files; engines that run torch models build the
variants from one tapered model source (taperfold.sources): the export's checkpoint, the checkpoint, or the
preset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from taperfold.errors import TaperfoldError
from taperfold.manifest import Manifest, read_manifest
from taperfold.sources import ModelSource, open_source
from taperfold.taper import ModelShape


@dataclass
class Source:
    label: str  # names it in errors: the directory, the checkpoint, or "--preset NAME"
    config: ModelShape  # the model's shape (ModelSource.config)
    model_source: Callable[[], ModelSource]  # a tapered model source, opened when a torch engine needs it
    manifest: Manifest | None  # set for an export directory
    description: dict  # the report's `source`

    @property
    def logits(self) -> str:
        return self.manifest.logits if self.manifest else "last"

    def to_dict(self) -> dict:
        return dict(self.description)


def resolve_source(export_dir: str | None, checkpoint: str | None, preset: str | None, arch: str = "llama") -> Source:
    given = [name for name, value in (("DIR", export_dir), ("--checkpoint", checkpoint), ("--preset", preset)) if value]
    if len(given) != 1:
        raise TaperfoldError(
            "give exactly one of DIR (an export directory), --checkpoint CKPT or --preset NAME"
            + (f"; got {' and '.join(given)}" if given else "")
        )
    description = {
        "export_dir": export_dir and str(Path(export_dir)),
        "checkpoint": checkpoint and str(Path(checkpoint)),
        "preset": preset,
        "arch": arch if preset else None,
    }
    if preset:
        from taperfold.models import preset_config, random_gate0_model
        from taperfold.sources.builtin import checkpoint_from_model

        return Source(
            f"--preset {preset}",
            preset_config(preset, arch=arch),
            lambda: checkpoint_from_model(random_gate0_model(preset, arch), step=0),
            None,
            description,
        )
    if checkpoint:
        model_source = _tapered(open_source(checkpoint), checkpoint)
        return Source(str(checkpoint), model_source.config, lambda: model_source, None, description)
    assert export_dir is not None  # exactly one of the three, checked above
    manifest = read_manifest(export_dir)
    return Source(str(export_dir), manifest.config(), lambda: _exported_checkpoint(manifest), manifest, description)


def _exported_checkpoint(manifest: Manifest) -> ModelSource:
    path = manifest.checkpoint
    if not path.exists():
        raise TaperfoldError(
            f"{manifest.path}: key 'checkpoint.path': {path} no longer exists; pass "
            "--checkpoint CKPT instead of DIR for a torch engine"
        )
    return _tapered(open_source(path), path)


def _tapered(source: ModelSource, origin) -> ModelSource:
    if not source.tapered:
        raise TaperfoldError(f"{origin}: the checkpoint has no tapered norms (taper=none): nothing to compare")
    return source
