"""What the benchmark runs, resolved once from the command line: an export directory, a checkpoint, or a
preset (random weights at g = 0 with random c and γ̃: a timing model that needs no training).

Engines that run exported graphs read the directory's files; engines that run torch models build the
three variants from one tapered model at g = 0: the export's checkpoint, the checkpoint, or the preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from taperfold.errors import TaperfoldError
from taperfold.exportdir import Manifest, read_manifest
from taperfold.models import CausalLM, ModelConfig


@dataclass
class Source:
    label: str  # names it in errors: the directory, the checkpoint, or "--preset NAME"
    config: ModelConfig
    tapered_model: Callable[[], CausalLM]  # the tapered model at g = 0, built when a torch engine needs it
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
        raise TaperfoldError("give exactly one of DIR (an export directory), --checkpoint CKPT or --preset NAME"
                             + (f"; got {' and '.join(given)}" if given else ""))
    description = {"export_dir": export_dir and str(Path(export_dir)),
                   "checkpoint": checkpoint and str(Path(checkpoint)), "preset": preset, "arch": arch if preset else None}
    if preset:
        from taperfold.models import preset_config
        from taperfold.variants import random_gate0_model

        return Source(f"--preset {preset}", preset_config(preset, arch=arch),
                      lambda: _tapered(random_gate0_model(preset, arch), f"--preset {preset}"), None, description)
    if checkpoint:
        from taperfold.checkpoint import load_checkpoint

        ckpt = load_checkpoint(checkpoint)
        return Source(str(checkpoint), ckpt.config, lambda: _tapered(ckpt.build(gate=0.0), checkpoint), None,
                      description)
    manifest = read_manifest(export_dir)
    return Source(str(export_dir), manifest.config(), lambda: _exported_checkpoint_model(manifest), manifest,
                  description)


def _exported_checkpoint_model(manifest: Manifest) -> CausalLM:
    from taperfold.checkpoint import load_checkpoint

    path = manifest.checkpoint
    if not path.exists():
        raise TaperfoldError(f"{manifest.path}: key 'checkpoint.path': {path} no longer exists; pass "
                             "--checkpoint CKPT instead of DIR for a torch engine")
    return _tapered(load_checkpoint(path).build(gate=0.0), path)


def _tapered(model: CausalLM, origin) -> CausalLM:
    if model.cfg.taper == "none":
        raise TaperfoldError(f"{origin}: the checkpoint has no tapered norms (taper=none): nothing to compare")
    return model

