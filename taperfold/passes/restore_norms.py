"""The baseline graph made from the unfolded one: each tapered norm's constant map at g = 0 (h·c·γ̃, a LayerNorm's
centred form plus β) replaced by the real norm it stands for (RMSNorm(h)·γ, LayerNorm(h)·γ + β), so that an export
traces one model per graph kind. The baseline model differs from the unfolded one in its norms alone (the same
weights; taperfold.variants), and a tapered norm at g = 1 computes exactly the norm it replaced (tests/test_hf_traced:
every family), so the two graphs differ where the norms are and nowhere else.

The real norm is written as the exporter writes one at the graph's opset: `RMSNormalization` from opset 23, below it
the decomposed ops the exporter emits for `F.rms_norm` (which FuseRMSNormPass fuses for ONNX Runtime), and
`LayerNormalization`. Float32 graphs only: a model's own norm computes its statistics in float32 whatever its dtype,
which a graph of another dtype would have to spell out op by op.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from taperfold.opsets import FUSING_OPSET
from taperfold.passes._graph import add_initializer
from taperfold.passes.detect import Candidate, detect_norms
from taperfold.passes.fuse_norm import decomposed_rms_norm


@dataclasses.dataclass(frozen=True)
class RealNorm:
    """A norm of the baseline, and the constant map that stands for it in the unfolded graph."""

    centered: bool  # a LayerNorm: the mean subtracted first
    gain: np.ndarray  # float64 [d]: γ (with the gain offset: 1 + γ for Gemma)
    bias: np.ndarray | None  # float64 [d]: β, or None (a norm without one: Cohere's LayerNorm)
    eps: float
    constant_scale: np.ndarray  # float64 [d]: c·γ̃, what the unfolded graph multiplies by
    constant_bias: np.ndarray | None  # float64 [d]: the tapered norm's β, which the unfolded graph adds
    module_class: tuple[str, str]  # (the tapered module's class, the baseline's), as the exporter's metadata names them


class RestoreNormsPass(ir.passes.InPlacePass):
    """Requires: a float32 graph traced from the unfolded model (norms named by the exporter's metadata), its
    constants folded. Ensures: each norm of `norms` (by its name in the graph) computes its statistics again, its
    readers reading the real norm; or, when any one is not found exactly once with its constant map, the graph as it
    was and `missing` naming those (the graph is then no baseline: trace the baseline model instead)."""

    def __init__(self, norms: dict[str, RealNorm]):
        super().__init__()
        self.norms = norms
        self.missing: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        found: dict[str, Candidate] = {}
        twice: list[str] = []  # a module applied twice is named `name#2` the second time: both would need it
        for candidate in detect_norms(model).candidates:
            name, _, again = candidate.name.partition("#")
            norm = self.norms.get(name)
            if norm is not None and again:
                twice.append(name)
            elif norm is not None and _stands_for(candidate, norm):
                found[name] = candidate
        self.missing = [name for name in self.norms if name not in found or name in twice]
        if self.missing:
            return ir.passes.PassResult(model, modified=False)
        opset = model.opset_imports.get("", 0)
        for name, candidate in found.items():
            _restore(model.graph, candidate, self.norms[name], opset)
        RemoveUnusedNodesPass()(model)
        TopologicalSortPass()(model)
        return ir.passes.PassResult(model, modified=bool(found))


def _stands_for(candidate: Candidate, norm: RealNorm) -> bool:
    """Whether the candidate is that norm's constant map: the same centring, scale and shift, nothing kept."""
    match = candidate.match
    if match.kept or match.centered != norm.centered or match.output.is_graph_output():
        return False
    if not np.allclose(match.scale, norm.constant_scale, rtol=1e-5, atol=1e-7):
        return False
    if match.bias is None or norm.constant_bias is None:  # a β of zero is no Add in the graph
        return not np.any(match.bias if match.bias is not None else norm.constant_bias)
    return bool(np.allclose(match.bias, norm.constant_bias, rtol=1e-5, atol=1e-7))


def _restore(graph: ir.Graph, candidate: Candidate, norm: RealNorm, opset: int) -> None:
    """The real norm on the candidate's input, its readers moved onto it (the map's nodes are left to the cleanup:
    a centring may be shared with another norm of the same input)."""
    match = candidate.match
    x, last = match.input, match.nodes[-1]
    tapered, baseline = norm.module_class
    meta = {k: v.replace(tapered, baseline) for k, v in last.metadata_props.items()}
    stem = f"{candidate.name}.restored"

    def const(suffix: str, array: np.ndarray) -> ir.Value:
        return add_initializer(graph, f"{stem}.{suffix}", ir.tensor(array.astype(np.float32)), suffix="")

    if norm.centered:
        inputs = [x, const("weight", norm.gain)] + ([const("bias", norm.bias)] if norm.bias is not None else [])
        attributes = {"axis": -1, "epsilon": norm.eps}
        new = [ir.node("LayerNormalization", inputs, attributes, name=stem, metadata_props=meta)]
    elif opset >= FUSING_OPSET:
        attributes = {"axis": -1, "epsilon": norm.eps}
        new = [ir.node("RMSNormalization", [x, const("weight", norm.gain)], attributes, name=stem, metadata_props=meta)]
    else:
        new = decomposed_rms_norm(graph, x, ir.DataType.FLOAT, norm.gain, norm.eps, stem, meta)
    graph.insert_after(last, new)
    match.output.replace_all_uses_with(new[-1].outputs[0])
