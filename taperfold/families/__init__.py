"""Model families, one module each: the model classes and the facts the rest of taperfold needs about them.

A family module defines its `CausalLM` subclass and a `FAMILY` entry: how its norms are computed
(`norm_kind`), the config defaults its presets use, and which linear layers read each norm's output
(`norm_readers`: what a fold rewrites, and what `taperfold inspect` lists). Adding a family is a new
module plus its name in `ARCHS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

ARCHS = ("llama", "gpt2")  # ModelConfig.arch values, each also the name of its module here


@dataclass(frozen=True)
class Family:
    arch: str  # ModelConfig.arch
    model_class: type  # a taperfold.models.CausalLM subclass
    norm_kind: str  # "rms" (RMSNorm / TaperNorm) | "ln" (LayerNorm / TaperLN)
    norm_readers: Callable  # (ModelConfig) -> {norm module path: [paths of the linear layers reading it]}
    config_defaults: dict = field(default_factory=dict)  # ModelConfig fields the presets set for this family


def _load() -> dict[str, Family]:
    families = [importlib.import_module(f"taperfold.families.{name}").FAMILY for name in ARCHS]
    return {f.arch: f for f in families}


_FAMILIES: dict[str, Family] = {}


def families() -> dict[str, Family]:
    """arch -> Family, every family taperfold knows (imported on first use: models.py imports this lazily)."""
    if not _FAMILIES:
        _FAMILIES.update(_load())
    return _FAMILIES


def family(arch: str) -> Family:
    known = families()
    if arch not in known:
        raise ValueError(f"arch must be one of {tuple(known)}, got {arch!r}")
    return known[arch]
