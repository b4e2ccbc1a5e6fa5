"""The benchmark's variants of one model source, built in PyTorch, and the torch-level fold.

    baseline             the source's own untapered norms, same weights (taperfold's models: nn.RMSNorm /
                         nn.LayerNorm, whose forward is the fused op)
    unfolded             the tapered model at g = 0: each tapered norm a constant map
    folded               `fold_in_torch`: those maps moved into the layers that read them; the norms gone
    baseline-decomposed  the baseline with its fused norms written as element-wise ops (the kind's hand-written form)
    nonorm               the tapered norms deleted, weights unscaled: what a fold with zero residue matches

One fold for every model: the family says which layers read each norm (or, for a post-norm, which layer
produces its input), the norm kind what the norm computes at g = 0 (taperfold.norms.ConstantMap); the ONNX
passes do the same on graphs (taperfold.passes: forwards, then post-norms backwards).

With `fuse_projections`, every variant's sibling linear layers (the readers the family lists for one norm: q/k/v,
gate/up) run as one layer on their concatenated weights (`fuse_projections_in_torch`), as
passes/fuse_projections.py does in the exported graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

from taperfold.exportdir import BASELINE, DECOMPOSED_BASELINE, FOLDED, NONORM, UNFOLDED
from taperfold.families import Family
from taperfold.nn import without_norm
from taperfold.norms import ConstantMap, plain_kind
from taperfold.taper import TaperedLM, fold_target, layer_count, stored_in_out

if TYPE_CHECKING:
    from taperfold.sources import ModelSource

# The concatenations FusedProjection made, by the tensors they join: (those tensors, kept alive; weight; bias).
JoinedProjections = dict[
    tuple, tuple[list[tuple[torch.Tensor, torch.Tensor | None]], nn.Parameter, nn.Parameter | None]
]


def _bias(layer: nn.Module) -> torch.Tensor | None:
    """A linear layer's bias; None when it has none (nn.Linear(bias=False) holds None)."""
    bias = getattr(layer, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


@dataclass
class Write:
    """One tensor the fold writes: computed in float64 from the stored weights, cast once when written. `into` is
    the parameter rewritten in place, or None for a bias the layer `owner` does not have yet."""

    what: str  # "weight" or "bias", for the reason a norm is kept
    value: torch.Tensor  # float64
    dtype: torch.dtype
    into: torch.Tensor | None = None
    owner: nn.Module | None = None

    def past_range(self, stored: torch.dtype | None = None) -> str | None:
        """Why the value cannot be written in its dtype (or `stored`, where it is cast later): it would be Inf there;
        None where it fits."""
        stored = stored or self.dtype
        limit = torch.finfo(stored).max
        reach = float(self.value.abs().max()) if self.value.numel() else 0.0
        if reach > limit:
            dtype = str(stored).removeprefix("torch.")
            return f"the folded {self.what} would reach {reach:.3g}, past {dtype}'s range (±{limit:.4g})"
        return None

    def apply(self) -> None:
        if self.into is None:
            assert self.owner is not None
            self.owner.bias = nn.Parameter(self.value.to(self.dtype))
        else:
            self.into.copy_(self.value.to(self.into.dtype))


def reader_writes(reader: nn.Module | nn.Parameter, folded: ConstantMap, in_out: bool = False) -> list[Write]:
    """y = ((h − μ)·diag(s) + β) W + b  →  h W' + b'  with W' = (I − 11ᵀ/d) diag(s) W, b' = b + β W, in float64
    from the stored weight. `reader`: an nn.Linear ([out, in]), a GPT-2 style Conv1D ([in, out]), or a weight
    F.linear applies ([..., out, in]: a router's, or MoE experts' stacked matrices, each folded alike; [..., in, out]
    where `in_out`: gpt-oss's experts)."""
    if isinstance(reader, nn.Parameter):
        if folded.bias is not None:  # fold_in_torch keeps such a norm
            raise ValueError("a shifted norm (LayerNorm β) folds into a layer with a bias, and a bare weight has none")
        w = reader.double() if in_out else reader.double().transpose(-1, -2)  # as [..., in, out]
        w = folded.scale[:, None] * w
        w = w - w.mean(dim=-2, keepdim=True) if folded.centered else w
        return [Write("weight", w if in_out else w.transpose(-1, -2), reader.dtype, reader)]
    conv = not isinstance(reader, nn.Linear)
    weight = reader.get_parameter("weight")
    w = weight.double() if conv else weight.double().T  # as [in, out]
    new_w = folded.scale[:, None] * w
    if folded.centered:
        new_w = new_w - new_w.mean(dim=0, keepdim=True)
    writes = [Write("weight", new_w if conv else new_w.T, weight.dtype, weight)]
    if folded.bias is not None:
        shift = folded.bias @ w
        bias = _bias(reader)
        if bias is None:
            writes.append(Write("bias", shift, weight.dtype, owner=reader))
        else:
            writes.append(Write("bias", bias.double() + shift, bias.dtype, bias))
    return writes


def producer_writes(producer: nn.Module, folded: ConstantMap) -> list[Write]:
    """z = h W + b, then (z − μ_z)·diag(s) + β  →  h W' + b'  with W' = W (I − 11ᵀ/d) diag(s),
    b' = (b − mean(b))·s + β: the post-norm's map moves into the producer's output columns (float64)."""
    conv = not isinstance(producer, nn.Linear)
    weight, bias = producer.get_parameter("weight"), _bias(producer)
    w = weight.double() if conv else weight.double().T  # as [in, out]
    b = bias.double() if bias is not None else torch.zeros(w.shape[1], dtype=torch.float64, device=w.device)
    if folded.centered:
        w, b = w - w.mean(dim=1, keepdim=True), b - b.mean()
    new_w, new_b = w * folded.scale[None, :], b * folded.scale
    if folded.bias is not None:
        new_b = new_b + folded.bias
    writes = [Write("weight", new_w if conv else new_w.T, weight.dtype, weight)]
    if bias is not None:
        writes.append(Write("bias", new_b, bias.dtype, bias))
    elif folded.centered or folded.bias is not None:
        writes.append(Write("bias", new_b, weight.dtype, owner=producer))
    return writes


def _shares_weight(network: nn.Module, path: str, weight: torch.Tensor) -> bool:
    """Whether a module other than the one at `path` holds `weight` too (a head tied to the embedding)."""
    return any(
        p is weight and not name.startswith(path + ".") for name, p in network.named_parameters(remove_duplicate=False)
    )


def _own_tensors(network: nn.Module, path: str, layer: nn.Module | nn.Parameter) -> nn.Module | nn.Parameter:
    """`layer` (the module or bare weight at `path`) given its own copies of the tensors a fold rewrites in place, so
    that the model the folded copy shares its other parameters with stays as it was (a tied embedding too)."""
    if isinstance(layer, nn.Parameter):
        owner, _, name = path.rpartition(".")
        own = nn.Parameter(layer.detach().clone(), requires_grad=layer.requires_grad)
        setattr(network.get_submodule(owner), name, own)
        return own
    for name in ("weight", "bias"):
        if isinstance(p := getattr(layer, name, None), nn.Parameter):
            setattr(layer, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
    return layer


@torch.no_grad()
def fold_in_torch(model: TaperedLM) -> TaperedLM:
    """The 'folded' variant: every g = 0 tapered norm folded into its readers (or producer) and replaced by what
    its kind leaves in its place (nothing; DyT's tanh). The copy holds `model`'s parameters except those the fold
    rewrites (its own copies of those): `model` is left as it was. A norm whose fold would write a value past its
    layer's dtype (an Inf) stays, with the reason in the copy's `kept_norms`, as the ONNX fold keeps it."""
    tapering = model.tapering  # the copy's has the same paths
    if tapering is None:
        raise ValueError("nothing to fold: the model has no tapered norms")
    if tapering.gate.value != 0.0:
        raise ValueError(f"gate is {tapering.gate.value:g}, not 0: the tapered norms are not constant maps")
    folded = model.copy(shared=True)
    network, kind = folded.network, tapering.kind
    owned = set()  # targets given their own tensors already (a layer may read one norm and produce another)
    kept: dict[str, str] = {}
    for path in tapering.norms:
        targets = tapering.folds_into(path)
        if not targets:
            continue  # a DyT post-norm stays as it is
        norm = network.get_submodule(path)
        constant = kind.constant_map(norm)
        if (heads := tapering.family.heads_of(path)) > 1:
            constant = constant.joined(heads)
        if constant.bias is not None and any(isinstance(fold_target(network, t), nn.Parameter) for t in targets):
            # A bare weight (MoE experts' stack) is applied by the family's own forward with no bias to take β·W:
            # this variant keeps the norm at g = 0 (the ONNX fold adds the bias per expert after the layer).
            continue
        writes = []
        for target in targets:
            layer = fold_target(network, target)
            if target not in owned:  # copies, so that the writes leave `model` as it was
                layer = _own_tensors(network, target, layer)
                owned.add(target)
            if path in tapering.readers:
                writes += reader_writes(layer, constant, stored_in_out(network, target, len(constant.scale)))
            elif isinstance(layer, nn.Module):
                writes += producer_writes(layer, constant)
            else:
                raise ValueError(f"{target}: a post-norm folds into the module producing its input, not a bare weight")
        if reason := next(filter(None, (w.past_range() for w in writes)), None):
            kept[path] = reason
            continue
        for write in writes:
            write.apply()
        network.set_submodule(path, kind.residue(norm))
    folded.forget_tapering()
    folded.kept_norms = kept
    return folded


def without_norms(model: TaperedLM) -> TaperedLM:
    """The zero-residue reference (variant `nonorm`): the model with nothing where it has a tapered norm (a gated
    norm: its gate alone), its weights copied unscaled. A timing reference, not the same function; norms that do
    not taper (Internal-Taper's final norm) stay, as they stay in the folded model, so that folded vs nonorm
    measures what the fold leaves behind.
    It holds `model`'s parameters themselves."""
    bare = model.copy(shared=True)
    for path in model.tapered_norms():
        bare.network.set_submodule(path, without_norm(bare.network.get_submodule(path)))
    bare.forget_tapering()
    return bare


def decomposed(baseline: TaperedLM) -> TaperedLM:
    """The `baseline-decomposed` variant: every fused norm module (nn.RMSNorm, nn.LayerNorm) written as element-wise
    ops, same weights."""
    for path, module in list(baseline.network.named_modules()):
        if (kind := plain_kind(module)) is not None:
            baseline.network.set_submodule(path, kind.hand_written(module))
    return baseline


class FusedProjection(nn.Module):
    """Sibling linear layers that read one tensor (q/k/v; gate/up), as one layer: their weights concatenated
    ([Σ out, in], each in its own dtype: no arithmetic) and their biases (zeros for a layer without one).

    The model's code still calls each sibling on its own (`self.q_proj(x)`, `self.k_proj(x)`, ...), so each is
    replaced by a `ProjectionPart` that asks this module for its slice: the first call with a tensor computes the
    whole product once and keeps its slices until every sibling has taken its own, later calls with that same tensor
    take theirs. A call with another tensor (or, in eager mode, with the same tensor changed in place since:
    its version counter moved) computes afresh, so a forward that does not call the siblings together still gets
    the right values. torch.compile traces the same logic into one matmul per group. Where there is no version
    counter to read (under torch.compile, or a tensor made in torch.inference_mode, as bench's torch runner makes
    them) the tensor's identity alone keys the slices: no family's forward changes the norm's output in place
    between its readers.
    """

    def __init__(self, layers: list[nn.Linear], joined: JoinedProjections | None = None):
        """`joined`: the concatenations made for other models, by the tensors they join; a group of layers holding
        the same tensors as one there (variants built from one checkpoint) takes its parameters instead of a copy."""
        super().__init__()
        key = tuple(
            (_storage_key(layer.weight), layer.bias is not None and _storage_key(layer.bias)) for layer in layers
        )
        if joined is None or key not in joined:
            weight = nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]))
            bias = None
            if any(layer.bias is not None for layer in layers):
                bias = nn.Parameter(
                    torch.cat(
                        [
                            layer.bias.detach()
                            if layer.bias is not None
                            else layer.weight.new_zeros(layer.out_features)
                            for layer in layers
                        ]
                    )
                )
            if joined is None:
                joined = {}
            # the joined tensors kept with it: while they live, their addresses name no other tensor
            joined[key] = ([(layer.weight, layer.bias) for layer in layers], weight, bias)
        self.weight, self.bias = joined[key][1:]
        self.widths = [layer.out_features for layer in layers]
        # (input, its version, the output's slices, the sibling indices yet to take theirs)
        self._slices: tuple[torch.Tensor, int | None, tuple[torch.Tensor, ...], set[int]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        held = self._slices
        versioned = not torch.compiler.is_compiling() and not x.is_inference()
        if held is None or held[0] is not x or index not in held[3] or (versioned and held[1] != x._version):
            held = (
                x,
                x._version if versioned else None,
                self(x).split(self.widths, dim=-1),
                set(range(len(self.widths))),
            )
        held[3].discard(index)
        self._slices = held if held[3] else None  # the last sibling's call lets the output go
        return held[2][index]


class ProjectionPart(nn.Module):
    """Where a sibling layer was: its slice of the group's FusedProjection output."""

    def __init__(self, fused: FusedProjection, index: int):
        super().__init__()
        self.fused, self.index = fused, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)


def _plain_linear(module: nn.Module) -> TypeGuard[nn.Linear]:
    """An nn.Linear computing x·Wᵀ + b and nothing else (not a subclass with its own forward: quantized, LoRA)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


@torch.no_grad()
def fuse_projections_in_torch(
    model: TaperedLM, family: Family, joined: JoinedProjections | None = None
) -> list[list[str]]:
    """In place: each group of linear layers the family names as reading one norm (`family.internal`) becomes one
    FusedProjection; the groups fused, as module paths. A layer that is not a plain nn.Linear, whose weight another
    module shares (a tied weight), or whose input width, dtype or device differs from the group's first is left
    as it is; a group needs two layers. `joined`: shared between the variants of one model (FusedProjection)."""
    network = model.network
    n_layers = layer_count(network, family)
    fused = []
    for readers in family.norm_readers(n_layers, "internal").values():
        candidates = [(path, network.get_submodule(path)) for path in readers]
        layers = [
            (path, layer)
            for path, layer in candidates
            if _plain_linear(layer) and not _shares_weight(network, path, layer.weight)
        ]
        if not layers:
            continue
        first = layers[0][1].weight
        group = [
            (path, layer)
            for path, layer in layers
            if layer.in_features == first.shape[1]
            and layer.weight.dtype == first.dtype
            and layer.weight.device == first.device
        ]
        if len(group) < 2:
            continue
        shared = FusedProjection([layer for _, layer in group], joined)
        for index, (path, _) in enumerate(group):
            network.set_submodule(path, ProjectionPart(shared, index))
        fused.append([path for path, _ in group])
    return fused


def fused_group_count(model: nn.Module) -> int:
    """The sibling groups `fuse_projections_in_torch` made one layer in `model`."""
    return sum(isinstance(module, FusedProjection) for module in model.modules())


def _storage_key(t: torch.Tensor) -> tuple:
    """Tensors with one key hold the same values: the same memory, read the same way (one checkpoint tensor under
    the separate parameters of two models)."""
    return t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride()


def _cast(models: list[nn.Module], dtype: torch.dtype) -> None:
    """Each model's floating-point tensors in `dtype` (as Module.to casts them), a tensor several models hold cast
    once and shared by them."""
    cast: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def one(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        key = _storage_key(t)
        if key not in cast:
            cast[key] = (t, t.to(dtype))  # the source kept while casting: its address names no other tensor
        return cast[key][1]

    for model in models:
        model._apply(one)


def build_variants(
    source: ModelSource, names: list[str], dtype: torch.dtype, fuse_projections: bool = False
) -> dict[str, TaperedLM]:
    """The variants in `names` of a tapered model source (taperfold.sources), at g = 0, each running the forward the
    exported graphs run; all built from fp32 weights before any is cast (the fold runs in float64 and casts once).

    They hold one copy of the weights between them, plus what a variant must have of its own: the source's
    tensors (`source.build` holds them without a copy) are held by baseline, unfolded, baseline-decomposed and
    nonorm, and by folded wherever the fold left a layer unchanged; folded adds its own copy of each layer a norm
    folded into (q/k/v and gate/up in a pre-norm transformer: about two thirds of a Llama's block weights). With
    `fuse_projections`, each group's concatenated weight is one more copy of those layers, shared by every variant
    that holds the same layers (folded has its own); a cast to another dtype is made once per tensor and shared,
    too. So all variants stay loaded and are timed side by side in alternating rounds (bench.harness) at
    little more than one model's memory, where building each only while it is timed would rebuild (and refold) it
    in every round of every cell."""
    tapered = source.build(gate=0.0)
    build = {
        BASELINE: lambda: source.build_baseline(),
        UNFOLDED: lambda: tapered,
        FOLDED: lambda: fold_in_torch(tapered),
        DECOMPOSED_BASELINE: lambda: decomposed(source.build_baseline()),
        NONORM: lambda: without_norms(tapered),
    }
    models = {name: build[name]() for name in names}
    if fuse_projections:  # once all are built: unfolded is the model the others were copied from
        joined: JoinedProjections = {}
        for model in models.values():
            fuse_projections_in_torch(model, source.family, joined)
    _cast(list(models.values()), dtype)
    return {name: m.eval() for name, m in models.items()}
