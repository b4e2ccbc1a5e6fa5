"""TaperNorm, TaperLN, the global gate and the scale-anchoring loss, as the paper defines them.

Kanavalau, Amo Alonso, Lall (2026), "Gated Removal of Normalization in Transformers" (../shared/papers):

    TaperNorm(h; g) = g · h / r(h) · diag(γ) + (1 − g) · c · h · diag(γ̃)                      (eq. 3)
    TaperLN(h; g)   = β + g · (h − μ_h) / σ_h · diag(γ) + (1 − g) · c · (h − μ_h) · diag(γ̃)     (eq. 6)

A single gate g is shared by every tapered layer: 1 through warm-up (while EMAs of the numerator and
denominator of the least-squares optimum c* accumulate, eq. 4 / eq. 7 with the bias correction of A.6),
then at taper start c ← c* is frozen and γ̃ ← γ, then g is cosine-decayed to 0. At g = 0 the layer is
the constant map c·h·diag(γ̃) (LN: affine), which `taperfold export` folds into the next projection.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GateSchedule:
    """g = 1 before `taper_start`, cosine 1 → 0 on [taper_start, taper_end], 0 from `taper_end` on."""

    taper_start: int
    taper_end: int

    def __post_init__(self):
        if not 0 <= self.taper_start < self.taper_end:
            raise ValueError(f"need 0 <= taper_start < taper_end, got {self.taper_start}, {self.taper_end}")

    def __call__(self, step: int) -> float:
        if step < self.taper_start:
            return 1.0
        if step >= self.taper_end:
            return 0.0
        progress = (step - self.taper_start) / (self.taper_end - self.taper_start)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class TaperGate:
    """The one gate all tapered layers of a model read. A plain Python float, so that at g = 0 the
    forward pass (and the exported graph) holds no per-token statistics at all, not a branch times 0.

    `calibrating` is true during warm-up: tapered layers then update their EMAs in training mode.
    """

    def __init__(self, value: float = 1.0, calibrating: bool = False):
        self.value = float(value)
        self.calibrating = calibrating

    def __repr__(self) -> str:
        return f"TaperGate(value={self.value:g}, calibrating={self.calibrating})"


def bias_corrected(ema: torch.Tensor, count: torch.Tensor, momentum: float) -> torch.Tensor:
    """EMA with zero start, corrected for the start as in the paper's A.6: s / (1 − (1 − μ)^n)."""
    n = int(count.item())
    if n == 0:
        raise RuntimeError("no EMA samples yet: calibration needs at least one training step at g = 1")
    return ema / (1.0 - (1.0 - momentum) ** n)


class TaperedNorm(nn.Module):
    """State shared by TaperNorm and TaperLN: γ, γ̃, the frozen scalar c and the calibration EMAs (what a gated norm
    kind's constant map reads)."""

    # buffers (register_buffer), declared for the type checker
    c: torch.Tensor
    ema_num: torch.Tensor
    ema_den: torch.Tensor
    ema_count: torch.Tensor
    calibrated: torch.Tensor

    def __init__(self, dim: int, gate: TaperGate, eps: float, momentum: float, delta: float, gain_offset: float = 0.0):
        super().__init__()
        self.dim, self.eps, self.momentum, self.delta = dim, eps, momentum, delta
        # The gain applied is offset + weight: 0 for most models, 1 for Gemma's norm, x·(1 + w).
        self.gain_offset = gain_offset
        # Not a submodule: every layer shares one gate object, and it is not part of the state dict.
        self.gate = gate
        self.weight = nn.Parameter(torch.ones(dim))  # γ
        self.weight_tilde = nn.Parameter(torch.ones(dim))  # γ̃, set from γ at taper start
        self.register_buffer("c", torch.tensor(1.0))
        self.register_buffer("ema_num", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("ema_den", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("ema_count", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("calibrated", torch.tensor(False))

    def _apply(self, fn, recurse=True):
        # The EMAs stay float64 whatever dtype the model is cast to: they are statistics, not weights.
        num, den = self.ema_num, self.ema_den
        out = super()._apply(fn, recurse)
        self.ema_num = num.to(device=self.c.device)
        self.ema_den = den.to(device=self.c.device)
        return out

    @torch.no_grad()
    def _track(self, centred: torch.Tensor, scale: torch.Tensor) -> None:
        """Update EMAs of E[‖h̄γ‖²/s(h)] and E[‖h̄γ‖²] (eq. 4 with h̄ = h, s = r; eq. 7 with h̄ = h − μ, s = σ).
        `scale` holds s of each of the equal groups the features are normalized in ([..., groups]); the sums then
        run over the groups too, which keeps c the least-squares fit of the grouped norm."""
        energy = (centred * self.gain(self.weight).float()).unflatten(-1, (scale.shape[-1], -1)).pow(2).sum(-1)
        num = (energy / scale).mean().double()
        den = energy.mean().double()
        mu = self.momentum
        self.ema_num.mul_(1 - mu).add_(mu * num)
        self.ema_den.mul_(1 - mu).add_(mu * den)
        self.ema_count += 1

    @torch.no_grad()
    def calibrate(self) -> float:
        """Taper start: c ← ŝ_num / (ŝ_den + δ) (frozen from now on) and γ̃ ← γ. Returns c."""
        num = bias_corrected(self.ema_num, self.ema_count, self.momentum)
        den = bias_corrected(self.ema_den, self.ema_count, self.momentum)
        self.c.fill_(float(num / (den + self.delta)))
        self.weight_tilde.copy_(self.weight)
        self.calibrated.fill_(True)
        return float(self.c)

    def gain(self, w: torch.Tensor) -> torch.Tensor:
        """The per-feature gain stored as `w` (γ or γ̃): w itself, or offset + w (Gemma)."""
        return w + self.gain_offset if self.gain_offset else w

    def bare(self) -> nn.Module:
        """What is left in the norm's place without its normalization and gain: nothing (a gated norm: its gate)."""
        return nn.Identity()

    def extra_repr(self) -> str:
        offset = f", gain_offset={self.gain_offset:g}" if self.gain_offset else ""
        return f"{self.dim}, eps={self.eps}{offset}, gate={self.gate.value:g}"


class TaperNorm(TaperedNorm):
    """RMSNorm variant (eq. 3)."""

    def __init__(
        self,
        dim: int,
        gate: TaperGate,
        eps: float = 1e-6,
        momentum: float = 0.01,
        delta: float = 1e-8,
        gain_offset: float = 0.0,
    ):
        super().__init__(dim, gate, eps, momentum, delta, gain_offset)

    groups = 1  # equal slices of the features normalized apart (a gated norm's may be more)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        g = self.gate.value
        if g == 0.0:
            return h * self.c * self.gain(self.weight_tilde)  # constant diagonal map: no per-token statistics
        if self.groups == 1:
            normed = F.rms_norm(h, (self.dim,), self.gain(self.weight), self.eps)
        else:
            grouped = F.rms_norm(h.unflatten(-1, (self.groups, -1)), (self.dim // self.groups,), None, self.eps)
            normed = grouped.flatten(-2) * self.gain(self.weight)
        if self.training and self.gate.calibrating:
            x = h.float()
            rms = torch.sqrt(x.unflatten(-1, (self.groups, -1)).pow(2).mean(-1) + self.eps)
            self._track(x, rms)
        if g == 1.0:
            return normed
        return g * normed + (1.0 - g) * (h * self.c * self.gain(self.weight_tilde))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class Gating:
    """How a gated norm (Mamba2's, the gated delta net's RMSNormGated: forward(x, z)) applies its gate input z:
    N(x)·act(z) when `norm_first`, else N(x·act(z)); N normalizes `groups` equal slices of the features apart."""

    activation: str  # a key of _ACTIVATIONS
    norm_first: bool
    groups: int = 1

    def __post_init__(self):
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"gate activation must be one of {', '.join(_ACTIVATIONS)}, got {self.activation!r}")
        if self.groups < 1:
            raise ValueError(f"groups must be at least 1, got {self.groups}")

    def apply(self, h: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        """h·act(z), in float32 as transformers' gated norms compute it; h itself without a gate input."""
        if z is None:
            return h
        return (h.float() * _ACTIVATIONS[self.activation](z.float())).to(h.dtype)


def without_norm(module: nn.Module) -> nn.Module:
    """What is left of a tapered (or replacing) norm module without its normalization and gain: a tapered norm's
    `bare()` (a gated norm's gate), else nothing."""
    return module.bare() if isinstance(module, TaperedNorm) else nn.Identity()


class ServedNorm(nn.Module):
    """What a served model (taperfold.serving: vLLM's and transformers' classes of a folded checkpoint) has in a norm's
    place. Both call it `norm(x)` and take `normalize(x)`; vLLM's decoder layers also call it `norm(x, residual)`, its
    add fused into the norm, and take (normalize(x + residual), x + residual). Here `normalize` is the identity: what
    a norm whose whole map folded into its readers leaves, the residual add alone; a kind that keeps an op in the norm's
    place serves a subclass (taperfold.norms.NormKind.served)."""

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.normalize(x)
        total = x + residual
        return self.normalize(total), total


class GateOnly(nn.Module):
    """A gated norm without its norm: h·act(z). What a fold leaves in its place, since at g = 0 the norm is a
    diagonal map, which commutes with the gate's element-wise product and moves into the next layer."""

    def __init__(self, gating: Gating):
        super().__init__()
        self.gating = gating

    def forward(self, h: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return self.gating.apply(h, z)


class GatedTaperNorm(TaperNorm):
    """TaperNorm inside a gated norm: the gate input z applied as `gating` says, before or after the tapered norm."""

    def __init__(
        self,
        dim: int,
        gate: TaperGate,
        eps: float = 1e-6,
        momentum: float = 0.01,
        delta: float = 1e-8,
        gain_offset: float = 0.0,
        *,
        gating: Gating,
    ):
        super().__init__(dim, gate, eps, momentum, delta, gain_offset)
        if dim % gating.groups:
            raise ValueError(f"{dim} features do not split into {gating.groups} equal groups")
        self.gating = gating
        self.groups = gating.groups

    def forward(self, h: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        if self.gating.norm_first:
            return self.gating.apply(super().forward(h), z)
        return super().forward(self.gating.apply(h, z))

    @property
    def variance_epsilon(self) -> float:
        # transformers' Mamba2 mixers pass their norm's weight and epsilon to a fused training kernel (mamba_ssm,
        # CUDA only), which then computes a real norm; without it they call this module
        return self.eps

    def bare(self) -> nn.Module:
        return GateOnly(self.gating)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.gating}"


class TaperLN(TaperedNorm):
    """LayerNorm variant (eq. 6); β is shared by both branches."""

    def __init__(
        self,
        dim: int,
        gate: TaperGate,
        eps: float = 1e-5,
        momentum: float = 0.01,
        delta: float = 1e-8,
        gain_offset: float = 0.0,
    ):
        super().__init__(dim, gate, eps, momentum, delta, gain_offset)
        self.bias = nn.Parameter(torch.zeros(dim))  # β

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        g = self.gate.value
        if g == 0.0:
            centred = h - h.mean(-1, keepdim=True)
            return centred * self.c * self.gain(self.weight_tilde) + self.bias
        normed = F.layer_norm(h, (self.dim,), self.gain(self.weight), self.bias, self.eps)
        if self.training and self.gate.calibrating:
            x = h.float()
            centred = x - x.mean(-1, keepdim=True)
            sigma = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
            self._track(centred, sigma)
        if g == 1.0:
            return normed
        centred = h - h.mean(-1, keepdim=True)
        return g * normed + (1.0 - g) * (centred * self.c * self.gain(self.weight_tilde) + self.bias)


class ScaledEmbedding(nn.Module):
    """A token embedding times one learnable scalar: what DyT's LLaMA recipe adds after the embedding (Zhu et al.
    2025, sec. 5), since without a norm nothing else brings the residual stream to the scale the blocks expect.
    Holds the embedding's own weight (a head tied to it stays tied); the state dict gains `scale`."""

    def __init__(self, embedding: nn.Embedding, scale: float):
        super().__init__()
        self.weight = embedding.weight
        self.padding_idx = embedding.padding_idx
        self.scale = nn.Parameter(
            torch.tensor(float(scale), dtype=embedding.weight.dtype, device=embedding.weight.device)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx) * self.scale


def token_scale(h: torch.Tensor, centered: bool, eps: float) -> torch.Tensor:
    """s(h) of eq. 5 per token: r(h) for RMS models, σ_h for LayerNorm models (`centered`). Shape h.shape[:-1]."""
    x = h.float()
    if centered:
        x = x - x.mean(-1, keepdim=True)
    return torch.sqrt(x.pow(2).mean(-1) + eps)


class ScaleAnchorLoss(nn.Module):
    """Fixed-target scale anchoring (eq. 5): λ · E_{b,t}[(s(h_bt) − s_tgt)²] over non-padding tokens, s = σ_h
    when the model's norms are `centered` (LayerNorm), else r(h).

    During warm-up it tracks an EMA of the batch-mean scale; `freeze()` (taper start) fixes s_tgt to the
    bias-corrected EMA. The loss is zero until the target is frozen: before that there is no target.
    """

    # buffers (register_buffer), declared for the type checker
    ema: torch.Tensor
    ema_count: torch.Tensor
    target: torch.Tensor
    frozen: torch.Tensor

    def __init__(self, *, centered: bool, weight: float = 0.1, eps: float = 1e-6, momentum: float = 0.01):
        super().__init__()
        self.centered, self.weight, self.eps, self.momentum = centered, weight, eps, momentum
        self.register_buffer("ema", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("ema_count", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("target", torch.tensor(0.0))
        self.register_buffer("frozen", torch.tensor(False))

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None, track: bool = False) -> torch.Tensor:
        s = token_scale(h, self.centered, self.eps)
        keep = torch.ones_like(s, dtype=torch.bool) if mask is None else mask.bool()
        if track and not bool(self.frozen):
            with torch.no_grad():
                batch_mean = s[keep].mean().double()
                self.ema.mul_(1 - self.momentum).add_(self.momentum * batch_mean)
                self.ema_count += 1
        if not bool(self.frozen):
            return h.new_zeros((), dtype=torch.float32)
        return self.weight * (s[keep] - self.target).pow(2).mean()

    @torch.no_grad()
    def freeze(self) -> float:
        self.target.fill_(float(bias_corrected(self.ema, self.ema_count, self.momentum)))
        self.frozen.fill_(True)
        return float(self.target)
