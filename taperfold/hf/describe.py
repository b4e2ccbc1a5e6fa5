"""`taperfold inspect HF_DIR`: the same report as for taperfold's own checkpoints, for a transformers model."""

from __future__ import annotations

from taperfold.hf.directory import HFCheckpoint
from taperfold.nn import TaperNorm


def describe_hf(ckpt: HFCheckpoint) -> dict:
    hf = ckpt.hf_model()
    tapering = hf.tapering
    norms = []
    if tapering is not None:
        for name, module in tapering.norms.items():
            tilde = module.gain(module.weight_tilde.detach())
            if not bool(module.calibrated):
                foldable, reason = False, "never calibrated: training stopped before taper start"
            elif ckpt.gate != 0.0:
                foldable, reason = False, f"gate is {ckpt.gate:g}, not 0: the layer still uses per-token statistics"
            else:
                kind = "diagonal" if isinstance(module, TaperNorm) else "affine"
                foldable, reason = True, f"g = 0: constant {kind} map"
            norms.append({"name": name, "kind": type(module).__name__, "tapered": True, "gate": ckpt.gate,
                          "c": float(module.c), "gamma_tilde_min": float(tilde.min()),
                          "gamma_tilde_max": float(tilde.max()), "folds_into": tapering.readers[name],
                          "foldable": foldable, "reason": reason})
        untapered = tapering.untapered
    else:
        untapered = {name: "plain model: no 'taperfold' block in config.json" for name, m in hf.named_modules()
                     if "norm" in type(m).__name__.lower()}
    for name, reason in untapered.items():
        norms.append({"name": name, "kind": type(hf.get_submodule(name)).__name__, "tapered": False, "gate": None,
                      "c": None, "gamma_tilde_min": None, "gamma_tilde_max": None, "folds_into": [],
                      "foldable": False, "reason": reason})
    return {
        "path": str(ckpt.path),
        "arch": f"{ckpt.config.arch} (transformers)",
        "family": ckpt.family.name,
        "taper": ckpt.config.taper,
        "aux": ckpt.config.aux,
        "parameters": sum(p.numel() for p in hf.parameters()),
        "gate": ckpt.gate,
        "step": ckpt.step,
        "val_loss": None,
        "schedule": ckpt.block.schedule if ckpt.block else None,
        "config": ckpt.config.to_dict(),
        "norms": norms,
        "foldable": sum(n["foldable"] for n in norms),
        "kept": sum(not n["foldable"] for n in norms),
    }
