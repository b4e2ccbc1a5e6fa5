"""What taperfold needs to know about each transformers architecture, one module per family.

A family says, and says only: which modules are the norms (internal, per decoder layer, and the final
one), how its norm computes its gain, which linear layers read each norm (what a fold rewrites), and
which norm-like modules it never tapers and why. Everything else (attention, RoPE, caches, masks) is
transformers' own code. Adding a family is one module in this package plus its name in `_MODULES`
(see docs/hf.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from taperfold.errors import TaperfoldError


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json's "model_type" values this family reads
    norm: str  # "rms" (tapered by TaperNorm) | "ln" (tapered by TaperLN)
    layers: str  # path of the ModuleList of decoder layers
    # norm attribute in a layer -> the reader modules (paths relative to the layer) that take its output
    internal: dict[str, tuple[str, ...]]
    final: str  # path of the final norm, read by the output head
    gain_offset: float = 0.0  # the norm computes x·(offset + w): 1 for Gemma
    parallel: bool = False  # attention and MLP read the same residual stream (GPT-NeoX, Phi-1/2)
    # module name (last path component) -> why it is never tapered
    untapered: dict[str, str] = field(default_factory=dict)
    # config -> a reason this configuration is not supported, or None
    check: Callable[[object], str | None] = lambda config: None

    def internal_norms(self, n_layers: int) -> dict[str, list[str]]:
        """Each internal norm's module path -> the module paths of its readers."""
        return {f"{self.layers}.{i}.{norm}": [f"{self.layers}.{i}.{r}" for r in readers]
                for i in range(n_layers) for norm, readers in self.internal.items()}


# The families taperfold ships; each module registers itself with `register`.
_MODULES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "phi", "gpt2", "gpt_neox", "opt")
_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    for model_type in family.model_types:
        _REGISTRY[model_type] = family
    return family


def _load_all() -> None:
    if not _REGISTRY:
        for name in _MODULES:
            importlib.import_module(f"{__name__}.{name}")


def supported_model_types() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def family_for(model_type, where: str = "config.json") -> Family:
    """The family for `model_type`; one error naming the file, the key and the supported types otherwise."""
    _load_all()
    family = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise TaperfoldError(f"{where}: key 'model_type' is {model_type!r}, which taperfold cannot taper; "
                             f"supported: {', '.join(supported_model_types())}")
    return family
