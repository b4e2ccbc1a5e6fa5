"""RMSNorm: h / r(h) · diag(γ), r(h) = sqrt(mean(h²) + ε). Tapered by TaperNorm (eq. 3); at g = 0 the
diagonal map h · diag(c·γ̃), which folds into the readers as W' = diag(s)·W."""

from __future__ import annotations

import torch
from torch import nn

from taperfold.nn import GatedTaperNorm, TaperNorm
from taperfold.norms import NormKind


class HandWrittenRMSNorm(nn.Module):
    """Hugging Face's `LlamaRMSNorm`: float32 statistics by elementwise ops, then the weight in the input dtype.
    Its ops run one kernel each (no fused F.rms_norm); the exporter writes it as plain ops below opset 23."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps

    def forward(self, h):
        dtype = h.dtype
        h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


KIND = NormKind(
    name="rms",
    title="RMSNorm",
    tapered=TaperNorm,
    plain=nn.RMSNorm,
    hand_written=HandWrittenRMSNorm,
    class_names=lambda name: "RMSNorm" in name or "RmsNorm" in name,  # LlamaRMSNorm, Qwen3NextRMSNormGated
    centered=False,
    shift=False,
    # ONNX's own op (opset 23) and ONNX Runtime's, whose Skip variant first adds the residual (input 1)
    fused_ops={
        "RMSNormalization": (1, None),
        "SimplifiedLayerNormalization": (1, None),
        "SkipSimplifiedLayerNormalization": (2, None),
    },
    gain_offset_allowed=True,
    tapered_with_gate=GatedTaperNorm,
)
