"""Fold each detected norm into the linear layers that read it, so the norm leaves the graph.

With row vectors (y = x·W, W stored [d, n]) and s the norm's per-channel scale:
  RMS form  x·diag(s)·W                         -> W' = diag(s)·W
  LN form   (x - mean(x))·diag(s)·W + beta·W    -> W' = (I - 11ᵀ/d)·diag(s)·W,  b' = b + beta·W
All in float64 from the stored weights, cast once back to each weight's dtype.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from taperfold.passes._graph import (
    FLOAT_TYPES,
    NormMatch,
    const_array,
    derived_tensor,
    folded_source,
    is_const,
    is_fixed,
    write_const,
)
from taperfold.passes.report import FoldReport, NormEntry


class Blocked(Exception):
    """Why a norm cannot be folded where we tried; the message goes into the report."""


def describe(node: ir.Node) -> str:
    return f"'{node.name}' ({node.op_type})"


@dataclasses.dataclass(eq=False)
class _Reader:
    """A linear layer reading the norm: MatMul(x, W) or Gemm(x, W, [C]) with a constant W."""

    node: ir.Node
    root: ir.Value  # the constant behind W (an initializer or Constant output)
    tensor: ir.TensorProtocol  # its contents
    via: list[ir.Node]  # Identity/Transpose nodes between root and node
    transposed: bool  # W[d, n] = tensor.T
    reads_nd: bool  # node takes its weight as [n, d] (Gemm transB=1)
    bias: tuple[ir.Node, int] | None  # where an existing constant bias is read: (Add, i) or (Gemm, 2)

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.tensor.shape
        return (cols, rows) if self.transposed else (rows, cols)

    def weight(self) -> np.ndarray:
        """W as a new float64 [d, n] array."""
        w = self.tensor.numpy().astype(np.float64)
        return w.T if self.transposed else w


def _weight_source(value: ir.Value) -> tuple[ir.Value, ir.TensorProtocol, list[ir.Node], bool] | None:
    """(root, tensor, via, transposed) for a constant 2-D float weight, seen through Identity/Transpose."""
    via, transposed = [], False
    while (node := value.producer()) is not None and node.domain == "" and node.op_type in ("Identity", "Transpose"):
        if node.op_type == "Transpose":
            if list(node.attributes.get_ints("perm", [1, 0])) != [1, 0]:
                return None
            transposed = not transposed
        via.append(node)
        value = node.inputs[0]
    if is_fixed(value):
        tensor = value.const_value
    elif node is not None and node.op_type == "Constant" and node.domain == "":
        tensor = ir.convenience.get_const_tensor(value)
    else:
        return None
    if tensor is None or len(tensor.shape) != 2 or tensor.dtype not in FLOAT_TYPES:
        return None
    return value, tensor, via, transposed


def _bias_of(node: ir.Node, n: int) -> tuple[ir.Node, int] | None:
    """Where the layer's constant bias is read: the Add right after a MatMul, or a Gemm's C."""
    if node.op_type == "Gemm":
        if len(node.inputs) < 3 or node.inputs[2] is None:
            return None
        if not is_const(node.inputs[2]):
            raise Blocked(f"consumer {describe(node)} has a non-constant bias")
        if node.attributes.get_float("beta", 1.0) == 0:
            raise Blocked(f"consumer {describe(node)} has beta=0")
        return node, 2
    out = node.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output() or len(uses) != 1 or uses[0].node.op_type != "Add" or uses[0].node.domain != "":
        return None
    add, i = uses[0]
    bias = const_array(add.inputs[1 - i])
    if bias is None or bias.size not in (1, n) or any(dim != 1 for dim in bias.shape[:-1]):
        return None
    if bias.ndim > 1 and (out.shape is None or bias.ndim > len(out.shape)):  # would raise the output's rank
        return None
    return add, 1 - i


def _reader(node: ir.Node, index: int, match: NormMatch) -> _Reader:
    if node.domain != "" or node.op_type not in ("MatMul", "Gemm"):
        raise Blocked(f"consumer {describe(node)} is not a linear layer")
    if index != 0:
        raise Blocked(f"consumer {describe(node)} reads the norm's output as its weight")
    if node.op_type == "Gemm" and node.attributes.get_int("transA", 0):
        raise Blocked(f"consumer {describe(node)} has transA=1")
    source = _weight_source(node.inputs[1])
    if source is None:
        raise Blocked(f"consumer {describe(node)} has a non-constant weight")
    root, tensor, via, transposed = source
    reads_nd = node.op_type == "Gemm" and bool(node.attributes.get_int("transB", 0))
    reader = _Reader(node, root, tensor, via, transposed ^ reads_nd, reads_nd, None)
    d, n = reader.shape
    if d != match.scale.size:
        raise Blocked(f"consumer {describe(node)} has a weight of {d} rows for {match.scale.size} channels")
    if match.bias is not None:
        reader.bias = _bias_of(node, n)
    return reader


def plan(match: NormMatch) -> list[_Reader]:
    """Every reader of the norm's output, or Blocked naming the first one that cannot take the fold."""
    if match.output.is_graph_output():
        raise Blocked("the norm's output is a graph output")
    uses = list(match.output.uses())
    if not uses:
        raise Blocked("nothing reads the norm's output")
    return [_reader(node, index, match) for node, index in uses]


def _fold_weight(graph: ir.Graph, match: NormMatch, reader: _Reader, entry: NormEntry) -> None:
    scale, centered = match.scale[:, None], match.kind == "ln"

    def compute() -> np.ndarray:
        w = reader.weight()
        w *= scale  # in place: a large weight's float64 copy is the one temporary
        if centered:  # (I - 11ᵀ/d) on the left: subtract each column's mean over the d rows
            w -= w.mean(axis=0, keepdims=True)
        return w.T if reader.reads_nd else w

    d, n = reader.shape
    tensor = derived_tensor(compute, reader.tensor.dtype, (n, d) if reader.reads_nd else (d, n))
    path = [reader.root, *(node.outputs[0] for node in reader.via)]
    others = [u.node for v in path for u in v.uses() if u.node is not reader.node and u.node not in reader.via]
    new = write_const(graph, reader.node, 1, tensor, base=reader.root.name or reader.node.name)
    if others:
        entry.copied.append(f"{reader.root.name} -> {new.name} (also read by {describe(others[0])})")
    entry.bytes_rewritten += tensor.nbytes


def _fold_bias(graph: ir.Graph, match: NormMatch, reader: _Reader, entry: NormEntry) -> None:
    """b' = b + beta·W with the original W (Gemm: C' = C + alpha/beta_gemm·beta·W); create b if absent."""
    node = reader.node
    at, index = reader.bias or _new_bias_slot(graph, node)
    shift = match.bias @ reader.weight()
    if node.op_type == "Gemm":
        shift *= node.attributes.get_float("alpha", 1.0) / node.attributes.get_float("beta", 1.0)
    old = const_array(at.inputs[index])
    if old is None:
        tensor, base = ir.tensor(shift.astype(reader.tensor.dtype.numpy())), f"{node.name}.bias"
    else:
        tensor, base = ir.tensor((old.astype(np.float64) + shift).astype(old.dtype)), at.inputs[index].name or node.name
    write_const(graph, at, index, tensor, base=base)
    entry.bytes_rewritten += tensor.nbytes


def _new_bias_slot(graph: ir.Graph, node: ir.Node) -> tuple[ir.Node, int]:
    """An empty input that adds a bias to the layer's output: a Gemm's C, or a new Add after a MatMul."""
    if node.op_type == "Gemm":
        node.resize_inputs(3)
        node.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
        return node, 2
    out = node.outputs[0]
    add = ir.node("Add", [None, None], name=f"{node.name}_bias", metadata_props=dict(node.metadata_props))
    graph.insert_after(node, add)
    add.outputs[0].type, add.outputs[0].shape, name = out.type, out.shape, out.name
    out.replace_all_uses_with(add.outputs[0], replace_graph_outputs=True)
    add.replace_input_with(0, out)
    if add.outputs[0].is_graph_output():  # the model's output keeps its name
        out.name, add.outputs[0].name = f"{name}_unbiased", name
    return add, 1


class FoldScaleIntoConsumersPass(ir.passes.InPlacePass):
    """Fold every detected norm whose readers are all MatMul/Gemm with constant weights; keep the rest."""

    def __init__(self, report: FoldReport):
        super().__init__()
        self.report = report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for entry in self.report.norms:
            if entry.status != "detected":
                continue
            match = entry.match
            entry.consumers = [use.node.name for use in match.output.uses()]
            try:
                readers = plan(match)
            except Blocked as why:
                entry.status, entry.reason = "kept", str(why)
                continue
            for reader in readers:
                _fold_weight(model.graph, match, reader, entry)
                if match.bias is not None:
                    _fold_bias(model.graph, match, reader, entry)
            source = folded_source(match)
            for reader in readers:
                reader.node.replace_input_with(0, source)
            entry.status, entry.into = "folded", "consumers"
            modified = True
        return ir.passes.PassResult(model, modified)
