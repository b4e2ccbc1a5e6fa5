"""`taperfold inspect`: what a model source holds and which of its norms export can fold (one schema for
every source, taperfold.sources): a `Description`, its norms `NormEntry`s, written as JSON by `to_json`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from taperfold.nn import TaperedNorm
from taperfold.norms import is_norm_module, tapered_kind
from taperfold.sources import ModelSource

PLAIN = "plain model: folds into these once tapered"
PLAIN_KEPT = "plain model: an Internal-Taper keeps it"


@dataclass(frozen=True)
class NormEntry:
    """One norm module of the model: tapered or not, its constants, and whether export can fold it and why."""

    name: str
    kind: str  # the module's class
    tapered: bool
    gate: float | None  # None: not tapered, or a kind without a gate (DyT)
    c: float | None
    gamma_tilde_min: float | None
    gamma_tilde_max: float | None
    folds_into: tuple[str, ...]  # the readers it folds into (a plain model's: once tapered)
    foldable: bool
    reason: str
    alpha: float | None = None  # DyT's α (a kind without a gate: tanh(αh) stays)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "tapered": self.tapered,
            "gate": self.gate,
            "c": self.c,
            **({"alpha": self.alpha} if self.alpha is not None else {}),
            "gamma_tilde_min": self.gamma_tilde_min,
            "gamma_tilde_max": self.gamma_tilde_max,
            "folds_into": list(self.folds_into),
            "foldable": self.foldable,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Description:
    """The `inspect` report: the model, then every norm module in module order."""

    path: str | None
    arch: str
    family: str
    taper: str
    aux: bool
    parameters: int
    gate: float
    step: int | None
    val_loss: float | None  # what training recorded, where it did
    schedule: dict | None
    config: dict  # the model's shape, as its kind of source writes it
    norms: tuple[NormEntry, ...]
    would_fold: int  # a plain model: the norms that fold once it is tapered
    how_to_taper: str | None  # a plain model: how to taper it (None: tapered)

    @property
    def foldable(self) -> int:
        return sum(n.foldable for n in self.norms)

    @property
    def kept(self) -> int:
        return sum(not n.foldable for n in self.norms)

    @property
    def norm(self) -> str | None:
        """The norm kind the config names (taperfold's own models: rms, ln, dyt), or None."""
        return self.config.get("norm")

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "arch": self.arch,
            "family": self.family,
            "taper": self.taper,
            "aux": self.aux,
            "parameters": self.parameters,
            "gate": self.gate,
            "step": self.step,
            "val_loss": self.val_loss,
            "schedule": self.schedule,
            "config": self.config,
            "norms": [n.to_json() for n in self.norms],
            "foldable": self.foldable,
            "kept": self.kept,
            "would_fold": self.would_fold,
            "how_to_taper": self.how_to_taper,
        }


def tapered_norm_entry(name: str, module: nn.Module, gate: float, folds_into: list[str]) -> NormEntry:
    """One tapered norm (or a norm kind without a gate in a norm's place: DyT), with whether export can fold it
    and why."""
    kind = tapered_kind(module)
    if kind is None:
        raise ValueError(f"{name}: a {type(module).__name__} is not a tapered norm")
    if not isinstance(module, TaperedNorm):  # a kind without a gate (DyT)
        folds = bool(folds_into)
        reason = (
            f"{kind.name}: γ, β fold into the readers, tanh(αh) stays"
            if folds
            else f"{kind.name}: after a post-norm's tanh, γ and β cannot reach the producer; left as it is"
        )
        return NormEntry(
            name=name,
            kind=type(module).__name__,
            tapered=True,
            gate=None,
            c=None,
            alpha=float(module.get_parameter("alpha").detach()),
            gamma_tilde_min=None,
            gamma_tilde_max=None,
            folds_into=tuple(folds_into),
            foldable=folds,
            reason=reason,
        )
    tilde = module.gain(module.weight_tilde.detach())
    if not bool(module.calibrated):
        foldable, reason = False, "never calibrated: training stopped before taper start"
    elif gate != 0.0:
        foldable, reason = False, f"gate is {gate:g}, not 0: the layer still uses per-token statistics"
    else:
        foldable, reason = True, "g = 0: constant " + ("affine" if kind.centered or kind.shift else "diagonal") + " map"
    return NormEntry(
        name=name,
        kind=type(module).__name__,
        tapered=True,
        gate=gate,
        c=float(module.c),
        gamma_tilde_min=float(tilde.min()),
        gamma_tilde_max=float(tilde.max()),
        folds_into=tuple(folds_into),
        foldable=foldable,
        reason=reason,
    )


def plain_norm_entry(name: str, kind: str, reason: str, folds_into: Sequence[str] = ()) -> NormEntry:
    """A norm that is not tapered: never folded (`folds_into`: where it would fold once tapered)."""
    return NormEntry(
        name=name,
        kind=kind,
        tapered=False,
        gate=None,
        c=None,
        gamma_tilde_min=None,
        gamma_tilde_max=None,
        folds_into=tuple(folds_into),
        foldable=False,
        reason=reason,
    )


def describe(source: ModelSource) -> Description:
    """The `inspect` report of `source`."""
    model = source.build()
    tapering = model.tapering
    family, n_layers = source.family, source.config.n_layers
    # a plain model: the norms an Internal-Taper would taper, and where each would fold
    would_fold = (
        {}
        if tapering is not None
        else {
            **family.norm_readers(n_layers, "internal"),
            **{p: [q] for p, q in family.norm_producers(n_layers).items()},
        }
    )
    norms = []
    for name, module in model.network.named_modules():
        if tapering is not None and name in tapering.norms:
            norms.append(tapered_norm_entry(name, module, source.gate, tapering.folds_into(name)))
        elif name in would_fold:
            norms.append(plain_norm_entry(name, type(module).__name__, PLAIN, would_fold[name]))
        elif is_norm_module(module):
            reason = tapering.untapered.get(name, "") if tapering is not None else PLAIN_KEPT
            norms.append(plain_norm_entry(name, type(module).__name__, reason))
    return Description(
        path=str(source.path) if source.path else None,
        arch=source.arch,
        family=source.family.name,
        taper=source.config.taper,
        aux=source.tapered and source.config.aux,
        parameters=sum(p.numel() for p in model.parameters()),
        gate=source.gate,
        step=source.step,
        val_loss=source.meta.get("val_loss"),
        schedule=source.meta.get("schedule"),
        config=source.config.to_dict(),
        norms=tuple(norms),
        would_fold=len(would_fold),
        how_to_taper=None if tapering is not None else source.how_to_taper,
    )
