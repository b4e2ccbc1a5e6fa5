"""LayerNorm: (h − μ_h) / σ_h · diag(γ) + β. Tapered by TaperLN (eq. 6); at g = 0 the affine map
(h − μ_h) · diag(c·γ̃) + β, which folds into the readers as W' = (I − 11ᵀ/d)·diag(s)·W, b' = b + β·W."""

from __future__ import annotations

import torch
from torch import nn

from taperfold.nn import TaperLN
from taperfold.norms import NormKind


class HandWrittenLayerNorm(nn.Module):
    """LayerNorm as elementwise ops (mean, variance, scale, shift), the way hand-written LN code computes it."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, h):
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).pow(2).mean(-1, keepdim=True)
        out = (h - mean) * torch.rsqrt(var + self.eps) * self.weight
        return out + self.bias if self.bias is not None else out


KIND = NormKind(
    name="ln",
    title="LayerNorm",
    tapered=TaperLN,
    plain=nn.LayerNorm,
    hand_written=HandWrittenLayerNorm,
    class_names=lambda name: "LayerNorm" in name,  # LayerNorm, OlmoLayerNorm, NemotronLayerNorm1P
    centered=True,
    shift=True,
    # ONNX's op and ONNX Runtime's Skip variant, which first adds the residual (input 1)
    fused_ops={"LayerNormalization": (1, 2), "SkipLayerNormalization": (2, 3)},
    gain_offset_allowed=True,  # Nemotron's LayerNorm1P: (1 + γ)
)
