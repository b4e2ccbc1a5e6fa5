"""`taperfold inspect`: what a checkpoint holds and which of its norms export can fold."""

from __future__ import annotations

from torch import nn

from taperfold.checkpoint import Checkpoint
from taperfold.families import family
from taperfold.models import num_parameters
from taperfold.nn import TaperLN, TaperNorm


def describe_checkpoint(ckpt: Checkpoint) -> dict:
    if not isinstance(ckpt, Checkpoint):  # a Hugging Face directory (taperfold.hf)
        from taperfold.hf.describe import describe_hf

        return describe_hf(ckpt)
    model = ckpt.build()
    readers = family(ckpt.config.arch).norm_readers(ckpt.config)
    norms = []
    for name, module in model.named_modules():
        if isinstance(module, (TaperNorm, TaperLN)):
            tilde = module.weight_tilde.detach()
            if not bool(module.calibrated):
                foldable, reason = False, "never calibrated: training stopped before taper start"
            elif ckpt.gate != 0.0:
                foldable, reason = False, f"gate is {ckpt.gate:g}, not 0: the layer still uses per-token statistics"
            else:
                foldable, reason = True, "g = 0: constant " + ("diagonal" if isinstance(module, TaperNorm) else "affine") + " map"
            norms.append({"name": name, "kind": type(module).__name__, "tapered": True, "gate": ckpt.gate,
                          "c": float(module.c), "gamma_tilde_min": float(tilde.min()),
                          "gamma_tilde_max": float(tilde.max()), "folds_into": readers.get(name, []),
                          "foldable": foldable, "reason": reason})
        elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
            norms.append({"name": name, "kind": type(module).__name__, "tapered": False, "gate": None, "c": None,
                          "gamma_tilde_min": None, "gamma_tilde_max": None, "folds_into": [],
                          "foldable": False, "reason": "not a tapered layer (per-token statistics by design)"})
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
