"""The readers of a norm's output that can take its arithmetic, one kind per function in `READER_KINDS`.

With row vectors (y = x·W, W stored [d, n]) and s the norm's per-channel scale:
  scale only                 x·diag(s)·W                         -> W' = diag(s)·W
  with centering (LN form)   (x - mean(x))·diag(s)·W             -> W' = (I - 11ᵀ/d)·diag(s)·W
  with a shift (beta)        ... + beta·W                        -> b' = b + beta·W
All in float64 from the stored weights, cast once back to each weight's dtype.

A reader kind is a function (node, input index, match) -> Reader | None: None when the node is not of
its kind, a Reader when it can take the fold, `Blocked` (with a reason a user can act on) when it is of
its kind but cannot. Adding a kind (a fused op, another shape-keeping step) is one function here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import onnx_ir as ir

from taperfold.passes._graph import (
    FLOAT_TYPES,
    NormMatch,
    const_array,
    derived_tensor,
    describe,
    folded_source,
    is_const,
    is_fixed,
    last_dim,
    write_const,
)


class Blocked(Exception):
    """Why a norm cannot be folded where we tried; the message goes into the report."""


@dataclasses.dataclass
class Effects:
    """What a fold wrote, for the report."""

    bytes_rewritten: int = 0
    copied: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Reader:
    """A node reading the norm's output at input `index`; after `fold`, it reads the norm's input instead."""

    node: ir.Node
    index: int

    def fold(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        """Rewrite the constants this reader depends on so that it may read the norm's input."""


SHAPE_OPS = ("Shape", "Size")  # ops that read only their input's shape


class ShapeReader(Reader):
    """Reads only the shape (Shape, Size), which the fold does not change."""


@dataclasses.dataclass(eq=False)
class ChannelPreservingReader(Reader):
    """A step that keeps every row of d channels intact (a Reshape to [..., d], a Slice along the sequence);
    its own readers take the fold."""

    readers: list[Reader] = dataclasses.field(default_factory=list)

    def fold(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        for reader in self.readers:
            reader.fold(graph, match, effects)


class WeightView:
    """A layer's constant weight W as the math uses it, [inputs, outputs], whatever way the graph stores it
    (`tensor`, transposed or not)."""

    tensor: ir.TensorProtocol
    transposed: bool

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.tensor.shape
        return (cols, rows) if self.transposed else (rows, cols)

    def weight(self) -> np.ndarray:
        """W as a new float64 [inputs, outputs] array."""
        w = self.tensor.numpy().astype(np.float64)
        return w.T if self.transposed else w


@dataclasses.dataclass(eq=False)
class LinearReader(WeightView, Reader):
    """MatMul(x, W) or Gemm(x, W, [C]) with a constant W."""

    root: ir.Value = None  # the constant behind W (an initializer or Constant output)
    tensor: ir.TensorProtocol = None  # its contents
    via: list[ir.Node] = dataclasses.field(default_factory=list)  # Identity/Transpose nodes between root and node
    transposed: bool = False  # W[d, n] = tensor.T
    reads_nd: bool = False  # node takes its weight as [n, d] (Gemm transB=1)
    bias: tuple[ir.Node, int] | None = None  # where an existing constant bias is read: (Add, i) or (Gemm, 2)

    def fold(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        self._fold_weight(graph, match, effects)
        if match.bias is not None:
            self._fold_bias(graph, match, effects)

    def _fold_weight(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        scale, centered = match.scale[:, None], match.centered

        def compute() -> np.ndarray:
            w = self.weight()
            w *= scale  # in place: a large weight's float64 copy is the one temporary
            if centered:  # (I - 11ᵀ/d) on the left: subtract each column's mean over the d rows
                w -= w.mean(axis=0, keepdims=True)
            return w.T if self.reads_nd else w

        d, n = self.shape
        tensor = derived_tensor(compute, self.tensor.dtype, (n, d) if self.reads_nd else (d, n))
        path = [self.root, *(node.outputs[0] for node in self.via)]
        others = [u.node for v in path for u in v.uses() if u.node is not self.node and u.node not in self.via]
        new = write_const(graph, self.node, 1, tensor, base=self.root.name or self.node.name)
        if others:
            effects.copied.append(f"{self.root.name} -> {new.name} (also read by {describe(others[0])})")
        effects.bytes_rewritten += tensor.nbytes

    def _fold_bias(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        """b' = b + beta·W with the original W (Gemm: C' = C + alpha/beta_gemm·beta·W); create b if absent."""
        node = self.node
        at, index = self.bias or new_bias_slot(graph, node)
        shift = match.bias @ self.weight()
        if node.op_type == "Gemm":
            shift *= node.attributes.get_float("alpha", 1.0) / node.attributes.get_float("beta", 1.0)
        old = const_array(at.inputs[index])
        if old is None:
            tensor, base = ir.tensor(shift.astype(self.tensor.dtype.numpy())), f"{node.name}.bias"
        else:
            tensor = ir.tensor((old.astype(np.float64) + shift).astype(old.dtype))
            base = at.inputs[index].name or node.name
        write_const(graph, at, index, tensor, base=base)
        effects.bytes_rewritten += tensor.nbytes


def new_bias_slot(graph: ir.Graph, node: ir.Node) -> tuple[ir.Node, int]:
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


# ---- reader kinds ------------------------------------------------------------------------------------


def _onnx(node: ir.Node, *ops: str) -> bool:
    return node.domain == "" and node.op_type in ops


def shape_only(node: ir.Node, index: int, match: NormMatch) -> Reader | None:
    """Shape and Size read only the shape: they never block a fold (legacy exports put one before each view)."""
    return ShapeReader(node, index) if _onnx(node, *SHAPE_OPS) else None


def weight_source(value: ir.Value) -> tuple[ir.Value, ir.TensorProtocol, list[ir.Node], bool] | None:
    """(root, tensor, via, transposed) for a constant 2-D float weight, seen through Identity/Transpose."""
    via, transposed = [], False
    while (node := value.producer()) is not None and _onnx(node, "Identity", "Transpose"):
        if node.op_type == "Transpose":
            if list(node.attributes.get_ints("perm", [1, 0])) != [1, 0]:
                return None
            transposed = not transposed
        via.append(node)
        value = node.inputs[0]
    if is_fixed(value):
        tensor = value.const_value
    elif node is not None and _onnx(node, "Constant"):
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
            raise Blocked(f"read by {describe(node)} whose bias is not a constant")
        if node.attributes.get_float("beta", 1.0) == 0:
            raise Blocked(f"read by {describe(node)} with beta=0")
        return node, 2
    out = node.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output() or len(uses) != 1 or not _onnx(uses[0].node, "Add"):
        return None
    add, i = uses[0]
    bias = const_array(add.inputs[1 - i])
    if bias is None or bias.size not in (1, n) or any(dim != 1 for dim in bias.shape[:-1]):
        return None
    if bias.ndim > 1 and (out.shape is None or bias.ndim > len(out.shape)):  # would raise the output's rank
        return None
    return add, 1 - i


def linear_layer(node: ir.Node, index: int, match: NormMatch) -> Reader | None:
    """MatMul(x, W) / Gemm(x, W, C) with a constant W, seen through Transpose/Identity or transB."""
    if not _onnx(node, "MatMul", "Gemm"):
        return None
    if index != 0:
        raise Blocked(f"read by {describe(node)} as its weight")
    if node.op_type == "Gemm" and node.attributes.get_int("transA", 0):
        raise Blocked(f"read by {describe(node)} with transA=1")
    source = weight_source(node.inputs[1])
    if source is None:
        raise Blocked(f"read by {describe(node)} whose weight is not a constant")
    root, tensor, via, transposed = source
    reads_nd = node.op_type == "Gemm" and bool(node.attributes.get_int("transB", 0))
    reader = LinearReader(node, index, root, tensor, via, transposed ^ reads_nd, reads_nd)
    d, n = reader.shape
    if d != match.width:
        raise Blocked(f"read by {describe(node)} whose weight has {d} rows for {match.width} channels")
    if match.bias is not None:
        reader.bias = _bias_of(node, n)
    return reader


def _last_element(value: ir.Value, depth: int = 8) -> int | ir.Value | None:
    """The last element of a shape tensor: an int, or a Value meaning "the last dimension of that value"
    (legacy exports build `view(-1, x.size(-1))`'s shape as Concat(-1, Shape(x)[-1:]) at run time)."""
    for _ in range(depth):
        array = const_array(value)
        if array is not None:
            return int(array.reshape(-1)[-1]) if array.size else None
        node = value.producer()
        if node is None or node.domain != "":
            return None
        if node.op_type == "Shape":
            return node.inputs[0] if node.attributes.get_int("end", None) is None else None
        if node.op_type == "Concat" or node.op_type in ("Unsqueeze", "Squeeze", "Identity", "Cast"):
            value = node.inputs[-1] if node.op_type == "Concat" else node.inputs[0]
        elif node.op_type == "Slice":  # a slice that runs to the end keeps the last element
            ends, steps = const_array(node.inputs[2]), const_array(node.inputs[4]) if len(node.inputs) > 4 else None
            if ends is None or ends.size != 1 or int(ends.reshape(-1)[0]) < 2**31 or (
                    steps is not None and int(steps.reshape(-1)[0]) != 1):
                return None
            value = node.inputs[0]
        elif node.op_type == "Gather":
            index = const_array(node.inputs[1])
            if index is None or index.size != 1 or int(index.reshape(-1)[0]) != -1:
                return None
            value = node.inputs[0]
        else:
            return None
    return None


def reshape_keeping_channels(node: ir.Node, index: int, match: NormMatch) -> Reader | None:
    """Reshape(x, [..., d]): rows of d channels stay intact (GPT-2's Conv1D reads through view(-1, d))."""
    if not _onnx(node, "Reshape") or index != 0:
        return None
    last = _last_element(node.inputs[1]) if len(node.inputs) > 1 else None
    if isinstance(last, ir.Value):
        last = match.width if last is node.inputs[0] else last_dim(last)
    if last is None:
        raise Blocked(f"read by {describe(node)} whose target shape's last dimension is not known before run time")
    if last != match.width:
        raise Blocked(f"read by {describe(node)} to a shape ending in {last}, "
                      f"which does not keep the last dimension ({match.width})")
    try:
        inner = readers_of(node.outputs[0], match)
    except Blocked as why:
        raise Blocked(f"{why}, after {describe(node)}") from None
    return ChannelPreservingReader(node, index, inner)


def _rank(value: ir.Value, match: NormMatch) -> int | None:
    for v in (value, match.output, match.input):
        if v.shape is not None:
            return len(v.shape)
    return None


def slice_keeping_channels(node: ir.Node, index: int, match: NormMatch) -> Reader | None:
    """Slice / Gather along axes other than the last (keep the last position's logits): rows stay intact."""
    if not _onnx(node, "Slice", "Gather") or index != 0:
        return None
    rank = _rank(node.inputs[0], match)
    if node.op_type == "Gather":
        axes = [node.attributes.get_int("axis", 0)]
    else:
        starts = const_array(node.inputs[1])
        axes_value = node.inputs[3] if len(node.inputs) > 3 else None
        axes = const_array(axes_value) if axes_value is not None else (
            None if starts is None else np.arange(starts.size))
    if axes is None or rank is None:
        raise Blocked(f"read by {describe(node)} whose axes are not known before run time")
    if any(int(a) % rank == rank - 1 for a in np.ravel(axes)):
        raise Blocked(f"read by {describe(node)} along the channel axis")
    try:
        inner = readers_of(node.outputs[0], match)
    except Blocked as why:
        raise Blocked(f"{why}, after {describe(node)}") from None
    return ChannelPreservingReader(node, index, inner)


ReaderKind = Callable[[ir.Node, int, NormMatch], "Reader | None"]
READER_KINDS: list[ReaderKind] = [shape_only, linear_layer, reshape_keeping_channels, slice_keeping_channels]

_ACTIVATIONS = {"Relu", "Gelu", "Sigmoid", "Tanh", "Erf", "Softmax", "FastGelu", "BiasGelu", "Silu", "Swish"}


def _not_a_reader(node: ir.Node, index: int) -> str:
    if _onnx(node, "Add") and not all(is_const(v) for i, v in enumerate(node.inputs) if i != index):
        return f"read by {describe(node)} (residual)"
    if node.op_type in _ACTIVATIONS:
        return f"read by {describe(node)} (an activation, not linear)"
    return f"read by {describe(node)}, which is not a linear layer"


def reader_of(node: ir.Node, index: int, match: NormMatch) -> Reader:
    for kind in READER_KINDS:
        if (reader := kind(node, index, match)) is not None:
            return reader
    raise Blocked(_not_a_reader(node, index))


def readers_of(value: ir.Value, match: NormMatch) -> list[Reader]:
    """A Reader for every use of `value`, or Blocked naming the first that cannot take the fold."""
    if value.is_graph_output():
        raise Blocked(f"its output is the graph output '{value.name}'")
    uses = list(value.uses())
    if not uses:
        raise Blocked("nothing reads its output")
    readers = [reader_of(node, index, match) for node, index in uses]
    if all(isinstance(r, ShapeReader) for r in readers):
        raise Blocked("only shape readers read its output: there is no linear layer to fold into")
    return readers


def move_into_readers(graph: ir.Graph, match: NormMatch, readers: list[Reader]) -> Effects:
    """Fold the match's arithmetic into `readers` and point them at the norm's input (the match's nodes
    are left for the caller to remove once nothing reads them)."""
    effects = Effects()
    for reader in readers:
        reader.fold(graph, match, effects)
    source = folded_source(match)
    for reader in readers:
        reader.node.replace_input_with(reader.index, source)
    return effects


def why_readers_cannot(match: NormMatch) -> str:
    """Why the norm's readers cannot take the fold (FoldIntoReadersPass kept it), or "" when they could."""
    try:
        readers_of(match.output, match)
    except Blocked as why:
        return str(why)
    return ""
