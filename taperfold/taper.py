"""Taper a model in place: the norms its family names become tapered norms sharing one gate.

Works on any module tree a family describes (taperfold.families): taperfold's own models (built with
plain norms, then tapered here) and transformers' models alike. Module paths and γ (β) are kept, so a
state dict keeps its names and gains `weight_tilde`, `c` and the calibration buffers next to each tapered
norm's `weight`. The result is attached to the tree as `tapering`: which norms were tapered, which modules
read each (what a fold rewrites), which norm-like modules were left alone and why, the gate, and the
scale-anchoring loss.
"""

from __future__ import annotations

import abc
from collections.abc import Sized
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from taperfold.errors import TaperfoldError
from taperfold.families import Family
from taperfold.nn import GateSchedule, ScaleAnchorLoss, TaperedNorm, TaperGate
from taperfold.norms import NormKind, is_norm_module, norm_kind, tapered_kind

TAPERS = ("internal", "all")  # internal: every norm but the final one (the paper's default); all: that one too
FINAL_KEPT = "the final norm (kept as the scale anchor; taper='all' tapers it)"


@dataclass
class Tapering:
    """What `taper_model` did to a model, attached to it as `model.tapering`."""

    family: Family
    taper: str
    kind_name: str  # the norm kind now in the norms' places: the family's own, tapered, or one replacing it (DyT)
    gate: TaperGate
    norms: dict[str, nn.Module]  # module path -> tapered norm
    readers: dict[str, list[str]]  # module path -> reader module paths (what a forward fold rewrites)
    producers: dict[str, str] = field(default_factory=dict)  # post-norm path -> producer path (a backward fold's)
    untapered: dict[str, str] = field(default_factory=dict)  # module path -> why it is left alone
    scale_loss: ScaleAnchorLoss | None = None

    @property
    def kind(self) -> NormKind:
        return norm_kind(self.kind_name)

    def folds_into(self, path: str) -> list[str]:
        """Where the tapered norm at `path` folds: its readers, or the producer of a post-norm ([] for a post-norm
        of a kind that keeps an element-wise op: DyT's γ, β sit after its tanh, out of the producer's reach)."""
        if path in self.readers:
            return self.readers[path]
        return [self.producers[path]] if path in self.producers else []

    def set_gate(self, value: float, calibrating: bool = False) -> None:
        self.gate.value, self.gate.calibrating = float(value), calibrating

    def start_taper(self) -> dict[str, float]:
        """Taper start: every tapered norm freezes c ← c* and copies γ → γ̃; the scale target is frozen. A kind
        without a gate has nothing to calibrate."""
        cs = {name: norm.calibrate() for name, norm in self.norms.items() if isinstance(norm, TaperedNorm)}
        if self.scale_loss is not None:
            self.scale_loss.freeze()
        return cs

    @property
    def calibrated(self) -> bool:
        """Whether every tapered norm has its c (a kind without a gate has nothing to calibrate)."""
        return not self.kind.gated or all(bool(norm.calibrated) for norm in self.norms.values())


class GateDriver:
    """Drives a tapering's gate along a schedule from any training loop: `step(k)` before step k's forward
    (gate 1 and calibrating through warm-up; at taper start c and the scale target freeze), `finish(steps)`
    after the last step (the gate is exactly 0 once the schedule has ended)."""

    def __init__(self, tapering: Tapering, schedule: GateSchedule):
        self.tapering, self.schedule = tapering, schedule
        self.started = tapering.calibrated

    def step(self, step: int) -> float:
        if step >= self.schedule.taper_start and not self.started:
            self.tapering.start_taper()
            self.started = True
        gate = self.schedule(step)
        self.tapering.set_gate(gate, calibrating=step < self.schedule.taper_start)
        return gate

    def finish(self, steps: int) -> float:
        gate = self.schedule(steps)
        self.tapering.set_gate(gate)
        return gate


class ModelShape(Protocol):
    """A model's shape as every tool reads it (taperfold.models.ModelConfig, taperfold.hf.model.HFModelInfo)."""

    @property
    def arch(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def taper(self) -> str: ...
    @property
    def norm_kind(self) -> str: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def aux(self) -> bool: ...
    @property
    def tokenizer(self) -> str: ...
    def to_dict(self) -> dict: ...


class TaperedLM(nn.Module, abc.ABC):
    """The taper's side of every model taperfold runs (taperfold.models.CausalLM, taperfold.hf.model.HFCausalLM).

    Such a model also has `cfg` (its shape), `forward(input_ids, logits="last"|"all", past_key_values=None,
    use_cache=False)` (and `cache_position=` where `static_cache`), `loss`, `copy` and `network`: the module tree
    its family's paths name, to which `taper_model` attaches the tapering (None on a plain model).
    """

    cfg: ModelShape
    kept_norms: dict[str, str]  # after fold_in_torch: the norms it left, each with the reason
    network_path = ""  # where `network` sits in the model, as module paths spell it ("": the model itself)

    @property
    @abc.abstractmethod
    def network(self) -> nn.Module:
        """The module tree the family's paths name."""

    @property
    def tapering(self) -> Tapering | None:
        """What `taper_model` attached to `network` (None on a plain model)."""
        return getattr(self.network, "tapering", None)

    @property
    def static_cache(self) -> bool:
        """Whether forward takes `cache_position` and a static cache (taperfold.models.base)."""
        return False

    @property
    def kv_cache(self) -> bool:
        """Whether every layer's cache is its keys and values, all the KV-cached decoders carry (a hybrid's linear
        attention or Mamba layers keep recurrent states instead)."""
        return True

    def eager_attention(self) -> AbstractContextManager[None] | None:
        """A context in which attention runs as its plain MatMul and Softmax, for an exporter that fails on the
        fused form the model runs by default; None where the model has no other form."""
        return None

    @abc.abstractmethod
    def copy(self, shared: bool = False) -> TaperedLM:
        """A deep copy; `shared`: the modules copied, the parameters the same objects (see shared_parameters)."""

    @abc.abstractmethod
    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy on next-token `targets`, the scale-anchoring loss)."""

    @property
    def layers_path(self) -> str | None:
        """Module path of the list of decoder layers (None: unknown, and export traces every layer)."""
        return None

    def layer_types(self) -> list[str] | None:
        """Each layer's kind where the model's config names one (transformers' `layer_types`), else None."""
        return None

    def with_first_layers(self, count: int) -> TaperedLM:
        """A copy that runs its first `count` layers only, its modules copied and its weights shared (export's
        two-layer trace, taperfold.layer_trace)."""
        assert self.layers_path is not None
        model = self.copy(shared=True)
        parent, _, name = self.layers_path.rpartition(".")
        holder = model.get_submodule(parent)
        setattr(holder, name, nn.ModuleList(list(getattr(holder, name))[:count]))
        model._count_layers(count)
        return model

    def _count_layers(self, count: int) -> None:
        """Say in the model's config that it has `count` layers (with_first_layers cut the list)."""
        raise NotImplementedError

    @property
    def gate(self) -> TaperGate:
        """The shared gate; a plain model computes its norms, as a tapered one at g = 1."""
        return self.tapering.gate if self.tapering is not None else TaperGate(1.0)

    def set_gate(self, value: float, calibrating: bool = False) -> None:
        if self.tapering is not None:
            self.tapering.set_gate(value, calibrating)

    def tapered_norms(self) -> dict[str, nn.Module]:
        return dict(self.tapering.norms) if self.tapering is not None else {}

    def forget_tapering(self) -> None:
        """After a fold: the model has no tapered norm left to drive."""
        object.__setattr__(self.network, "tapering", None)


def shared_parameters(module: nn.Module) -> dict[int, nn.Parameter]:
    """A `copy.deepcopy` memo under which a copy of `module` holds `module`'s parameters themselves (no weight
    copied): for a variant that replaces modules, or gives a parameter it changes a copy of its own first. Casting
    or moving either model then casts or moves the shared parameters of both."""
    return {id(p): p for _, p in module.named_parameters(remove_duplicate=False)}


def norm_eps(module: nn.Module, family: Family) -> float:
    """The epsilon a norm module uses (its attribute names differ by family; a family whose norms hard-code it
    says it)."""
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    if family.norm_eps is not None:
        return family.norm_eps
    raise TaperfoldError(
        f"{type(module).__name__}: no epsilon attribute (eps / variance_epsilon) to copy, and "
        f"family {family.name} states none"
    )


def linear_widths(module: nn.Module | nn.Parameter, in_out: bool = False) -> tuple[int, int]:
    """(input, output) features of a linear layer: nn.Linear stores its weight [out, in], GPT-2's Conv1D [in, out];
    a weight named by itself is F.linear's, [..., out, in] (a stack: MoE experts, one matrix each), or [..., in, out]
    where `in_out` (see `stored_in_out`)."""
    if isinstance(module, nn.Parameter):
        return (module.shape[-2], module.shape[-1]) if in_out else (module.shape[-1], module.shape[-2])
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    rows, cols = module.get_parameter("weight").shape
    return rows, cols


def layer_count(network: nn.Module, family: Family) -> int:
    """The number of blocks in the list the family names (`family.layers`)."""
    layers = network.get_submodule(family.layers)
    if not isinstance(layers, Sized):
        raise TaperfoldError(
            f"{family.layers} is a {type(layers).__name__}, not the list of layers family {family.name} names"
        )
    return len(layers)


def fold_target(model: nn.Module, path: str) -> nn.Module | nn.Parameter:
    """The layer a family names at `path`: a module, or a weight applied with F.linear (a router's, the experts')."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return model.get_parameter(path)


def stored_in_out(model: nn.Module, path: str, width: int | None = None) -> bool:
    """Whether the bare weight at `path`, read by a norm of `width` channels, is a stack of [in, out] matrices, where
    F.linear's are [out, in]: MoE experts whose module says so with transformers' own flag
    (`@use_experts_implementation(is_transposed=True)`: gpt-oss), or whose shape can be read no other way (Llama 4's
    experts: [experts, width, n] with n ≠ width; a square stack without the flag is read as F.linear's, and the
    trace reads no such stack as [in, out])."""
    owner, _, name = path.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    if getattr(module, "is_transposed", False) is True:
        return True
    weight = getattr(module, name, None)
    return (
        width is not None
        and isinstance(weight, torch.Tensor)
        and weight.dim() >= 3
        and weight.shape[-2] == width != weight.shape[-1]
    )


def _linear(model: nn.Module, path: str, family: Family, where: str) -> nn.Module | nn.Parameter:
    try:
        module = fold_target(model, path)
    except AttributeError:
        raise TaperfoldError(f"{where}: {family.name} model has no module {path!r}") from None
    if isinstance(module, nn.Parameter):
        linear = module.dim() >= 2
    else:
        weight = getattr(module, "weight", None)
        linear = isinstance(weight, torch.Tensor) and weight.dim() == 2
    if not linear:
        raise TaperfoldError(
            f"{where}: {path} is a {type(module).__name__}, not a linear layer a norm folds into (family {family.name})"
        )
    return module


def _check_fold_targets(
    model: nn.Module, family: Family, path: str, dim: int, readers: list[str], producer: str | None, where: str
) -> None:
    """The family's readers (or producer) of the norm at `path` exist, are linear layers, and take (give) its width."""
    heads = family.heads_of(path)
    for reader in readers:
        width = linear_widths(_linear(model, reader, family, where), stored_in_out(model, reader, dim * heads))[0]
        if width != dim * heads:
            gives = f"{dim}" if heads == 1 else f"{dim} per head, {dim * heads} for the {heads} heads its readers join"
            raise TaperfoldError(
                f"{where}: {reader} takes {width} features, but {path} gives {gives} "
                f"(family {family.name} says it reads {path})"
            )
    if producer is not None:
        width = linear_widths(_linear(model, producer, family, where))[1]
        if width != dim:
            raise TaperfoldError(
                f"{where}: {producer} gives {width} features, but {path} takes {dim} "
                f"(family {family.name} says it produces the input of {path})"
            )


def taper_model(
    model: nn.Module,
    family: Family,
    taper: str = "internal",
    *,
    kind: str | None = None,
    aux: bool = True,
    aux_weight: float = 0.1,
    momentum: float = 0.1,
    delta: float = 1e-8,
    gate: float = 1.0,
    where: str = "model",
) -> Tapering:
    """Replace the norms `family` names in `model` by tapered ones, in place; return what was done (also
    attached as `model.tapering`, a plain attribute, so the state dict keeps exactly the model's names).

    `kind`: the norm kind to put there, the family's own by default; a kind without a gate (DyT) replaces
    the norms instead, is foldable at once (the gate is 0) and has no scale-anchoring loss.
    `aux`: the fixed-target scale anchoring loss (eq. 5) on the final norm's input. `momentum`: μ of the
    calibration EMAs. `gate`: the initial gate value.
    """
    if taper not in TAPERS:
        raise TaperfoldError(f"taper must be one of {TAPERS}, got {taper!r}")
    if getattr(model, "tapering", None) is not None:
        raise TaperfoldError(f"{where}: already tapered")
    try:
        new_kind = norm_kind(kind or family.norm)
    except ValueError as e:
        raise TaperfoldError(f"{where}: {e}") from None
    if new_kind.gated and new_kind.name != family.norm:
        raise TaperfoldError(
            f"{where}: {family.name}'s norms taper as {family.norm}, not {new_kind.name}; only a kind "
            "without a gate (dyt) takes their place"
        )
    if not new_kind.gated:
        aux, gate = False, 0.0
    shared = TaperGate(gate)
    n_layers = layer_count(model, family)
    readers = family.norm_readers(n_layers, taper)
    producers = family.norm_producers(n_layers) if new_kind.elementwise is None else {}
    norms: dict[str, nn.Module] = {}
    without_gate_input: dict[str, str] = {}  # gated norms the kind has no tapered form for -> why
    for path in family.norm_paths(n_layers, taper):
        try:
            original = model.get_submodule(path)
        except AttributeError:
            raise TaperfoldError(f"{where}: {family.name} model has no module {path!r}") from None
        gating = family.gating_of(path)
        if gating is not None and new_kind.tapered_with_gate is None:
            without_gate_input[path] = f"a gated norm, and a {new_kind.title} has no form with a gate input"
            readers.pop(path, None)
            producers.pop(path, None)
            continue
        try:
            norms[path] = new_kind.taper(
                original, shared, norm_eps(original, family), momentum, delta, family.gain_offset_of(path), gating
            )
        except ValueError as e:
            raise TaperfoldError(f"{where}: {path}: {e}") from None
        width = len(norms[path].get_parameter("weight"))  # γ: one per feature
        _check_fold_targets(model, family, path, width, readers.get(path, []), producers.get(path), where)
    for path, norm in norms.items():  # swapped in only once every norm and its layers were checked
        model.set_submodule(path, norm)
    untapered: dict[str, str] = dict(without_gate_input)
    for name, module in model.named_modules():
        if name in norms or name in untapered or tapered_kind(module) is not None or not is_norm_module(module):
            continue
        if name == family.final:  # first: a family's reason for a layer's module of the same name ("norm") is not its
            untapered[name] = FINAL_KEPT
            continue
        untapered[name] = family.untapered_reason(name) or "not read by a linear layer taperfold knows of"
    scale_loss = None
    if aux:
        scale_loss = ScaleAnchorLoss(
            centered=new_kind.centered,
            weight=aux_weight,
            eps=norm_eps(model.get_submodule(family.final), family),
            momentum=momentum,
        )
    tapering = Tapering(family, taper, new_kind.name, shared, norms, readers, producers, untapered, scale_loss)
    object.__setattr__(model, "tapering", tapering)
    return tapering
