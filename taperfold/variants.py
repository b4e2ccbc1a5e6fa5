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
"""

from __future__ import annotations

import torch
from torch import nn

from taperfold.exportdir import BASELINE, DECOMPOSED_BASELINE, FOLDED, NONORM, UNFOLDED
from taperfold.norms import ConstantMap, plain_kind
from taperfold.taper import TaperedLM


def fold_into_reader(reader: nn.Module, folded: ConstantMap) -> None:
    """y = ((h − μ)·diag(s) + β) W + b  →  h W' + b'  with W' = (I − 11ᵀ/d) diag(s) W, b' = b + β W, in float64
    from the stored weight, cast once. `reader`: an nn.Linear ([out, in]) or a GPT-2 style Conv1D ([in, out])."""
    conv = not isinstance(reader, nn.Linear)
    w = reader.weight.double() if conv else reader.weight.double().T  # as [in, out]
    new_w = folded.scale[:, None] * w
    if folded.centered:
        new_w = new_w - new_w.mean(dim=0, keepdim=True)
    if folded.bias is not None:
        shift = folded.bias @ w
        if reader.bias is None:
            reader.bias = nn.Parameter(torch.zeros(w.shape[1], dtype=reader.weight.dtype, device=w.device))
        reader.bias.copy_((reader.bias.double() + shift).to(reader.bias.dtype))
    reader.weight.copy_((new_w if conv else new_w.T).to(reader.weight.dtype))


def fold_into_producer(producer: nn.Module, folded: ConstantMap) -> None:
    """z = h W + b, then (z − μ_z)·diag(s) + β  →  h W' + b'  with W' = W (I − 11ᵀ/d) diag(s),
    b' = (b − mean(b))·s + β: the post-norm's map moves into the producer's output columns (float64, cast once)."""
    conv = not isinstance(producer, nn.Linear)
    w = producer.weight.double() if conv else producer.weight.double().T  # as [in, out]
    b = producer.bias.double() if producer.bias is not None else torch.zeros(w.shape[1], dtype=torch.float64,
                                                                              device=w.device)
    if folded.centered:
        w, b = w - w.mean(dim=1, keepdim=True), b - b.mean()
    new_w, new_b = w * folded.scale[None, :], b * folded.scale
    if folded.bias is not None:
        new_b = new_b + folded.bias
    producer.weight.copy_((new_w if conv else new_w.T).to(producer.weight.dtype))
    if producer.bias is None and (folded.centered or folded.bias is not None):
        producer.bias = nn.Parameter(torch.zeros(w.shape[1], dtype=producer.weight.dtype, device=w.device))
    if producer.bias is not None:
        producer.bias.copy_(new_b.to(producer.bias.dtype))


def _shares_weight(network: nn.Module, path: str, weight: torch.Tensor) -> bool:
    """Whether a module other than the one at `path` holds `weight` too (a head tied to the embedding)."""
    return any(p is weight and not name.startswith(path + ".")
               for name, p in network.named_parameters(remove_duplicate=False))


@torch.no_grad()
def fold_in_torch(model: TaperedLM) -> TaperedLM:
    """The 'folded' variant: every g = 0 tapered norm folded into its readers and replaced by Identity."""
    if model.tapering is None:
        raise ValueError("nothing to fold: the model has no tapered norms")
    if model.gate.value != 0.0:
        raise ValueError(f"gate is {model.gate.value:g}, not 0: the tapered norms are not constant maps")
    folded = model.copy()
    network, tapering = folded.network, folded.tapering
    for path in tapering.norms:
        constant = tapering.kind.constant_map(network.get_submodule(path))
        for target in tapering.folds_into(path):
            layer = network.get_submodule(target)
            if _shares_weight(network, target, layer.weight):  # untie: the embedding stays as it is
                layer.weight = nn.Parameter(layer.weight.detach().clone())
            if path in tapering.readers:
                fold_into_reader(layer, constant)
            else:
                fold_into_producer(layer, constant)
        network.set_submodule(path, nn.Identity())
    folded.forget_tapering()
    return folded


def without_norms(model: TaperedLM) -> TaperedLM:
    """The zero-residue reference (variant `nonorm`): the model with nothing where it has a tapered norm, its weights
    copied unscaled. A timing reference, not the same function; norms that do not taper (Internal-Taper's final
    norm) stay, as they stay in the folded model, so that folded vs nonorm measures what the fold leaves behind."""
    bare = model.copy()
    for path in model.tapered_norms():
        bare.network.set_submodule(path, nn.Identity())
    bare.forget_tapering()
    return bare


def decomposed(baseline: TaperedLM) -> TaperedLM:
    """The `baseline-decomposed` variant: every fused norm module (nn.RMSNorm, nn.LayerNorm) written as element-wise
    ops, same weights."""
    for path, module in list(baseline.network.named_modules()):
        if (kind := plain_kind(module)) is not None:
            baseline.network.set_submodule(path, kind.hand_written(module))
    return baseline


def build_variants(source, names: list[str], dtype: torch.dtype) -> dict[str, TaperedLM]:
    """The variants in `names` of a tapered model source (taperfold.sources), at g = 0, each running the forward the
    exported graphs run; all built from fp32 weights before any is cast (the fold runs in float64 and casts once)."""
    tapered = source.build(gate=0.0)
    build = {BASELINE: lambda: source.build_baseline(), UNFOLDED: lambda: tapered,
             FOLDED: lambda: fold_in_torch(tapered),
             DECOMPOSED_BASELINE: lambda: decomposed(source.build_baseline()),
             NONORM: lambda: without_norms(tapered)}
    models = {name: build[name]() for name in names}
    return {name: m.to(dtype).eval() for name, m in models.items()}
