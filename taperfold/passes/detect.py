"""Find constant-scale norms: TaperNorm / TaperLN at gate g = 0 as they appear in an exported graph.

RMS form (TaperNorm, `h * c * weight_tilde`): a chain of Muls by constants (scalars or per-channel
[d] vectors, either operand order), possibly with Cast/Identity steps in between.
LN form (TaperLN, `(h - h.mean(-1, keepdim=True)) * c * weight_tilde + bias`):
ReduceMean(h, axes=[-1], keepdims=1) -> Sub(h, mean) -> that chain -> optional Add(., beta).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from taperfold.passes._graph import (
    FLOAT_TYPES,
    NormMatch,
    cast_to,
    channel_const,
    const_array,
    const_producers,
    is_const,
)
from taperfold.passes.report import FoldReport, NormEntry

TAPER_CLASSES = {"TaperNorm": "rms", "TaperLN": "ln"}
GATE_NOT_ZERO = "gate ≠ 0 (per-token statistics in graph)"


def scopes(node: ir.Node) -> list[tuple[str, str]]:
    """(module path, class) of each module around `node`, outermost first.

    Read from the dynamo exporter's `namespace` metadata, e.g.
    ": m.LM/model.layers.0.input_layernorm: taperfold.nn.TaperNorm/mul: aten.mul.Tensor"
    (the last segment is the op itself; the same classes are in `pkg.torch.onnx.class_hierarchy`).
    """
    segments = node.metadata_props.get("namespace", "").split("/")[:-1]
    return [(path, cls) for path, _, cls in (seg.rpartition(": ") for seg in segments)]


def _data_index(node: ir.Node) -> int | None:
    """Which input a chain step passes along: a Mul by a per-channel constant, a float Cast or an Identity."""
    if node.domain != "" or len(node.outputs) != 1:
        return None
    if node.op_type == "Identity" or (node.op_type == "Cast" and cast_to(node) in FLOAT_TYPES):
        return None if is_const(node.inputs[0]) else 0
    if node.op_type == "Mul" and len(node.inputs) == 2:
        a, b = node.inputs
        if not is_const(a) and channel_const(b, a) is not None:
            return 0
        if not is_const(b) and channel_const(a, b) is not None:
            return 1
    return None


def _sole_use(value: ir.Value) -> tuple[ir.Node, int] | None:
    uses = list(value.uses())
    return None if value.is_graph_output() or len(uses) != 1 else tuple(uses[0])


def _continues(node: ir.Node) -> bool:
    """Whether `node` is a chain step whose data input is the sole output of another chain step."""
    i = _data_index(node)
    prev = node.inputs[i].producer() if i is not None else None
    return prev is not None and _data_index(prev) is not None and _sole_use(prev.outputs[0]) is not None


def _chain_from(start: ir.Node) -> list[ir.Node]:
    chain = [start]
    while (use := _sole_use(chain[-1].outputs[0])) is not None and _data_index(use[0]) == use[1]:
        chain.append(use[0])
    return chain


def _chain_scale(chain: list[ir.Node]) -> np.ndarray | None:
    """Product of the chain's constants as float64 [d]; None unless one of them is a per-channel vector."""
    scale, d = np.ones(1), None
    for node in chain:
        if node.op_type == "Mul":
            i = _data_index(node)
            factor = channel_const(node.inputs[1 - i], node.inputs[i])
            if factor.size > 1:
                if d not in (None, factor.size):
                    return None
                d = factor.size
            scale = scale * factor
    return scale if d is not None else None


def _is_last_axis_mean(node: ir.Node | None, h: ir.Value) -> bool:
    if node is None or node.op_type != "ReduceMean" or node.domain != "" or node.inputs[0] is not h:
        return False
    if node.attributes.get_int("keepdims", 1) != 1:
        return False
    axes = const_array(node.inputs[1]) if len(node.inputs) > 1 else node.attributes.get_ints("axes")
    axes = None if axes is None else [int(a) for a in np.ravel(axes)]
    return axes == [-1] or (h.shape is not None and axes == [len(h.shape) - 1])


def match_norm(start: ir.Node) -> NormMatch | None:
    """The constant-scale norm whose chain starts at `start`, or None."""
    if _data_index(start) is None or _continues(start):
        return None
    chain = _chain_from(start)
    scale = _chain_scale(chain)
    if scale is None:
        return None
    x = start.inputs[_data_index(start)]
    sub = x.producer()
    if (
        sub is None
        or sub.op_type != "Sub"
        or _sole_use(x) is None
        or _sole_use(sub.inputs[1]) is None
        or not _is_last_axis_mean(sub.inputs[1].producer(), sub.inputs[0])
    ):
        return NormMatch("rms", x, chain[-1].outputs[0], chain, scale)
    nodes = [sub.inputs[1].producer(), sub, *chain]
    use = _sole_use(chain[-1].outputs[0])
    if use is not None and use[0].op_type == "Add" and use[0].domain == "":
        add, i = use
        beta = channel_const(add.inputs[1 - i], add.inputs[i])
        if beta is not None:
            beta = np.broadcast_to(beta, scale.shape)
            return NormMatch("ln", sub.inputs[0], add.outputs[0], [*nodes, add], scale, beta)
    return NormMatch("ln", sub.inputs[0], chain[-1].outputs[0], nodes, scale)


def _owned_nodes(match: NormMatch) -> set[ir.Node]:
    """The match's nodes and the nodes that compute the constants they read."""
    owned = set(match.nodes)
    for node in match.nodes:
        for value in node.inputs:
            if value is not None and is_const(value):
                owned.update(const_producers(value))
    return owned


def _norm_module(node: ir.Node) -> tuple[str, str] | None:
    """(module path, class name) of the innermost normalization module around `node`:
    TaperNorm, TaperLN, or any class named *Norm (RMSNorm, LayerNorm, LlamaRMSNorm, ...)."""
    for path, cls in reversed(scopes(node)):
        name = cls.rpartition(".")[2]
        if name in TAPER_CLASSES or name.endswith("Norm"):
            return path or name, name
    return None


def norm_name(nodes: list[ir.Node]) -> str:
    """The module path of the norm (dynamo metadata), else its first node's name."""
    for node in nodes:
        if (found := scopes(node)) and found[-1][0]:
            return found[-1][0]
    return nodes[0].name or nodes[0].op_type


class DetectTaperNormsPass(ir.passes.PassBase):
    """Record every constant-scale norm in the report (status "detected"), and every tapered layer
    that still computes per-token statistics (status "not_foldable"). The graph is not changed."""

    in_place = True
    changes_input = False

    def __init__(self, report: FoldReport):
        super().__init__()
        self.report = report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        order = {node: i for i, node in enumerate(model.graph)}
        matches = [m for node in model.graph if (m := match_norm(node)) is not None]
        owned = set().union(*(_owned_nodes(m) for m in matches))

        # A norm module with nodes outside the matched chains computes per-token statistics: a chain
        # in it is just its γ, not a constant-scale norm. For TaperNorm/TaperLN that means g != 0.
        modules: dict[str, tuple[str, list[ir.Node]]] = {}
        for node in model.graph:
            if (found := _norm_module(node)) is not None:
                modules.setdefault(found[0], (found[1], []))[1].append(node)
        with_stats = {path: (cls, nodes) for path, (cls, nodes) in modules.items() if not owned.issuperset(nodes)}
        stats_nodes = {n for _, nodes in with_stats.values() for n in nodes}

        entries = [
            (order[m.nodes[0]], NormEntry(norm_name(m.nodes), m.kind, "detected", match=m))
            for m in matches
            if not stats_nodes.intersection(m.nodes)
        ]
        entries += [
            (order[nodes[0]], NormEntry(path, TAPER_CLASSES[cls], "not_foldable", reason=GATE_NOT_ZERO))
            for path, (cls, nodes) in with_stats.items()
            if cls in TAPER_CLASSES
        ]
        self.report.norms.extend(entry for _, entry in sorted(entries, key=lambda pair: pair[0]))
        return ir.passes.PassResult(model, modified=False)
