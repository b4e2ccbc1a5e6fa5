"""The readers of a norm's output that can take its arithmetic, one kind per function in `READER_KINDS`.

With row vectors (y = x·W, W stored [d, n]) and s the norm's per-channel scale:
  scale only                 x·diag(s)·W                         -> W' = diag(s)·W
  with centering (LN form)   (x - mean(x))·diag(s)·W             -> W' = (I - 11ᵀ/d)·diag(s)·W
  with a shift (beta)        ... + beta·W                        -> b' = b + beta·W
All in float64 from the stored weights, cast once back to each weight's dtype.

A reader kind is a function (node, input index, match, channels) -> Reader | None: None when the node is
not of its kind, a Reader when it can take the fold, `Blocked` (with a reason a user can act on) when it is
of its kind but cannot. `channels` (a `Channels`) says where the norm's d channels sit in the value the node
reads: steps that only move whole rows of channels around (Reshape, Unsqueeze, Expand, Tile, Flatten, a
Slice or Gather of rows) pass the fold on to their own readers. Adding a kind (a fused op, another such step)
is one function here.

A linear reader's weight may be a stack of matrices, or a selection from one (transformers' MoE experts at
`batched_mm`: `Gather(experts' weights, expert ids)` read as `MatMul(W, x)`): every matrix of the stack
takes the fold, and a shift its own bias β·W_e, added after the layer (selected by the same expert ids).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import NameFixPass, ShapeInferencePass

from taperfold.passes._graph import (
    FLOAT_TYPES,
    NormMatch,
    add_initializer,
    const_array,
    derived_tensor,
    describe,
    fixed_tensor,
    folded_source,
    is_const,
    last_dim,
    node_producing,
    past_range,
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


@dataclasses.dataclass(frozen=True)
class Channels:
    """Where the norm's channels sit in a value on the way to its readers.

    Always: the value's elements, in memory order, are whole channel vectors one after another (copies
    included). `axis` (negative) is the axis that runs along a vector. `exact`: that axis holds exactly one
    vector (size d, the axes after it of size 1); otherwise it holds a run of the memory whose length is known
    only at run time (a Reshape to a run-time shape, a Tile, a Flatten), and is exactly one vector only where a
    layer contracts it against d weight rows, which a graph that runs guarantees. `rank`: the value's rank, when
    known.
    """

    axis: int = -1
    exact: bool = True
    rank: int | None = None


@dataclasses.dataclass(eq=False)
class ChannelPreservingReader(Reader):
    """A step that keeps every row of d channels intact (a Reshape to [..., d], a Slice along the sequence,
    an Unsqueeze); its own readers take the fold."""

    readers: list[Reader] = dataclasses.field(default_factory=list)

    def fold(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        for reader in self.readers:
            reader.fold(graph, match, effects)


class WeightView:
    """A layer's constant weight W as the math uses it, [..., inputs, outputs] (a stack of matrices: one per
    expert), whatever way the graph stores it (`tensor`, its last two axes swapped or not)."""

    tensor: ir.TensorProtocol
    transposed: bool

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.tensor.shape.numpy()[-2:]
        return (cols, rows) if self.transposed else (rows, cols)

    def weight(self) -> np.ndarray:
        """W as a new float64 [..., inputs, outputs] array."""
        w = self.tensor.numpy().astype(np.float64)
        return w.swapaxes(-1, -2) if self.transposed else w


@dataclasses.dataclass(eq=False)
class LinearReader(WeightView, Reader):
    """MatMul(x, W), MatMul(W, x) or Gemm(x, W, [C]) with a constant W, or W a selection of matrices from a
    constant stack (Gather / GatherND along its first axis)."""

    root: ir.Value  # the constant behind W (an initializer or Constant output)
    tensor: ir.TensorProtocol  # its contents
    via: list[ir.Node] = dataclasses.field(default_factory=list)  # Identity/Transpose/Gather nodes from W to root
    transposed: bool = False  # W[..., d, n] = tensor with its last two axes swapped
    reads_nd: bool = False  # node takes its weight as [..., n, d] (Gemm transB=1, MatMul(W, x))
    bias: tuple[ir.Node, int] | None = None  # where an existing constant bias is read: (Add, i) or (Gemm, 2)
    gather: ir.Node | None = None  # the Gather selecting W's matrices from root: the fold rewrites root there
    gathered_nd: bool = False  # the Gather reads root's matrices as [..., n, d]

    def fold(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        self._fold_weight(graph, match, effects)
        if match.bias is not None:
            self._fold_bias(graph, match, effects)

    def folded_weight(self, match: NormMatch) -> np.ndarray:
        """diag(scale)·W (centered: (I - 11ᵀ/d) first) as a new float64 [..., inputs, outputs] array. W with k·d
        rows reads k of the norm's rows joined (a per-head norm's heads): the scale, repeated k times."""
        w = self.weight()
        w *= _joined(match.scale, w.shape[-2])[:, None]  # in place: a large weight's float64 copy is the one temporary
        if match.centered:  # (I - 11ᵀ/d) on the left: subtract each column's mean over the d rows
            w -= w.mean(axis=-2, keepdims=True)
        return w

    def folded_bias(self, match: NormMatch) -> np.ndarray:
        """β·W: what the shift adds to the layer's bias (float64)."""
        w = self.weight()
        return _joined(match.bias, w.shape[-2]) @ w

    def new_bias(self, match: NormMatch) -> np.ndarray:
        """The bias the fold writes (float64): a stack's or a column's (bias_per_matrix) is β·W alone; a single row is
        the layer's own bias (none: zeros) plus β·W, times alpha/beta for a Gemm (which adds beta·C; a C the fold
        adds comes with beta 1)."""
        shift = self.folded_bias(match)
        if self.bias_per_matrix:
            return shift
        if self.node.op_type == "Gemm":
            beta = self.node.attributes.get_float("beta", 1.0) if self.bias is not None else 1.0
            shift *= self.node.attributes.get_float("alpha", 1.0) / beta
        old = self._old_bias()
        return shift if old is None else old.astype(np.float64) + shift

    @property
    def bias_dtype(self) -> ir.DataType:
        """The dtype of the bias the fold writes: the layer's own bias's, else its weight's."""
        old = None if self.bias_per_matrix else self._old_bias()
        return self.tensor.dtype if old is None else ir.DataType.from_numpy(old.dtype)

    def _old_bias(self) -> np.ndarray | None:
        return None if self.bias is None else const_array(self.bias[0].inputs[self.bias[1]])

    def _fold_weight(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        # Written where the node reads its weight, or, for a selection, where the Gather reads the whole stack.
        at, index, as_nd = (
            (self.gather, 0, self.gathered_nd)
            if self.gather is not None
            else (self.node, weight_index(self.node, self.index), self.reads_nd)
        )

        def compute() -> np.ndarray:
            w = self.folded_weight(match)
            return w.swapaxes(-1, -2) if as_nd else w

        d, n = self.shape
        stack = tuple(self.tensor.shape.numpy()[:-2])
        tensor = derived_tensor(compute, self.tensor.dtype, (*stack, *((n, d) if as_nd else (d, n))))
        path = [self.root, *(node.outputs[0] for node in self.via)]
        others = [u.node for v in path for u in v.uses() if u.node is not self.node and u.node not in self.via]
        new = write_const(graph, at, index, tensor, base=self.root.name or self.node.name or "weight")
        if others:
            effects.copied.append(f"{self.root.name} -> {new.name} (also read by {describe(others[0])})")
        effects.bytes_rewritten += tensor.nbytes

    @property
    def bias_per_matrix(self) -> bool:
        """Whether β·W is no single bias row: a stack's (one per matrix), or a column's (MatMul(W, x): [n, 1])."""
        return self.gather is not None or len(self.tensor.shape) != 2 or self.index != 0

    def _fold_bias(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        """b' = b + beta·W with the original W (Gemm: C' = C + alpha/beta_gemm·beta·W); create b if absent."""
        if self.bias_per_matrix:
            self._add_bias_per_matrix(graph, match, effects)
            return
        node = self.node
        tensor = ir.tensor(self.new_bias(match).astype(self.bias_dtype.numpy()))
        at, index = self.bias or new_bias_slot(graph, node)
        bias = at.inputs[index]
        base = f"{node.name}.bias" if self.bias is None or bias is None else bias.name or node.name or "bias"
        write_const(graph, at, index, tensor, base=base)
        effects.bytes_rewritten += tensor.nbytes

    def _add_bias_per_matrix(self, graph: ir.Graph, match: NormMatch, effects: Effects) -> None:
        """β·W_e for every matrix of the stack, as rows [1, n] (columns [n, 1] for MatMul(W, x)) that broadcast over
        the layer's output like the matrices do; for a selection of matrices, selected by the same indices."""
        shift = self.new_bias(match)  # [stack..., n]
        shift = shift[..., None, :] if self.index == 0 else shift[..., :, None]
        tensor = ir.tensor(shift.astype(self.bias_dtype.numpy()))
        add, slot = new_bias_slot(graph, self.node)
        bias = add_initializer(graph, self.root.name or self.node.name or "weight", tensor, suffix=".folded_bias")
        if self.gather is not None:
            attributes = {name: attr.value for name, attr in self.gather.attributes.items()}
            select = ir.node(
                self.gather.op_type, [bias, self.gather.inputs[1]], attributes, name=f"{self.gather.name}_bias"
            )
            select.outputs[0].dtype = self.tensor.dtype
            graph.insert_before(add, select)
            bias = select.outputs[0]
        add.replace_input_with(slot, bias)
        effects.bytes_rewritten += tensor.nbytes


def _joined(vector: np.ndarray | None, rows: int) -> np.ndarray:
    """A per-channel `vector` for a layer of `rows` input rows: itself, or repeated once per joined row."""
    assert vector is not None
    return vector if vector.size == rows else np.tile(vector, rows // vector.size)


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


def weight_source(value: ir.Value | None) -> tuple[ir.Value, ir.TensorProtocol, list[ir.Node], bool] | None:
    """(root, tensor, via, transposed) for a constant 2-D float weight, seen through Identity/Transpose."""
    source = stacked_weight_source(value)
    if source is None or source.gather is not None or len(source.tensor.shape) != 2:
        return None
    return source.root, source.tensor, source.via, source.transposed


@dataclasses.dataclass
class WeightSource:
    """A constant weight behind a layer's input: `root` holding `tensor`, reached through `via` (Identity and
    Transpose of the last two axes; at most one `gather` selecting matrices along the stack's first axis)."""

    root: ir.Value
    tensor: ir.TensorProtocol
    via: list[ir.Node]
    transposed: bool  # the node reads the tensor with its last two axes swapped
    gather: ir.Node | None = None
    gather_transposed: bool = False  # the gather reads the tensor with its last two axes swapped


def _selects_matrices(node: ir.Node) -> bool:
    """Gather(data, ids, axis=0) or GatherND(data, ids[..., 1], batch_dims=0): whole matrices of a stack."""
    if _onnx(node, "Gather"):
        return node.attributes.get_int("axis", 0) == 0
    if _onnx(node, "GatherND") and node.attributes.get_int("batch_dims", 0) == 0:
        ids = node.inputs[1]
        return ids is not None and ids.shape is not None and len(ids.shape) > 0 and ids.shape[-1] == 1
    return False


def stacked_weight_source(value: ir.Value | None) -> WeightSource | None:
    """The constant float weight of rank >= 2 behind `value`, seen through Identity, Transpose of the last two
    axes and one selection of matrices (`_selects_matrices`); None when it is not one."""
    if value is None:
        return None
    via, transposed, gather, after_gather = [], False, None, False
    while (node := value.producer()) is not None:
        if _onnx(node, "Identity"):
            pass
        elif _onnx(node, "Transpose"):
            perm = list(node.attributes.get_ints("perm", [1, 0]))
            if len(perm) < 2 or perm != [*range(len(perm) - 2), len(perm) - 1, len(perm) - 2]:
                return None
            transposed = not transposed
        elif gather is None and _selects_matrices(node) and value is node.outputs[0]:
            gather, after_gather = node, transposed
        else:
            break
        via.append(node)
        source = node.inputs[0]
        if source is None:
            return None
        value = source
    tensor = fixed_tensor(value)
    if tensor is None and node is not None and _onnx(node, "Constant"):
        tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or len(tensor.shape) < (3 if gather is not None else 2) or tensor.dtype not in FLOAT_TYPES:
        return None
    return WeightSource(value, tensor, via, transposed, gather, transposed ^ after_gather)


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


def weight_index(node: ir.Node, index: int) -> int:
    """The input of a MatMul / Gemm holding its weight when the norm's output is read at `index`."""
    return 0 if node.op_type == "MatMul" and index == 1 else 1


def linear_layer(node: ir.Node, index: int, match: NormMatch, channels: Channels) -> Reader | None:
    """MatMul(x, W) / Gemm(x, W, C) with a constant W, seen through Transpose/Identity or transB; MatMul(W, x)
    (x as a column: [..., d, 1]); W a stack of matrices or a selection from one."""
    if not _onnx(node, "MatMul", "Gemm"):
        return None
    if index != 0 and (node.op_type == "Gemm" or channels.axis != -2):  # not a column of channels
        raise Blocked(f"read by {describe(node)} as its weight")
    if node.op_type == "Gemm" and node.attributes.get_int("transA", 0) != 0:
        raise Blocked(f"read by {describe(node)} with transA=1")
    if channels.axis != (-1 if index == 0 else -2):  # the axis the layer contracts
        raise Blocked(f"read by {describe(node)}, which does not contract the channel axis")
    source = stacked_weight_source(node.inputs[weight_index(node, index)])
    if source is None:
        raise Blocked(f"read by {describe(node)} whose weight is not a constant")
    reads_nd = index == 1 or (node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0)
    reader = LinearReader(
        node,
        index,
        source.root,
        source.tensor,
        source.via,
        source.transposed ^ reads_nd,
        reads_nd,
        gather=source.gather,
    )
    reader.gathered_nd = reader.transposed ^ source.gather_transposed
    d, n = reader.shape
    # rows known only at run time hold whole channel vectors one after another: k·d weight rows read k of them
    joined = not channels.exact and d > match.width and d % match.width == 0
    if d != match.width and not joined:
        raise Blocked(f"read by {describe(node)} whose weight has {d} rows for {match.width} channels")
    if joined and match.centered:
        raise Blocked(f"read by {describe(node)} with {d // match.width} rows joined, each centered on its own")
    selection = source.via[: source.via.index(source.gather) + 1] if source.gather is not None else []
    if any(u.node not in (*source.via, node) for step in selection for u in step.outputs[0].uses()):
        raise Blocked(f"read by {describe(node)} whose selected weight is also read elsewhere")
    if match.bias is not None and reader.bias_per_matrix:
        x = node.inputs[index]
        rank = channels.rank if channels.rank is not None else None if x is None or x.shape is None else len(x.shape)
        if rank is None or rank < 2:  # a vector x: the output has no row to add β·W_e to
            raise Blocked(
                f"read by {describe(node)} with an input of unknown rank: a shift (β) needs a bias per matrix"
            )
    elif match.bias is not None:
        reader.bias = _bias_of(node, n)
    written: list[tuple[str, Callable[[NormMatch], np.ndarray], ir.DataType]] = [
        ("weight", reader.folded_weight, reader.tensor.dtype)
    ]
    if match.bias is not None:
        written.append(("bias", reader.new_bias, reader.bias_dtype))
    for what, folded, dtype in written:
        why = past_range(functools.partial(folded, match), dtype, what)
        if why:
            raise Blocked(f"read by {describe(node)}: {why}")
    return reader


def _last_element(value: ir.Value | None, depth: int = 8) -> int | ir.Value | None:
    """The last element of a shape tensor: an int, or a Value meaning "the last dimension of that value"
    (legacy exports build `view(-1, x.size(-1))`'s shape as Concat(-1, Shape(x)[-1:]) at run time).

    Kept by hand: onnx's shape inference gives the shapes of values, not what a shape tensor holds, and this reads
    through to the value whose last dimension it copies, which is the norm's width even where no dimension of it is
    recorded or inferred (a graph input of no recorded shape)."""
    for _ in range(depth):
        if value is None:
            return None
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
            if (
                ends is None
                or ends.size != 1
                or int(ends.reshape(-1)[0]) < 2**31
                or (steps is not None and int(steps.reshape(-1)[0]) != 1)
            ):
                return None
            value = node.inputs[0]
        elif node.op_type == "Gather":  # Shape(x)[-1], or Shape(x)[i] with i the last axis of x (legacy exports)
            indices, shape = const_array(node.inputs[1]), node_producing(node.inputs[0])
            if indices is None or indices.size != 1:
                return None
            index = int(indices.reshape(-1)[0])
            if index != -1 and not (
                shape is not None and _onnx(shape, "Shape") and _rank_of(shape.inputs[0]) == index + 1
            ):
                return None
            value = node.inputs[0]
        else:
            return None
    return None


_INFERRED: weakref.WeakKeyDictionary[ir.Graph, dict[ir.Value, ir.Shape]] = weakref.WeakKeyDictionary()


def _shape_of(value: ir.Value | None) -> ir.Shape | None:
    """The shape of `value`: recorded by the exporter, a constant's, or else onnx's shape inference's (legacy exports
    record no shapes), run once per graph (`_inferred_shapes`)."""
    if value is None:
        return None
    if value.shape is not None:
        return value.shape
    array = const_array(value)
    if array is not None:
        return ir.Shape(array.shape)
    graph = value.graph
    if graph is None:
        return None
    if graph not in _INFERRED:
        _INFERRED[graph] = _inferred_shapes(graph)
    return _INFERRED[graph].get(value)


def _inferred_shapes(graph: ir.Graph) -> dict[ir.Value, ir.Shape]:
    """The shape onnx's shape inference (onnx-ir's ShapeInferencePass, not strict: an op it does not know leaves its
    outputs unknown) gives each node output of `graph`, by value. It runs on a copy, so that the graph written keeps the
    shapes it records and no others. The copy takes a graph in topological order whose values are its own: a subgraph
    (it reads its parent's values) or an unsorted graph gets none."""
    try:
        copy = ir.Model(graph.clone(), ir_version=onnx.IR_VERSION)
    except ValueError:  # a value read before it is made: from a graph around it, or further down
        return {}
    NameFixPass()(copy)  # values the passes made have no name, which the inference's graph needs
    # a graph the inference rejects (its types disagree) keeps the copy as it was: no shapes, which is an answer here
    # (the readers keep what needs one), not a warning for the user
    inference_log = logging.getLogger(ShapeInferencePass.__module__)
    level = inference_log.level
    inference_log.setLevel(logging.ERROR)
    try:
        ShapeInferencePass(check_type=False, strict_mode=False)(copy)
    finally:
        inference_log.setLevel(level)
    shapes = {}
    for node, twin in zip(graph, copy.graph, strict=True):
        for value, inferred in zip(node.outputs, twin.outputs, strict=True):
            if inferred.shape is not None:
                shapes[value] = inferred.shape
    return shapes


def _rank_of(value: ir.Value | None) -> int | None:
    """The rank of `value` (`_shape_of`)."""
    shape = _shape_of(value)
    return None if shape is None else len(shape)


def _length(value: ir.Value | None) -> int | None:
    """The number of elements of a 1-D shape tensor (`_shape_of`)."""
    shape = _shape_of(value)
    return shape[0] if shape is not None and len(shape) == 1 and isinstance(shape[0], int) else None


def _axes(node: ir.Node) -> list[int] | None:
    """The axes of an Unsqueeze / Squeeze (an input from opset 13, an attribute before)."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = const_array(node.inputs[1])
        return None if array is None else [int(a) for a in array.reshape(-1)]
    axes = node.attributes.get_ints("axes", None)
    return None if axes is None else list(axes)


def _passing_on(node: ir.Node, index: int, match: NormMatch, channels: Channels) -> Reader:
    """The step `node`, whose output holds the channels as `channels` says: its own readers take the fold."""
    try:
        inner = readers_of(node.outputs[0], match, channels)
    except Blocked as why:
        raise Blocked(f"{why}, after {describe(node)}") from None
    return ChannelPreservingReader(node, index, inner)


def reshape_keeping_channels(node: ir.Node, index: int, match: NormMatch, channels: Channels) -> Reader | None:
    """Reshape(x, [..., d]): rows of d channels stay intact (GPT-2's Conv1D reads through view(-1, d)). A last
    dimension known only at run time keeps the order of the rows, which a layer contracting d channels makes
    whole again (`Channels.exact`)."""
    if not _onnx(node, "Reshape") or index != 0:
        return None
    if channels.axis != -1:
        raise Blocked(f"read by {describe(node)}, which moves the channel axis")
    last = _last_element(node.inputs[1]) if len(node.inputs) > 1 else None
    if isinstance(last, ir.Value):
        last = match.width if last is node.inputs[0] and channels.exact else last_dim(last)
    if last == -1 or (last is not None and last > match.width and last % match.width == 0):
        last = None  # rows joined (a per-head norm's heads into one row): only a layer says how many
    if last is not None and last != match.width:
        raise Blocked(
            f"read by {describe(node)} to a shape ending in {last}, "
            f"which does not keep the last dimension ({match.width})"
        )
    rank = _length(node.inputs[1]) if len(node.inputs) > 1 else None
    return _passing_on(node, index, match, Channels(-1, last is not None, rank))


def _rank(value: ir.Value | None, match: NormMatch) -> int | None:
    for v in (value, match.output, match.input):
        if v is not None and v.shape is not None:
            return len(v.shape)
    return None


def slice_keeping_channels(node: ir.Node, index: int, match: NormMatch, channels: Channels) -> Reader | None:
    """Slice / Gather along axes before the channel axis (keep the last position's logits, select rows): rows stay
    intact."""
    if not _onnx(node, "Slice", "Gather") or index != 0:
        return None
    rank = channels.rank if channels.rank is not None else _rank(node.inputs[0], match)
    axes: Sequence[int] | np.ndarray | None
    if node.op_type == "Gather":
        axes = [node.attributes.get_int("axis", 0)]
    else:
        starts = const_array(node.inputs[1])
        axes_value = node.inputs[3] if len(node.inputs) > 3 else None
        axes = (
            const_array(axes_value) if axes_value is not None else (None if starts is None else np.arange(starts.size))
        )
    if axes is None or rank is None:
        raise Blocked(f"read by {describe(node)} whose axes are not known before run time")
    if not channels.exact:
        raise Blocked(f"read by {describe(node)}, whose rows are known only at run time")
    if any(int(a) % rank - rank >= channels.axis for a in np.ravel(axes)):
        raise Blocked(f"read by {describe(node)} along the channel axis")
    if node.op_type == "Gather":
        ids = _rank_of(node.inputs[1])
        rank = None if ids is None else rank - 1 + ids
    return _passing_on(node, index, match, Channels(channels.axis, True, rank))


def rows_copied(node: ir.Node, index: int, match: NormMatch, channels: Channels) -> Reader | None:
    """Unsqueeze, Expand, Tile and Flatten copy or regroup whole rows of channels without touching them
    (transformers' MoE experts at `batched_mm`: repeat_interleave of the tokens, then a column per token)."""
    if not _onnx(node, "Unsqueeze", "Expand", "Tile", "Flatten") or index != 0:
        return None
    rank = channels.rank
    if node.op_type == "Unsqueeze":
        axes = _axes(node)
        rank = None if rank is None or axes is None else rank + len(axes)
        if axes is None or (rank is None and any(a >= 0 for a in axes)):
            raise Blocked(f"read by {describe(node)} whose axes are not known before run time")
        # from the end: every axis is negative already where the rank is unknown
        positions = axes if rank is None else [a if a < 0 else a - rank for a in axes]
        axis = channels.axis
        for position in sorted(positions, reverse=True):
            if position >= axis:  # a new axis after the channel axis
                axis -= 1
        return _passing_on(node, index, match, Channels(axis, channels.exact, rank))
    if channels.axis != -1 and node.op_type != "Expand":
        raise Blocked(f"read by {describe(node)} with the channels on axis {channels.axis}")
    if node.op_type == "Flatten":  # joins the last axes: the elements keep their order
        return _passing_on(node, index, match, Channels(-1, False, 2))
    if not channels.exact:
        raise Blocked(f"read by {describe(node)}, whose rows are known only at run time")
    if node.op_type == "Expand":  # the channel axis (size d > 1) cannot be expanded: only other axes grow
        length = _length(node.inputs[1])
        rank = None if rank is None or length is None else max(rank, length)
        return _passing_on(node, index, match, Channels(channels.axis, True, rank))
    repeats = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
    kept = (
        repeats is not None and repeats.ndim == 1 and len(repeats) > 0 and repeats[-1] == 1
    )  # the last axis as it was
    return _passing_on(node, index, match, Channels(-1, kept, rank))  # Tile: rows repeated, whole


def rows_scaled(node: ir.Node, index: int, match: NormMatch, channels: Channels) -> Reader | None:
    """Mul(x, r) with r one number per row ([..., 1], computed at run time too: Llama 4 scales each token's copy by
    its router score before the experts), or one constant number for all (Falcon-H1's µP multipliers, where the
    norm's output fans out so the chain cannot take it): every channel vector is scaled as a whole, which commutes
    with the norm's diag(s) and its centering. A shift β would be scaled with the row, so a norm with one stays."""
    other, value = (node.inputs[1 - index], node.inputs[index]) if len(node.inputs) == 2 else (None, None)
    if not _onnx(node, "Mul") or other is None or value is None:
        return None
    constant = const_array(other)
    factor = other.shape if constant is None else constant.shape
    if constant is not None and constant.size == 1:
        factor = ir.Shape([1] * constant.ndim) if constant.ndim else ir.Shape([1])
    if factor is None or len(factor) == 0 or factor[-1] != 1:
        return None
    if channels.rank is not None and len(factor) > channels.rank:
        return None  # the product gains axes: not a scaling of x's rows
    if channels.axis != -1 or not (channels.exact or last_dim(value) == match.width):
        raise Blocked(f"read by {describe(node)}, which scales rows that are not whole channel vectors")
    if match.bias is not None:
        raise Blocked(f"read by {describe(node)}, which scales each row: the norm's shift (β) would be scaled too")
    return _passing_on(node, index, match, Channels(-1, True, channels.rank))


def times_gate(node: ir.Node, index: int, match: NormMatch, channels: Channels) -> Reader | None:
    """Mul(x, g) with g of the norm's width, not computed from x (a gated norm's gate act(z), applied after the
    norm: Qwen3-Next): (x·diag(s))⊙g = (x⊙g)·diag(s), so the layers after it take the scale. A shift would be
    gated as well, and a centering does not commute with it: such norms stay."""
    other, value = (node.inputs[1 - index], node.inputs[index]) if len(node.inputs) == 2 else (None, None)
    if not _onnx(node, "Mul") or other is None or value is None or is_const(other):
        return None
    if last_dim(other) != match.width or channels.axis != -1 or not channels.exact:
        return None
    if match.bias is not None or match.centered:
        raise Blocked(f"read by {describe(node)}, a product with a gate the norm's shift or centering does not pass")
    if _computed_from(other, match.output):
        raise Blocked(f"read by {describe(node)}, a product with a value computed from the norm's output")
    rank = channels.rank
    other_rank = _rank_of(other)
    rank = None if rank is None or other_rank is None else max(rank, other_rank)
    return _passing_on(node, index, match, Channels(-1, True, rank))


def _computed_from(value: ir.Value, source: ir.Value) -> bool:
    """Whether `value` depends on `source`: the nodes after source's producer, in graph order, searched back from
    value's (a graph is in topological order, so nothing before it can)."""
    graph, start = source.graph, source.producer()
    if graph is None or start is None:
        return True
    position = {node: i for i, node in enumerate(graph)}
    first, todo, seen = position.get(start, 0), [value], set()
    while todo:
        v = todo.pop()
        if v is source:
            return True
        node = v.producer()
        if node is None or node in seen or position.get(node, -1) < first:
            continue
        seen.add(node)
        todo.extend(i for i in node.inputs if i is not None)
    return False


def shape_only(node: ir.Node, index: int, match: NormMatch, channels: Channels) -> Reader | None:
    """Shape and Size read only the shape: they never block a fold (legacy exports put one before each view)."""
    return ShapeReader(node, index) if _onnx(node, *SHAPE_OPS) else None


ReaderKind = Callable[[ir.Node, int, NormMatch, Channels], "Reader | None"]
READER_KINDS: list[ReaderKind] = [
    shape_only,
    linear_layer,
    reshape_keeping_channels,
    slice_keeping_channels,
    rows_copied,
    rows_scaled,
    times_gate,
]

_ACTIVATIONS = {"Relu", "Gelu", "Sigmoid", "Tanh", "Erf", "Softmax", "FastGelu", "BiasGelu", "Silu", "Swish"}


def _not_a_reader(node: ir.Node, index: int) -> str:
    if _onnx(node, "Add") and not all(is_const(v) for i, v in enumerate(node.inputs) if i != index):
        return f"read by {describe(node)} (residual)"
    if node.op_type in _ACTIVATIONS:
        return f"read by {describe(node)} (an activation, not linear)"
    return f"read by {describe(node)}, which is not a linear layer"


def reader_of(node: ir.Node, index: int, match: NormMatch, channels: Channels) -> Reader:
    for kind in READER_KINDS:
        if (reader := kind(node, index, match, channels)) is not None:
            return reader
    raise Blocked(_not_a_reader(node, index))


def readers_of(value: ir.Value, match: NormMatch, channels: Channels | None = None) -> list[Reader]:
    """A Reader for every use of `value` (the norm's output unless `channels` says where they are now), or
    Blocked naming the first that cannot take the fold."""
    if channels is None:
        channels = Channels(rank=_rank_of(match.output))
    if value.is_graph_output():
        raise Blocked(f"its output is the graph output '{value.name}'")
    uses = list(value.uses())
    if not uses:
        raise Blocked("nothing reads its output")
    readers = [reader_of(node, index, match, channels) for node, index in uses]
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
