"""Norm kinds, one module each: what a kind of normalization is in torch, what it becomes at g = 0, and
how it shows in an exported graph. Everything else asks this registry instead of naming a kind.

    rms   RMSNorm: h / r(h) · diag(γ)                 tapered by TaperNorm (eq. 3)   g = 0: h · diag(s)
    ln    LayerNorm: (h − μ_h) / σ_h · diag(γ) + β     tapered by TaperLN (eq. 6)     g = 0: (h − μ_h) · diag(s) + β
    dyt   DyT (Zhu et al. 2025): tanh(αh) · diag(γ) + β, no statistics and no gate: γ, β fold, tanh(αh) stays

with s = c·γ̃ (c·(1 + γ̃) for Gemma's gain offset). A kind gives:
- torch: the tapered module, torch's fused module (the benchmark baseline's norm), the same norm written
  as element-wise ops (the `baseline-decomposed` variant), and the class names its modules have in any
  model (LlamaRMSNorm, OlmoLayerNorm, ...);
- its g = 0 map (`constant_map`): what a fold moves into the linear layers that read the norm, and what stays
  in the norm's place (`residue`: nothing, or DyT's tanh(αh));
- its served form (`served`): the module a served model (taperfold.serving, `export --vllm`) puts in the norm's place,
  folded or kept whole, whose parameters are what the served checkpoint holds of the norm;
- its ONNX pattern, which taperfold.passes.detect reads: at g = 0, [ReduceMean → Sub when `centered`, or the
  `elementwise` op of a scalar multiple of the input] → Muls by constants (c, γ̃) → [Add β when `shift`]; a
  real norm of a kind with statistics divides by a root-mean statistic of its (centred) input, or is one of
  its `fused_ops`.

Adding a kind is one module here plus its name in `_MODULES`; docs/extending.md walks through it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from taperfold.nn import Gating, ServedNorm, TaperedNorm, without_norm


@dataclass(frozen=True)
class ConstantMap:
    """A norm at g = 0, as a fold needs it: y = (h − mean(h) if `centered` else h) · diag(scale) + bias."""

    scale: torch.Tensor  # float64 [d]
    bias: torch.Tensor | None  # float64 [d], or None
    centered: bool

    def joined(self, heads: int) -> ConstantMap:
        """The map on `heads` of its rows joined into one ([heads·d]: a per-head norm read with its heads joined):
        scale and bias repeated. A centering is per row, which a joined row does not say: refused."""
        if self.centered:
            raise ValueError("a centered norm's map does not carry over to its rows joined")
        bias = None if self.bias is None else self.bias.repeat(heads)
        return ConstantMap(self.scale.repeat(heads), bias, False)


@dataclass(frozen=True)
class NormKind:
    name: str  # how reports, manifests and families spell it
    title: str
    tapered: type[nn.Module]  # the tapered torch module: (dim, gate, eps, momentum, delta[, gain_offset])
    plain: type[nn.Module]  # torch's fused norm: (dim, eps)
    hand_written: Callable[[Any], nn.Module]  # the plain norm as element-wise ops: (the `plain` module)
    class_names: Callable[[str], bool]  # whether a norm class of any model (by name) is of this kind
    centered: bool  # subtracts the mean first: a fold absorbs it as (I − 11ᵀ/d); s(h) of eq. 5 is σ_h, not r(h)
    shift: bool  # adds a bias β after the gain
    # fused ONNX ops of the kind: op type -> (index of its scale input, index of its bias input or None)
    fused_ops: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    gain_offset_allowed: bool = False  # the tapered module can compute x·(offset + γ) (Gemma)
    # Trained through the gate schedule: its module has c, γ̃ and calibration EMAs, and a real norm of the kind
    # computes per-token statistics. DyT has neither: it is foldable from the first step.
    gated: bool = True
    # The per-element op the kind keeps in front of its gain, applied to a scalar multiple of the input
    # (DyT: "Tanh" of αh); None when the gain reads the (centred) input itself.
    elementwise: str | None = None
    folded_note: str = ""  # what a fold report adds to "folded" for a norm of the kind
    # the tapered module of a gated norm of the kind (forward(x, z), taperfold.nn.Gating), or None: it has none
    tapered_with_gate: type[nn.Module] | None = None

    def residue(self, norm: nn.Module) -> nn.Module:
        """What stays in the norm's place once its constant map has moved into the layers around it: nothing, or
        a gated norm's gate."""
        return without_norm(norm)

    def served(self, width: int, folded: bool) -> ServedNorm:
        """The module a served model (taperfold.serving) puts in place of a norm of the kind `width` features wide,
        made before the checkpoint's weights are loaded into it: its parameters are the tensors the checkpoint holds of
        the norm, under the norm's path and the tapered module's names. `folded`: the norm's constant map is in the
        layers reading it; else the norm is kept whole. A gated kind at g = 0 folds whole, leaving the residual add; it
        is never kept, since no serving engine computes a tapered norm. ValueError: the kind has no such form."""
        if not folded:
            raise ValueError(f"a tapered {self.title} is served folded only (no serving engine computes it)")
        if self.elementwise is not None:
            raise ValueError(f"taperfold has no served form of a folded {self.title} (it keeps its {self.elementwise})")
        return ServedNorm()

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
        if gain_offset and not self.gain_offset_allowed:
            raise ValueError(f"a {self.title} has no gain offset (got {gain_offset:g})")
        extra: dict[str, Any] = {"gain_offset": gain_offset} if self.gain_offset_allowed else {}
        if gating is None:
            return self.tapered(dim, gate, eps, momentum, delta, **extra)
        if self.tapered_with_gate is None:
            raise ValueError(f"taperfold has no tapered {self.title} with a gate input")
        return self.tapered_with_gate(dim, gate, eps, momentum, delta, **extra, gating=gating)

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
        """A tapered copy of a model's norm module, with its γ (and β) and on its device and dtype. A norm without
        a weight (OLMo's LayerNorm) computes what γ = 1, β = 0 do: the tapered copy starts there. `gating`: how the
        norm applies its gate input, for a gated norm."""
        weight = getattr(norm, "weight", None)
        if weight is None:
            shape = tuple(getattr(norm, "normalized_shape", ()))
            if len(shape) != 1:
                raise ValueError(f"{type(norm).__name__}: a norm with neither a weight nor a 1-D normalized_shape")
            weight = torch.ones(shape)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise ValueError(f"{type(norm).__name__}: a norm without a per-feature weight cannot be tapered")
        new = self.new_tapered(weight.shape[0], gate, eps, momentum, delta, gain_offset, gating)
        new = new.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            new.get_parameter("weight").copy_(weight)
            new.get_parameter("weight_tilde").copy_(weight)
            bias = getattr(norm, "bias", None)
            if self.shift and isinstance(bias, torch.Tensor):
                new.get_parameter("bias").copy_(bias)
        return new

    def constant_map(self, norm: nn.Module) -> ConstantMap:
        """The map a tapered norm computes at g = 0, in float64: what a fold moves into its readers."""
        if not isinstance(norm, TaperedNorm):
            raise TypeError(f"{type(norm).__name__} is not a tapered norm with a gate (TaperNorm, TaperLN)")
        scale = norm.c.double() * norm.gain(norm.weight_tilde.double())
        bias = norm.get_parameter("bias").double() if self.shift else None
        return ConstantMap(scale, bias, self.centered)


# The kinds taperfold ships, one module each. Order matters to detect: a kind whose ONNX pattern extends
# another's (DyT: a tanh, then an RMS-like chain; LayerNorm: a centering, then one) comes first.
_MODULES = ("dyt", "ln", "rms")
_KINDS: dict[str, NormKind] = {}


def _load_shipped() -> None:
    if not _KINDS:
        for name in _MODULES:
            kind = importlib.import_module(f"{__name__}.{name}").KIND
            _KINDS[kind.name] = kind


def register(kind: NormKind, before: str | None = None) -> NormKind:
    """Make `kind` known (a kind of the same name is replaced). Detect tries kinds in order: a kind whose ONNX
    pattern is a special case of another's goes `before` it (DyT's tanh, then RMS's chain, before "rms")."""
    _load_shipped()
    _KINDS.pop(kind.name, None)
    names = list(_KINDS)
    at = names.index(before) if before in names else len(names)
    kinds = [*(_KINDS[n] for n in names[:at]), kind, *(_KINDS[n] for n in names[at:])]
    _KINDS.clear()
    _KINDS.update((k.name, k) for k in kinds)
    return kind


def norm_kinds() -> list[NormKind]:
    """Every kind, in the order detect tries their patterns."""
    _load_shipped()
    return list(_KINDS.values())


def norm_kind(name: str) -> NormKind:
    kinds = {k.name: k for k in norm_kinds()}
    if name not in kinds:
        raise ValueError(f"norm kind must be one of {', '.join(kinds)}, got {name!r}")
    return kinds[name]


def tapered_kind(module: nn.Module) -> NormKind | None:
    """The kind of a tapered norm module, or None when `module` is not one."""
    return next((k for k in norm_kinds() if isinstance(module, k.tapered)), None)


def plain_kind(module: nn.Module) -> NormKind | None:
    """The kind of torch's fused norm module (nn.RMSNorm, nn.LayerNorm), or None."""
    return next((k for k in norm_kinds() if type(module) is k.plain), None)


def tapered_kind_of_class(name: str) -> NormKind | None:
    """The kind whose tapered module class is called `name` (TaperNorm, GatedTaperNorm, TaperLN), or None."""
    return next((k for k in norm_kinds() if name in _tapered_class_names(k)), None)


def kind_of_class(name: str) -> NormKind | None:
    """The kind of a norm module class of any model, by its name (LlamaRMSNorm, LayerNorm, TaperLN, ...)."""
    return next((k for k in norm_kinds() if name in _tapered_class_names(k) or k.class_names(name)), None)


def _tapered_class_names(kind: NormKind) -> set[str]:
    return {c.__name__ for c in (kind.tapered, kind.tapered_with_gate) if c is not None}


def is_norm_module(module: nn.Module) -> bool:
    return kind_of_class(type(module).__name__) is not None
