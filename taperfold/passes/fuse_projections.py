"""Fuse the linear layers that read one tensor (q/k/v; gate/up) into one layer followed by a Split.

On a GPU a forward is launch-bound at small batch: three MatMuls on one input are three kernels where one
on the concatenated weight does the same work (issue 20: 115 -> 91 kernels per forward for taperfold's llama
under torch.compile). Siblings are MatMul(x, W) (optionally followed by an Add of a constant per-channel
bias) or Gemm(x, W, [C]) with alpha = 1 (and beta = 1 with a bias) that read the same x, whose W is a
constant 2-D float weight, all of one op, layout, dtype and input width K:

    y_i = x·W_i [+ b_i]   ->   [y_1, ..., y_n] = Split(x·[W_1 ... W_n] [+ [b_1 ... b_n]])

The weights (and biases) are concatenated in their own dtype: no arithmetic, so every output column is the
same dot product as before (a sibling without a bias gets zeros, and x + 0 = x). The concatenated weight is
computed when the model is written, read through the loader's memory maps, so a large model is never held
twice. Readers of x that are not such siblings are left alone, and so is a sibling whose weight another node
also reads (a tied weight): fusing it would store that weight twice. The report says which.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TypeGuard

import numpy as np
import onnx_ir as ir

from taperfold.passes._graph import add_initializer, const_array, describe, node_label, remove_if_dead
from taperfold.passes.detect import scopes
from taperfold.passes.readers import weight_source
from taperfold.passes.report import FusedGroup, LeftReader, ProjectionReport

LINEAR_OPS = ("MatMul", "Gemm")
SPLIT_AS_INPUT = 13  # from opset 13 Split takes its sizes as an input, before as an attribute


class NotASibling(Exception):
    """Why a reader of a shared input cannot join its siblings; the message goes into the report."""


@dataclasses.dataclass(eq=False)
class Sibling:
    """One linear layer reading the shared input: its node, its constant weight as the node reads it, its bias."""

    node: ir.Node
    tensor: ir.TensorProtocol  # the stored weight
    via: list[ir.Node]  # Identity/Transpose nodes between the stored weight and the node
    stored_transposed: bool  # the node reads tensor.T (a Transpose node between them)
    bias: ir.Node | None  # the Add of a constant bias after a MatMul (a Gemm's bias is its input C)
    bias_index: int  # which input of `bias` (or of the Gemm) is the constant

    @property
    def reads_nd(self) -> bool:
        """The node reads its weight as [N, K] (Gemm with transB=1), else [K, N]."""
        return self.node.op_type == "Gemm" and self.node.attributes.get_int("transB", 0) != 0

    @property
    def shape(self) -> tuple[int, int]:
        """The weight as the node reads it."""
        rows, cols = self.tensor.shape.numpy()
        return (cols, rows) if self.stored_transposed else (rows, cols)

    @property
    def width(self) -> int:
        """Output channels N."""
        return self.shape[0] if self.reads_nd else self.shape[1]

    @property
    def output(self) -> ir.Value:
        """What the layer's readers read: the bias Add's output, or the node's."""
        return (self.bias or self.node).outputs[0]

    def key(self) -> tuple:
        """Siblings with equal keys fuse: one op, one layout, one dtype, one input width."""
        k = self.shape[1] if self.reads_nd else self.shape[0]
        return self.node.op_type, self.reads_nd, self.tensor.dtype, k

    def weight(self) -> np.ndarray:
        """The weight as the node reads it, in its own dtype."""
        array = self.tensor.numpy()
        return array.T if self.stored_transposed else array

    def bias_array(self) -> np.ndarray | None:
        if self.bias is not None:
            value = self.bias.inputs[self.bias_index]
        elif self.node.op_type == "Gemm" and len(self.node.inputs) > 2:
            value = self.node.inputs[2]
        else:
            return None
        array = const_array(value)  # a constant: `sibling` checked it
        return None if array is None else array.reshape(-1)


def _onnx(node: ir.Node, *ops: str) -> bool:
    return node.domain == "" and node.op_type in ops


def _per_channel(array: np.ndarray | None, n: int) -> TypeGuard[np.ndarray]:
    return array is not None and array.size == n and all(dim == 1 for dim in array.shape[:-1])


def _bias_add(node: ir.Node, n: int) -> tuple[ir.Node, int] | None:
    """The Add of a constant per-channel bias that alone reads a MatMul's output, as (Add, index of the bias)."""
    out = node.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output() or len(uses) != 1 or not _onnx(uses[0].node, "Add"):
        return None
    add, i = uses[0]
    bias = add.inputs[1 - i]
    array = const_array(bias)
    if not _per_channel(array, n) or (array.ndim > 1 and (out.shape is None or array.ndim > len(out.shape))):
        return None  # not one value per channel, or it would raise the output's rank
    if bias is None or bias.dtype != out.dtype:
        return None
    return add, 1 - i


def sibling(node: ir.Node, index: int) -> Sibling:
    """The Sibling that `node` (reading the shared input at `index`) is, or NotASibling saying why not."""
    if not _onnx(node, *LINEAR_OPS):
        raise NotASibling(f"{describe(node)} is not a linear layer")
    if index != 0:
        raise NotASibling(f"{describe(node)} reads it as its weight")
    if node.op_type == "Gemm":
        if node.attributes.get_int("transA", 0):
            raise NotASibling(f"{describe(node)} has transA=1")
        if node.attributes.get_float("alpha", 1.0) != 1.0:
            raise NotASibling(f"{describe(node)} has alpha ≠ 1 (fusing would need arithmetic)")
    source = weight_source(node.inputs[1])
    if source is None:
        raise NotASibling(f"{describe(node)}'s weight is not a constant 2-D float tensor")
    root, tensor, via, transposed = source
    path = [root, *(step.outputs[0] for step in via)]
    if root.is_graph_output() or any(v.is_graph_output() for v in path):
        raise NotASibling(f"{describe(node)}'s weight is a graph output")
    if others := [u.node for v in path for u in v.uses() if u.node is not node and u.node not in via]:
        raise NotASibling(
            f"{describe(node)}'s weight '{root.name}' is also read by {describe(others[0])} "
            "(tied): fusing would store it twice"
        )
    found = Sibling(node, tensor, via, transposed, None, 0)
    if node.op_type == "Gemm":
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            if not _per_channel(const_array(node.inputs[2]), found.width):
                raise NotASibling(f"{describe(node)}'s bias is not a constant per output channel")
            if node.attributes.get_float("beta", 1.0) != 1.0:
                raise NotASibling(f"{describe(node)} has beta ≠ 1 (fusing would need arithmetic)")
            if node.inputs[2].dtype != tensor.dtype:
                raise NotASibling(f"{describe(node)}'s bias and weight differ in dtype")
    elif (bias := _bias_add(node, found.width)) is not None:
        found.bias, found.bias_index = bias
    return found


def _module(node: ir.Node) -> str:
    found = scopes(node)
    return found[-1][0] if found else ""


def _weight_tensor(group: list[Sibling]) -> ir.LazyTensor:
    """[W_1 ... W_n] in the layout the node reads: along the output axis (columns of [K, N], rows of [N, K])."""
    first = group[0]
    total = sum(s.width for s in group)
    k = first.key()[3]
    shape = (total, k) if first.reads_nd else (k, total)

    def compute() -> ir.TensorProtocol:
        joined = np.concatenate([s.weight() for s in group], axis=0 if first.reads_nd else 1)
        return ir.tensor(np.ascontiguousarray(joined), dtype=first.tensor.dtype)

    return ir.LazyTensor(compute, dtype=first.tensor.dtype, shape=ir.Shape(shape))


def _bias_tensor(group: list[Sibling]) -> ir.TensorProtocol | None:
    """[b_1 ... b_n], zeros for a sibling without a bias; None when none has one."""
    biases = [s.bias_array() for s in group]
    if all(b is None for b in biases):
        return None
    dtype = group[0].tensor.dtype.numpy()
    joined = np.concatenate(
        [np.zeros(s.width, dtype) if b is None else b.astype(dtype, copy=False) for s, b in zip(group, biases)]
    )
    return ir.tensor(joined, dtype=group[0].tensor.dtype)


def _copy_value_info(target: ir.Value, source: ir.Value) -> None:
    target.type, target.shape = source.type, source.shape


def fuse_group(graph: ir.Graph, x: ir.Value, group: list[Sibling], opset: int) -> FusedGroup:
    """Replace `group` (siblings reading `x`, in graph order) by one layer and a Split; return what was done."""
    first = group[0].node
    name = f"{first.name}_fused"
    weight_tensor = _weight_tensor(group)
    weight = add_initializer(graph, first.name or "projection", weight_tensor, suffix=".fused_weight")
    bias = _bias_tensor(group)
    bias_value = add_initializer(graph, first.name or "projection", bias, suffix=".fused_bias") if bias else None
    meta = dict(first.metadata_props)
    new_nodes = []
    if first.op_type == "Gemm":
        linear = ir.node(
            "Gemm",
            [x, weight, *([bias_value] if bias_value else [])],
            name=name,
            metadata_props=meta,
            attributes={"transB": int(group[0].reads_nd)},
        )
        new_nodes.append(linear)
        joined = linear.outputs[0]
    else:
        linear = ir.node("MatMul", [x, weight], name=name, metadata_props=meta)
        new_nodes.append(linear)
        joined = linear.outputs[0]
        if bias_value is not None:
            add = ir.node("Add", [joined, bias_value], name=f"{name}_bias", metadata_props=meta)
            new_nodes.append(add)
            joined = add.outputs[0]
    widths = [s.width for s in group]
    if opset >= SPLIT_AS_INPUT:
        sizes = add_initializer(graph, name, ir.tensor(np.array(widths, np.int64)), suffix=".split")
        split = ir.node(
            "Split",
            [joined, sizes],
            attributes={"axis": -1},
            num_outputs=len(group),
            name=f"{name}_split",
            metadata_props=meta,
        )
    else:
        split = ir.node(
            "Split",
            [joined],
            attributes={"axis": -1, "split": widths},
            num_outputs=len(group),
            name=f"{name}_split",
            metadata_props=meta,
        )
    new_nodes.append(split)
    # value info: the joined output is the first sibling's with the width summed
    shape = group[0].output.shape
    for step in new_nodes[:-1]:
        step.outputs[0].dtype = weight_tensor.dtype
        if shape is not None:
            step.outputs[0].shape = ir.Shape([*shape[:-1], sum(widths)])
    graph.insert_before(first, new_nodes)
    dead = []
    for s, out in zip(group, split.outputs):
        old = s.output
        _copy_value_info(out, old)
        old_name, was_output = old.name, old.is_graph_output()
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        if was_output:  # the model's output keeps its name
            old.name, out.name = f"{old_name}_unfused", old_name
        else:
            out.name = old_name
            old.name = f"{old_name}_unfused"
        dead += [s.node, *s.via, *([s.bias] if s.bias else [])]
    remove_if_dead(graph, dead)
    nbytes = weight_tensor.nbytes + (bias.nbytes if bias is not None else 0)
    return FusedGroup(
        input=x.name or "",
        nodes=[node_label(s.node) for s in group],
        modules=[_module(s.node) for s in group],
        fused=name,
        widths=widths,
        bias=bias_value is not None,
        bytes_written=nbytes,
    )


def _linear_count(graph: ir.Graph) -> int:
    return sum(1 for node in graph if _onnx(node, *LINEAR_OPS))


def shared_inputs(graph: ir.Graph) -> list[ir.Value]:
    """Values read by two or more linear layers as their data input, in graph order."""
    values = [*graph.inputs, *(v for node in graph for v in node.outputs)]
    found = []
    for value in values:
        readers = [u for u in value.uses() if _onnx(u.node, *LINEAR_OPS) and u.idx == 0]
        if len(readers) >= 2:
            found.append(value)
    return found


class FuseProjectionsPass(ir.passes.InPlacePass):
    """For every tensor that two or more linear layers read, fuse those that can be into one layer and a Split.

    Requires nothing of the model (it sees through Transpose/Identity to constant weights; no arithmetic).
    Ensures: nothing reads a fused layer's output any more (the Split's outputs replaced them, names kept), and
    the graph has exactly Σ(group size − 1) fewer MatMul/Gemm nodes.
    """

    def __init__(self, report: ProjectionReport | None = None):
        super().__init__()
        self.report = report if report is not None else ProjectionReport()
        self._replaced: list[ir.Node] = []
        self._removed = 0  # linear nodes this run should remove: Σ(group size − 1)

    def requires(self, model: ir.Model) -> None:
        self._replaced, self._removed = [], 0  # a run starts here: requires, call, ensures

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", 1)
        self.report.linear_before = _linear_count(graph)
        modified = False
        for x in shared_inputs(graph):
            order = {node: i for i, node in enumerate(graph)}
            groups: dict[tuple, list[Sibling]] = defaultdict(list)
            for node, index in sorted(x.uses(), key=lambda use: order[use.node]):
                try:
                    found = sibling(node, index)
                except NotASibling as why:
                    self.report.left.append(LeftReader(x.name or "", node.name or "", str(why)))
                    continue
                groups[found.key()].append(found)
            for group in groups.values():
                if len(group) < 2:
                    self.report.left.append(
                        LeftReader(
                            x.name or "", group[0].node.name or "", "no sibling of the same op, layout, dtype and width"
                        )
                    )
                    continue
                self.report.groups.append(fuse_group(graph, x, group, opset))
                self._replaced += [s.node for s in group]
                self._removed += len(group) - 1
                modified = True
        self.report.linear_after = _linear_count(graph)
        return ir.passes.PassResult(model, modified)

    def ensures(self, model: ir.Model) -> None:
        for node in self._replaced:
            if node.graph is not None or any(v.uses() or v.is_graph_output() for v in node.outputs):
                raise ir.passes.PostconditionError(f"{describe(node)} is still in the graph after it was fused")
        if self.report.linear_before - self.report.linear_after != self._removed:
            raise ir.passes.PostconditionError(
                f"{self.report.linear_before} linear layers became {self.report.linear_after}, not "
                f"{self.report.linear_before - self._removed}"
            )
