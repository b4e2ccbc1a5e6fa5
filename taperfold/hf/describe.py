"""`taperfold inspect HF_DIR`: the same report as for taperfold's own checkpoints, for a transformers model."""

from __future__ import annotations

from taperfold.describe import plain_norm_entry, tapered_norm_entry
from taperfold.hf.directory import HFCheckpoint


def describe_hf(ckpt: HFCheckpoint) -> dict:
    hf = ckpt.hf_model()
    tapering = hf.tapering
    norms = []
    if tapering is not None:
        for name, module in tapering.norms.items():
            norms.append(tapered_norm_entry(name, module, ckpt.gate, tapering.readers[name]))
        untapered = tapering.untapered
    else:
        untapered = {name: "plain model: no 'taperfold' block in config.json" for name, m in hf.named_modules()
                     if "norm" in type(m).__name__.lower()}
    for name, reason in untapered.items():
        norms.append(plain_norm_entry(name, type(hf.get_submodule(name)).__name__, reason))
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
