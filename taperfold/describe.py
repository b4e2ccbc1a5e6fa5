"""`taperfold inspect`: what a checkpoint holds and which of its norms export can fold."""

from __future__ import annotations

from torch import nn

from taperfold.checkpoint import Checkpoint
from taperfold.families import family
from taperfold.models import num_parameters
from taperfold.nn import TaperLN, TaperNorm


def tapered_norm_entry(name: str, module: TaperNorm, gate: float, folds_into: list[str]) -> dict:
    """One tapered norm of an inspect report, with whether export can fold it and why (both checkpoint kinds)."""
    tilde = module.gain(module.weight_tilde.detach())
    if not bool(module.calibrated):
        foldable, reason = False, "never calibrated: training stopped before taper start"
    elif gate != 0.0:
        foldable, reason = False, f"gate is {gate:g}, not 0: the layer still uses per-token statistics"
    else:
        foldable, reason = True, "g = 0: constant " + ("diagonal" if isinstance(module, TaperNorm) else "affine") + " map"
    return {"name": name, "kind": type(module).__name__, "tapered": True, "gate": gate, "c": float(module.c),
            "gamma_tilde_min": float(tilde.min()), "gamma_tilde_max": float(tilde.max()), "folds_into": folds_into,
            "foldable": foldable, "reason": reason}


def plain_norm_entry(name: str, kind: str, reason: str) -> dict:
    """A norm that is not tapered: never folded."""
    return {"name": name, "kind": kind, "tapered": False, "gate": None, "c": None, "gamma_tilde_min": None,
            "gamma_tilde_max": None, "folds_into": [], "foldable": False, "reason": reason}


def describe_checkpoint(ckpt: Checkpoint) -> dict:
    if not isinstance(ckpt, Checkpoint):  # a Hugging Face directory (taperfold.hf)
        from taperfold.hf.describe import describe_hf

        return describe_hf(ckpt)
    model = ckpt.build()
    readers = family(ckpt.config.arch).norm_readers(ckpt.config)
    norms = []
    for name, module in model.named_modules():
        if isinstance(module, (TaperNorm, TaperLN)):
            norms.append(tapered_norm_entry(name, module, ckpt.gate, readers.get(name, [])))
        elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
            norms.append(plain_norm_entry(name, type(module).__name__,
                                          "not a tapered layer (per-token statistics by design)"))
    cfg = ckpt.config
    return {
        "path": str(ckpt.path) if ckpt.path else None,
        "arch": cfg.arch,
        "taper": cfg.taper,
        "aux": cfg.aux and cfg.taper != "none",
        "parameters": num_parameters(model),
        "gate": ckpt.gate,
        "step": ckpt.step,
        "val_loss": ckpt.meta.get("val_loss"),
        "config": cfg.to_dict(),
        "norms": norms,
        "foldable": sum(n["foldable"] for n in norms),
        "kept": sum(not n["foldable"] for n in norms),
    }
