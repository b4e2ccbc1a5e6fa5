"""`taperfold inspect`: what a model source holds and which of its norms export can fold (one schema for
every source, taperfold.sources)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from taperfold.nn import TaperedNorm
from taperfold.norms import is_norm_module, tapered_kind
from taperfold.sources import ModelSource

PLAIN = "plain model: folds into these once tapered"
PLAIN_KEPT = "plain model: an Internal-Taper keeps it"


def tapered_norm_entry(name: str, module: nn.Module, gate: float, folds_into: list[str]) -> dict:
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
        return {
            "name": name,
            "kind": type(module).__name__,
            "tapered": True,
            "gate": None,
            "c": None,
            "alpha": float(module.get_parameter("alpha").detach()),
            "gamma_tilde_min": None,
            "gamma_tilde_max": None,
            "folds_into": folds_into,
            "foldable": folds,
            "reason": reason,
        }
    tilde = module.gain(module.weight_tilde.detach())
    if not bool(module.calibrated):
        foldable, reason = False, "never calibrated: training stopped before taper start"
    elif gate != 0.0:
        foldable, reason = False, f"gate is {gate:g}, not 0: the layer still uses per-token statistics"
    else:
        foldable, reason = True, "g = 0: constant " + ("affine" if kind.centered or kind.shift else "diagonal") + " map"
    return {
        "name": name,
        "kind": type(module).__name__,
        "tapered": True,
        "gate": gate,
        "c": float(module.c),
        "gamma_tilde_min": float(tilde.min()),
        "gamma_tilde_max": float(tilde.max()),
        "folds_into": folds_into,
        "foldable": foldable,
        "reason": reason,
    }


def plain_norm_entry(name: str, kind: str, reason: str, folds_into: Sequence[str] = ()) -> dict:
    """A norm that is not tapered: never folded (`folds_into`: where it would fold once tapered)."""
    return {
        "name": name,
        "kind": kind,
        "tapered": False,
        "gate": None,
        "c": None,
        "gamma_tilde_min": None,
        "gamma_tilde_max": None,
        "folds_into": list(folds_into),
        "foldable": False,
        "reason": reason,
    }


def describe(source: ModelSource) -> dict:
    """The `inspect` report: the model, then every norm module in module order."""
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
    return {
        "path": str(source.path) if source.path else None,
        "arch": source.arch,
        "family": source.family.name,
        "taper": source.config.taper,
        "aux": source.tapered and source.config.aux,
        "parameters": sum(p.numel() for p in model.parameters()),
        "gate": source.gate,
        "step": source.step,
        "val_loss": source.meta.get("val_loss"),
        "schedule": source.meta.get("schedule"),
        "config": source.config.to_dict(),
        "norms": norms,
        "foldable": sum(n["foldable"] for n in norms),
        "kept": sum(not n["foldable"] for n in norms),
        "would_fold": len(would_fold),  # a plain model: the norms that fold once it is tapered
        "how_to_taper": None if tapering is not None else source.how_to_taper,
    }
