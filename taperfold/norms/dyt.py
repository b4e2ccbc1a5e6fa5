"""DyT, Dynamic Tanh (Zhu, Chen, He, LeCun, Liu 2025; ../shared/papers/dyt-zhu-2025.md): a norm's place taken by
DyT(h) = tanh(α·h) · diag(γ) + β, with α one learnable scalar and γ, β per channel, as the paper's Algorithm 1.

It computes no statistic and has no gate: it is foldable from its first step. The tanh is per element, so it
stays; γ and β are an affine map after it and fold into the readers exactly as a LayerNorm's at g = 0
(W' = diag(γ)·W, b' = b + β·W), leaving tanh(α·h) in the norm's place.
"""

from __future__ import annotations

import torch
from torch import nn

from taperfold.nn import Gating, ServedNorm
from taperfold.norms import ConstantMap, NormKind

ALPHA0 = 0.5  # the paper's default initial α (its Table 10)


class DyT(nn.Module):
    """tanh(α·h) · γ + β. Built in place of a norm (`KIND.taper`) with that norm's γ (and β) and α = `alpha0`."""

    def __init__(self, dim: int, alpha0: float = ALPHA0):
        super().__init__()
        self.dim = dim
        self.alpha = nn.Parameter(torch.full((1,), float(alpha0)))
        self.weight = nn.Parameter(torch.ones(dim))  # γ
        self.bias = nn.Parameter(torch.zeros(dim))  # β

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * h) * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha={float(self.alpha.detach()):g}"


class ScaledTanh(nn.Module):
    """tanh(α·h): what stays of a DyT once γ and β have moved into the layers that read it."""

    def __init__(self, alpha: torch.Tensor):
        super().__init__()
        self.alpha = nn.Parameter(alpha.detach().clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * h)


class ServedTanh(ServedNorm):
    """tanh(α·h) in a served model (taperfold.serving): a folded DyT, its γ and β in its readers. α is loaded from the
    checkpoint (`<norm>.alpha`)."""

    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1,), ALPHA0))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * x)


class ServedDyT(ServedTanh):
    """A whole DyT in a served model: one whose γ, β no layer of the served model takes (the final norm, whose β
    would be a bias of the head, which vLLM's heads do not add; one read by a MoE router, a bare weight; a post-norm,
    whose tanh stands between it and its producer). α, γ, β are loaded from the checkpoint (`<norm>.alpha`, `.weight`,
    `.bias`)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return super().normalize(x) * self.weight + self.bias


class DyTKind(NormKind):
    """The norm-kind interface for DyT: it replaces a norm instead of tapering it, so the gate, c, γ̃ and the
    calibration do not apply (`gated` is False); its constant map is γ, β, and tanh(α·h) is its residue."""

    def new_tapered(
        self,
        dim: int,
        gate,
        eps: float,
        momentum: float,
        delta: float,
        gain_offset: float = 0.0,
        gating: Gating | None = None,
    ) -> nn.Module:
        return DyT(dim)

    def taper(
        self,
        norm: nn.Module,
        gate,
        eps: float,
        momentum: float,
        delta: float,
        gain_offset: float = 0.0,
        gating: Gating | None = None,
    ) -> nn.Module:
        """A DyT in place of `norm`, starting from its gain (offset + γ: Gemma's norms compute x·(1 + w)) and β."""
        if gating is not None:
            raise ValueError("a DyT has no gate input: a gated norm keeps its own")
        weight = getattr(norm, "weight", None)
        if weight is None:  # a weightless norm (OLMo) has γ = 1, β = 0
            shape = tuple(getattr(norm, "normalized_shape", ()))
            if len(shape) != 1:
                raise ValueError(f"{type(norm).__name__}: a norm with neither a weight nor a 1-D normalized_shape")
            weight = torch.ones(shape)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise ValueError(f"{type(norm).__name__}: a norm without a per-feature weight cannot become a DyT")
        new = DyT(weight.shape[0]).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            new.weight.copy_(weight + gain_offset)
            bias = getattr(norm, "bias", None)
            if isinstance(bias, torch.Tensor):
                new.bias.copy_(bias)
        return new

    def constant_map(self, norm: nn.Module) -> ConstantMap:
        """The affine map after the tanh, in float64: γ and β, which a fold moves into the readers."""
        return ConstantMap(norm.get_parameter("weight").double(), norm.get_parameter("bias").double(), centered=False)

    def residue(self, norm: nn.Module) -> nn.Module:
        return ScaledTanh(norm.get_parameter("alpha"))

    def served(self, width: int, folded: bool) -> ServedNorm:
        return ServedTanh() if folded else ServedDyT(width)


KIND = DyTKind(
    # no fused form: a DyT module is its own plain and hand-written norm (the benchmark's baseline for a DyT model
    # is the architecture's own norm, taperfold.models.baseline_of)
    name="dyt",
    title="DyT",
    tapered=DyT,
    plain=DyT,
    hand_written=lambda module: module,
    class_names=lambda name: name in ("DyT", "DynamicTanh"),
    centered=False,
    shift=True,
    gated=False,
    elementwise="Tanh",
    folded_note="γ, β folded, tanh kept",
)
