"""RMSNorm as one op (the strongest `baseline`), and back to plain ops (`baseline-decomposed`).

Below opset 23 the torch exporter writes `nn.RMSNorm` / `F.rms_norm`, and Hugging Face's hand-written
RMSNorm, as

    x ─[Cast f32]─► Pow(·, 2) ► ReduceMean(axes=[-1], keepdims=1) ► Add(eps) ► Sqrt ► Reciprocal ─┐
    └─────────────────────────────────────────────────────────────────────────────────► Mul(x, ·) ─► weight

where "weight" is `Mul(w)` then an optional `Cast` back, or a `Cast` back then `Mul(w)` (HF's order),
and `Div(1, ·)` may stand for the `Reciprocal`. ONNX Runtime's own fusion does not match the Reciprocal
form, so the graph runs ~9 kernels per norm. `FuseRMSNormPass` replaces each match with one node:

- opset ≥ 23: ONNX `RMSNormalization(X, scale)`;
- below: ONNX Runtime's `SimplifiedLayerNormalization(X, scale)`. ORT registers it in the ai.onnx
  domain, version 1 (contrib schema; inputs X, scale; output Y, optional inv_std_var; attributes axis,
  epsilon, stash_type), not in com.microsoft; its CPU and CUDA kernels take float, float16 and bfloat16.
  onnx.checker does not know it, and TensorRT's parser cannot take it: fuse for ONNX Runtime only.

Both compute in float32 when the input is float16/bfloat16 (stash_type 1), as the decomposed graph does
after its Cast; the weight moves to the input's dtype (exact when it came from that dtype). A chain
whose Casts do not start and end in the input's dtype is left as it is.

`ExpandRMSNormalizationPass` is the inverse at opset 23, where the exporter already emits
`RMSNormalization` even for a hand-written norm: it writes the op as the exporter's opset-20 form, so
the `baseline-decomposed` variant exists at every opset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from taperfold.opsets import FUSING_OPSET
from taperfold.passes._graph import add_initializer, cast_to, const_array, reduces_last_axis_only, sole_use

_FLOAT = ir.DataType.FLOAT


@dataclass(eq=False)
class RMSMatch:
    input: ir.Value  # x as the graph had it before any Cast
    dtype: ir.DataType  # x's element type, and the output's
    output: ir.Value  # the norm's result, read by the rest of the graph
    nodes: list[ir.Node]  # every node of the pattern (removed by the fusion)
    epsilon: float
    weight: np.ndarray | None  # [d] or None (no weight multiply)
    last: ir.Node  # the pattern's last node: the fused node goes after it


def _only_user(value: ir.Value, op_type: str | tuple[str, ...]) -> ir.Node | None:
    """The single node reading `value` if it has `op_type` and `value` is no graph output."""
    use = sole_use(value)
    ops = (op_type,) if isinstance(op_type, str) else op_type
    return use[0] if use is not None and use[0].domain == "" and use[0].op_type in ops else None


def _other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The input of a binary node that is not `value` (None if `value` is not one of them)."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a if b is value else None


def _scalar(value: ir.Value | None) -> float | None:
    array = const_array(value)
    return float(array.reshape(-1)[0]) if array is not None and array.size == 1 else None


def _weight(value: ir.Value | None, x: ir.Value) -> np.ndarray | None:
    """A norm weight: a constant scalar or [d] vector, d the width of x (float64), else None."""
    array = const_array(value)
    if array is None or array.ndim > 1 or not np.issubdtype(array.dtype, np.floating):
        return None
    width = x.shape[-1] if x.shape is not None and len(x.shape) else None
    if array.size != 1 and isinstance(width, int) and array.size != width:
        return None
    return array.astype(np.float64).reshape(-1)


def match_rms_norm(pow_node: ir.Node) -> RMSMatch | None:
    """The decomposed RMSNorm that starts at `pow_node` (see the module docstring), or None."""
    if pow_node.op_type != "Pow" or pow_node.domain != "" or _scalar(pow_node.inputs[1]) != 2.0:
        return None
    stats_input = pow_node.inputs[0]
    if stats_input is None:
        return None
    rank = len(stats_input.shape) if stats_input.shape is not None else None
    mean = _only_user(pow_node.outputs[0], "ReduceMean")
    if mean is None or not reduces_last_axis_only(mean, rank):
        return None
    add = _only_user(mean.outputs[0], "Add")
    if add is None or (eps := _scalar(_other_input(add, mean.outputs[0]))) is None:
        return None
    sqrt = _only_user(add.outputs[0], "Sqrt")
    inv = _only_user(sqrt.outputs[0], ("Reciprocal", "Div")) if sqrt is not None else None
    if (
        sqrt is None
        or inv is None
        or (inv.op_type == "Div" and (inv.inputs[1] is not sqrt.outputs[0] or _scalar(inv.inputs[0]) != 1.0))
    ):
        return None
    scale = _only_user(inv.outputs[0], "Mul")
    if scale is None or _other_input(scale, inv.outputs[0]) is not stats_input:
        return None
    nodes = [pow_node, mean, add, sqrt, inv, scale]
    out, weight, tail_cast = scale.outputs[0], None, None
    # then at most one Mul(w) and one Cast, in either order (HF casts back before its Mul)
    while (step := _only_user(out, ("Mul", "Cast"))) is not None:
        if step.op_type == "Mul" and weight is None:
            weight = _weight(_other_input(step, out), stats_input)
            if weight is None:
                break
        elif step.op_type == "Cast" and tail_cast is None:
            tail_cast = step
        else:
            break
        nodes.append(step)
        out = step.outputs[0]

    # x: the stats input, or, when the chain widens to float32 and casts back, what the widening Cast read
    x = stats_input
    if tail_cast is not None:
        widen = stats_input.producer()
        if widen is None or widen.op_type != "Cast" or widen.domain != "" or cast_to(widen) != _FLOAT:
            return None
        narrow = widen.inputs[0]
        if narrow is None or cast_to(tail_cast) != narrow.dtype:
            return None
        x = narrow
        if all(u.node in (pow_node, scale) for u in stats_input.uses()) and not stats_input.is_graph_output():
            nodes.insert(0, widen)  # else the widened x is read elsewhere too: that Cast stays
    if x.dtype is None or (out.dtype is not None and out.dtype != x.dtype):
        return None  # (ONNX's Mul takes one dtype, so an untyped out has x's)
    return RMSMatch(input=x, dtype=x.dtype, output=out, nodes=nodes, epsilon=eps, weight=weight, last=nodes[-1])


def _opset(model: ir.Model) -> int:
    return model.opset_imports.get("", 0)


class FuseRMSNormPass(ir.passes.InPlacePass):
    """Replace every decomposed RMSNorm with RMSNormalization (opset ≥ 23) or ONNX Runtime's
    SimplifiedLayerNormalization (below). `self.fused` counts the norms fused by the last call."""

    def __init__(self):
        super().__init__()
        self.fused = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        op = "RMSNormalization" if _opset(model) >= FUSING_OPSET else "SimplifiedLayerNormalization"
        self.fused = 0
        for node in list(graph):
            if node.graph is None:  # removed with an earlier match
                continue
            match = match_rms_norm(node)
            if match is None:
                continue
            dtype = match.dtype.numpy()
            width = match.input.shape[-1] if match.input.shape is not None else None
            weight = match.weight
            if weight is None or weight.size == 1:
                if not isinstance(width, int):
                    continue  # a scale of unknown width: leave this norm decomposed
                weight = np.full(width, 1.0 if weight is None else weight[0])
            stem = match.output.name or "rms_norm"
            scale = add_initializer(graph, f"{stem}.scale", ir.tensor(weight.astype(dtype)), suffix="")
            fused = ir.node(
                op,
                [match.input, scale],
                {"axis": -1, "epsilon": float(match.epsilon), "stash_type": 1},
                name=f"{stem}.fused",
                metadata_props=dict(match.last.metadata_props),
            )
            ir.convenience.replace_nodes_and_values(
                graph, match.last, match.nodes, [fused], [match.output], [fused.outputs[0]]
            )
            self.fused += 1
        if self.fused:
            RemoveUnusedNodesPass()(model)
            TopologicalSortPass()(model)
        return ir.passes.PassResult(model, self.fused > 0)


def decomposed_rms_norm(
    graph: ir.Graph,
    x: ir.Value,
    dtype: ir.DataType,
    scale: np.ndarray,
    eps: float,
    stem: str,
    meta: dict[str, str],
) -> list[ir.Node]:
    """The nodes of RMSNorm(x) in the exporter's opset-20 form, named after `stem`, each with the metadata `meta`
    (its constants become initializers of `graph`); the last one's output is the norm's."""
    new: list[ir.Node] = []

    def const(suffix: str, array: np.ndarray | np.generic) -> ir.Value:
        return add_initializer(graph, f"{stem}.{suffix}", ir.tensor(np.asarray(array)), suffix="")

    def op(op_type: str, *inputs: ir.Value, **attrs: int | ir.DataType) -> ir.Node:
        return ir.node(
            op_type,
            list(inputs),
            attrs or None,
            name=f"{stem}.{len(new)}_{op_type.lower()}",
            metadata_props=dict(meta),
        )

    xs = x
    if dtype != _FLOAT:
        new.append(op("Cast", x, to=_FLOAT))
        xs = new[-1].outputs[0]
    new.append(op("Pow", xs, const("two", np.float32(2.0))))
    new.append(op("ReduceMean", new[-1].outputs[0], const("axes", np.array([-1], np.int64)), keepdims=1))
    new.append(op("Add", new[-1].outputs[0], const("eps", np.float32(eps))))
    new.append(op("Sqrt", new[-1].outputs[0]))
    new.append(op("Reciprocal", new[-1].outputs[0]))
    new.append(op("Mul", xs, new[-1].outputs[0]))
    new.append(op("Mul", new[-1].outputs[0], const("weight", scale.astype(np.float32))))
    if dtype != _FLOAT:
        new.append(op("Cast", new[-1].outputs[0], to=dtype))
    return new


class ExpandRMSNormalizationPass(ir.passes.InPlacePass):
    """Write each ONNX RMSNormalization (last axis) as the exporter's decomposed opset-20 form:
    [Cast f32] → Pow → ReduceMean → Add → Sqrt → Reciprocal → Mul → Mul(scale) [→ Cast back]."""

    def __init__(self):
        super().__init__()
        self.expanded = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.expanded = 0
        for node in list(graph):
            if node.op_type != "RMSNormalization" or node.domain != "" or node.attributes.get_int("axis", -1) != -1:
                continue
            scale = const_array(node.inputs[1])
            x, out = node.inputs[0], node.outputs[0]
            if scale is None or x is None or x.dtype is None:
                continue
            eps = node.attributes.get_float("epsilon", 1e-5)
            new = decomposed_rms_norm(graph, x, x.dtype, scale, eps, out.name or "rms_norm", dict(node.metadata_props))
            ir.convenience.replace_nodes_and_values(graph, node, [node], new, [out], [new[-1].outputs[0]])
            self.expanded += 1
        if self.expanded:
            RemoveUnusedNodesPass()(model)
            TopologicalSortPass()(model)
        return ir.passes.PassResult(model, self.expanded > 0)


def fuse_rms_norms(model: ir.Model) -> int:
    """Fuse every decomposed RMSNorm of `model` in place; the number fused."""
    fuse = FuseRMSNormPass()
    fuse(model)
    return fuse.fused


def expand_rms_norms(model: ir.Model) -> int:
    """Decompose every RMSNormalization of `model` in place; the number expanded."""
    expand = ExpandRMSNormalizationPass()
    expand(model)
    return expand.expanded


def count_rms_norms(model: ir.Model) -> int:
    """The decomposed RMSNorms of `model` that `fuse_rms_norms` would fuse."""
    return sum(match_rms_norm(node) is not None for node in model.graph)
