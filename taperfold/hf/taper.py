"""Taper a transformers causal LM in place: its norms become TaperNorm / TaperLN sharing one gate.

`taper_model(model, "internal")` replaces the norms before attention and the MLP; `"all"` also the
final norm. Module paths and γ (β) are kept, so the state dict keeps Hugging Face's names and gains
`weight_tilde`, `c` and the calibration buffers next to each tapered norm's `weight`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from taperfold.errors import TaperfoldError
from taperfold.hf.families import Family, family_for
from taperfold.nn import ScaleAnchorLoss, TaperGate, TaperLN, TaperNorm

TAPERS = ("internal", "all")
TAPERED = (TaperNorm, TaperLN)


@dataclass
class Tapering:
    """What `taper_model` did to a model, attached to it as `model.tapering`."""

    family: Family
    taper: str
    gate: TaperGate
    norms: dict[str, nn.Module]  # module path -> TaperNorm | TaperLN
    readers: dict[str, list[str]]  # module path -> reader module paths (what a fold rewrites)
    untapered: dict[str, str] = field(default_factory=dict)  # module path -> why it is left alone
    scale_loss: ScaleAnchorLoss | None = None

    def set_gate(self, value: float, calibrating: bool = False) -> None:
        self.gate.value, self.gate.calibrating = float(value), calibrating

    def start_taper(self) -> dict[str, float]:
        """Taper start: every tapered norm freezes c ← c* and copies γ → γ̃; the scale target is frozen."""
        cs = {name: norm.calibrate() for name, norm in self.norms.items()}
        if self.scale_loss is not None:
            self.scale_loss.freeze()
        return cs


def norm_eps(module: nn.Module) -> float:
    """The epsilon a transformers norm module uses (its attribute names differ by family)."""
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise TaperfoldError(f"{type(module).__name__}: no epsilon attribute (eps / variance_epsilon) to copy")


def n_layers_of(model: nn.Module, family: Family) -> int:
    return len(model.get_submodule(family.layers))


def norm_paths(model: nn.Module, family: Family, taper: str) -> dict[str, list[str]]:
    """The norms `taper` covers, each with the module paths that read it."""
    paths = family.internal_norms(n_layers_of(model, family))
    if taper == "all":
        head = "lm_head" if hasattr(model, "lm_head") else _head_path(model)
        paths[family.final] = [head]
    return paths


def _head_path(model: nn.Module) -> str:
    head = model.get_output_embeddings()
    return next(name for name, module in model.named_modules() if module is head)


def _tapered_copy(norm: nn.Module, family: Family, gate: TaperGate, momentum: float, delta: float) -> nn.Module:
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise TaperfoldError(f"{type(norm).__name__}: a norm without a per-feature weight cannot be tapered")
    dim, eps = weight.shape[0], norm_eps(norm)
    if family.norm == "rms":
        new = TaperNorm(dim, gate, eps, momentum, delta, gain_offset=family.gain_offset)
    else:
        new = TaperLN(dim, gate, eps, momentum, delta)
    new = new.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        new.weight_tilde.copy_(weight)
        bias = getattr(norm, "bias", None)
        if isinstance(new, TaperLN) and isinstance(bias, torch.Tensor):
            new.bias.copy_(bias)
    return new


def _check(model: nn.Module, family: Family, where: str) -> None:
    why_not = family.check(model.config)
    if why_not:
        raise TaperfoldError(f"{where}: {why_not}")


def taper_model(model: nn.Module, taper: str = "internal", *, aux: bool = True, aux_weight: float = 0.1,
                momentum: float = 0.1, delta: float = 1e-8, gate: float = 1.0, where: str = "model") -> Tapering:
    """Replace `model`'s norms with tapered ones in place and return what was done (also `model.tapering`).

    `aux`: the fixed-target scale anchoring loss (eq. 5) on the final norm's input, added to the loss the
    model returns while the target is frozen (see taperfold.hf.training). `momentum`: μ of the calibration
    EMAs (the paper's GPT-2 fine-tuning uses 0.1). `gate`: the initial gate value.
    """
    if taper not in TAPERS:
        raise TaperfoldError(f"taper must be one of {TAPERS}, got {taper!r}")
    if getattr(model, "tapering", None) is not None:
        raise TaperfoldError(f"{where}: already tapered")
    family = family_for(getattr(model.config, "model_type", None), where)
    _check(model, family, where)
    shared = TaperGate(gate)
    readers = norm_paths(model, family, taper)
    norms = {}
    for path in readers:
        try:
            original = model.get_submodule(path)
        except AttributeError:
            raise TaperfoldError(f"{where}: {family.name} model has no module {path!r}") from None
        norms[path] = _tapered_copy(original, family, shared, momentum, delta)
        model.set_submodule(path, norms[path])
    untapered = {}
    for name, module in model.named_modules():
        if name in norms or isinstance(module, TAPERED) or "norm" not in type(module).__name__.lower():
            continue
        leaf = name.rpartition(".")[2]
        if leaf in family.untapered:
            untapered[name] = family.untapered[leaf]
        elif name == family.final:
            untapered[name] = "the final norm (kept as the scale anchor; taper='all' tapers it)"
        else:
            untapered[name] = "not read by a linear layer taperfold knows of"
    scale_loss = None
    if aux:
        eps = norm_eps(model.get_submodule(family.final))
        scale_loss = ScaleAnchorLoss(family.norm, aux_weight, eps, momentum)
    tapering = Tapering(family, taper, shared, norms, readers, untapered, scale_loss)
    # A plain attribute, not a submodule: the state dict keeps exactly Hugging Face's names.
    object.__setattr__(model, "tapering", tapering)
    return tapering


def tapering_of(model: nn.Module) -> Tapering:
    tapering = getattr(model, "tapering", None)
    if tapering is None:
        raise TaperfoldError("the model is not tapered: call taperfold.hf.taper_model(model) first")
    return tapering
