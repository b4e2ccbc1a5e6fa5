"""Graph helpers shared by the passes: constants, the matched norm, weights rewritten on save."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeGuard

import ml_dtypes
import numpy as np
import onnx_ir as ir

FLOAT_TYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE})
# dtype -> dtypes that hold every one of its values exactly: a Cast there and back is the identity.
_EXACT_WIDER = {
    ir.DataType.FLOAT16: {ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.BFLOAT16: {ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.FLOAT: {ir.DataType.DOUBLE},
}


@dataclasses.dataclass(eq=False)
class NormMatch:
    """A constant-scale norm found in the graph: output = (input [- mean(input)]) * scale [+ bias]."""

    kind: str  # "rms": a diagonal scale; "ln": mean subtraction, scale, optional bias; "dyt": scale and bias
    input: ir.Value
    output: ir.Value
    nodes: list[ir.Node]  # the norm's own nodes, in graph order (shared centering nodes included)
    scale: np.ndarray  # float64 [d], the product of the chain's constants
    bias: np.ndarray | None = None  # float64 [d], LN's beta
    centered: bool = False  # the match includes the mean subtraction, so a fold must absorb it
    # the norm's nodes a fold leaves in place, in front of `input` (DyT's Mul by α and Tanh)
    kept: list[ir.Node] = dataclasses.field(default_factory=list)

    @property
    def width(self) -> int:
        return self.scale.size


def cast_to(node: ir.Node) -> ir.DataType:
    return ir.DataType(node.attributes.get_int("to"))


def fixed_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The contents of an initializer the caller cannot override (an initializer that is also a graph input can be
    fed); None for any other value."""
    if value is None or not value.is_initializer() or value.is_graph_input():
        return None
    return value.const_value


def is_fixed(value: ir.Value | None) -> TypeGuard[ir.Value]:
    """An initializer the caller cannot override (an initializer that is also a graph input can be fed)."""
    return fixed_tensor(value) is not None


def is_const(value: ir.Value | None) -> TypeGuard[ir.Value]:
    """Constant, known without reading data: a fixed initializer or a Constant node, passed through
    Identity/Cast/Reshape nodes (unoptimized dynamo exports build e.g. ReduceMean's axes that way)."""
    if value is None:
        return False
    if is_fixed(value):
        return True
    node = value.producer()
    if node is None or node.domain != "":
        return False
    return node.op_type == "Constant" or (
        node.op_type in ("Identity", "Cast", "Reshape") and all(is_const(v) for v in node.inputs if v is not None)
    )


def node_producing(value: ir.Value | None) -> ir.Node | None:
    """The node computing `value`; None for a graph input, an initializer, or no value (an omitted input)."""
    return None if value is None else value.producer()


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """A constant value's contents (as the graph computes them, Casts applied); None if not constant (is_const)."""
    if value is None:
        return None
    if (fixed := fixed_tensor(value)) is not None:
        return fixed.numpy()
    node = value.producer()
    if node is None or node.domain != "":
        return None
    if node.op_type == "Constant":
        try:
            tensor = ir.convenience.get_const_tensor(value)
        except ValueError:  # a malformed Constant is simply not a constant we can use
            return None
        return None if tensor is None else tensor.numpy()
    if node.op_type not in ("Identity", "Cast", "Reshape"):
        return None
    array = const_array(node.inputs[0])
    if array is None or node.op_type == "Identity":
        return array
    if node.op_type == "Cast":
        return array.astype(cast_to(node).numpy())
    shape = const_array(node.inputs[1])
    if shape is None:
        return None
    dims = [int(dim) for dim in shape]
    if not node.attributes.get_int("allowzero", 0):  # 0 copies the input's dim
        dims = [array.shape[i] if dim == 0 else dim for i, dim in enumerate(dims)]
    return array.reshape(dims)


def const_producers(value: ir.Value) -> list[ir.Node]:
    """The nodes that compute a constant value (none for an initializer)."""
    node = value.producer()
    if node is None:
        return []
    return [node, *(n for v in node.inputs if v is not None for n in const_producers(v))]


def channel_const(value: ir.Value | None, other: ir.Value | None) -> np.ndarray | None:
    """A float constant that scales `other` per channel (shape [], [d] or [1, ..., 1, d]) as float64 [1] or [d].

    Leading 1-dims are accepted only when they do not raise the rank of `other`, so dropping the
    Mul/Add leaves every shape as it was.
    """
    array = const_array(value)
    if array is None or ir.DataType.from_numpy(array.dtype) not in FLOAT_TYPES:
        return None
    if any(dim != 1 for dim in array.shape[:-1]):
        return None
    if array.ndim > 1 and (other is None or other.shape is None or array.ndim > len(other.shape)):
        return None
    if array.size > 1 and other is not None and other.shape is not None and len(other.shape) > 0:
        last = other.shape[-1]
        if isinstance(last, int) and last != array.size:  # it broadcasts `other` (e.g. RoPE's outer product)
            return None
    return array.astype(np.float64).reshape(-1)


def folded_source(match: NormMatch) -> ir.Value:
    """The value the norm's readers take once the norm's arithmetic has moved into weights.

    That is the norm's input, unless the chain changed dtype: Casts that round-trip exactly (widen,
    then narrow back to the input's dtype) vanish; otherwise the chain's last Cast is kept, now
    applied to the input directly.
    """
    casts = [n for n in match.nodes if n.op_type == "Cast"]
    if not casts:
        return match.input
    dtype = match.input.dtype
    targets = [cast_to(n) for n in casts]
    if targets[-1] == dtype and all(t in _EXACT_WIDER.get(dtype, ()) for t in targets[:-1]):
        return match.input
    casts[-1].replace_input_with(0, match.input)
    return casts[-1].outputs[0]


def derived_tensor(compute: Callable[[], np.ndarray], dtype: ir.DataType, shape: Sequence[int]) -> ir.LazyTensor:
    """A weight computed in float64 and cast once to `dtype`, only when it is saved or read.

    Nothing is materialized while folding, so a large model never holds a second copy of its
    weights; sources are read through the loader's memory maps when the result is written.
    """
    return ir.LazyTensor(lambda: ir.tensor(compute().astype(dtype.numpy())), dtype=dtype, shape=ir.Shape(shape))


def past_range(compute: Callable[[], np.ndarray], dtype: ir.DataType, what: str = "weight") -> str | None:
    """Why a folded `what` (weight, bias) cannot be cast to `dtype`: the values `compute` gives (float64) reach past
    its range, so the cast would write an Inf (a NaN in formats without one) the input did not hold; None when they
    fit. Every float dtype has its limit: float16's 65504; float32's and bfloat16's near 3.4e38 (a scale of 1e20 on a
    weight of 1e20 passes it); float64's, past which the float64 product is itself Inf.
    The check computes the values once more, in float64, and lets them go."""
    if not dtype.is_floating_point():
        return None
    with np.errstate(over="ignore", invalid="ignore"):  # an Inf here is the answer, not a warning
        largest = float(np.abs(compute()).max(initial=0.0))
    limit = float(ml_dtypes.finfo(dtype.numpy()).max)  # numpy's finfo knows no bfloat16 or float8
    if largest <= limit:
        return None
    name = np.dtype(dtype.numpy()).name
    return f"the folded {what} would reach {largest:.4g}, past {name}'s range (±{limit:g})"


def add_initializer(graph: ir.Graph, base: str, tensor: ir.TensorProtocol, suffix: str = ".folded") -> ir.Value:
    """Register `tensor` as a new initializer named `base + suffix`, numbered if that name is taken."""
    name, i = f"{base}{suffix}", 1
    while name in graph.initializers:
        name, i = f"{base}{suffix}_{i}", i + 1
    tensor.name = name
    value = ir.val(name, const_value=tensor)  # its dtype and shape are the tensor's
    graph.register_initializer(value)
    return value


def write_const(graph: ir.Graph, reader: ir.Node, index: int, tensor: ir.TensorProtocol, base: str) -> ir.Value:
    """Give `reader`'s input `index` the contents `tensor`: in place when `reader` alone reads that
    initializer, else as a new initializer named after `base` (other readers keep the original)."""
    value = reader.inputs[index]
    if is_fixed(value) and not value.is_graph_output() and all(u.node is reader for u in value.uses()):
        tensor.name = value.name
        value.const_value = tensor
        return value
    new = add_initializer(graph, base, tensor)
    reader.replace_input_with(index, new)
    return new


def describe(node: ir.Node) -> str:
    """How a report names a node: "Add '/layers.0/Add'"."""
    return f"{node.op_type} '{node.name}'"


def node_label(node: ir.Node) -> str:
    """How a report lists a node: its name, or its op type when it has none."""
    return node.name or node.op_type


def with_const_producers(nodes: Sequence[ir.Node]) -> list[ir.Node]:
    """`nodes` followed by the nodes that compute the constants they read."""
    found = list(nodes)
    for node in nodes:
        for value in node.inputs:
            if value is not None and is_const(value):
                found.extend(const_producers(value))
    return found


def remove_if_dead(graph: ir.Graph, nodes: Sequence[ir.Node]) -> None:
    """Remove those of `nodes` (and of the constants they read) that nothing reads any more, last first."""
    candidates = with_const_producers(nodes)
    removed = True
    while removed:
        removed = False
        for node in reversed(candidates):
            if node.graph is graph and not any(v.uses() or v.is_graph_output() for v in node.outputs):
                inputs = [v for v in node.inputs if v is not None]
                graph.remove(node, safe=True)
                removed = True
                for value in inputs:  # an initializer only this node read
                    if (
                        value.is_initializer()
                        and value.name is not None
                        and not value.uses()
                        and not value.is_graph_output()
                        and not value.is_graph_input()
                    ):
                        graph.initializers.pop(value.name)


def sole_use(value: ir.Value) -> tuple[ir.Node, int] | None:
    """(node, input index) of the only reader of `value`, None if it has several or is a graph output."""
    uses = list(value.uses())
    return None if value.is_graph_output() or len(uses) != 1 else (uses[0].node, uses[0].idx)


def reduces_last_axis_only(node: ir.Node, rank: int | None) -> bool:
    """A Reduce* node over the last axis alone, keeping it (axes as input or attribute; `rank` of its input)."""
    if node.attributes.get_int("keepdims", 1) != 1:
        return False
    axes = const_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if axes is None:
        attr = node.attributes.get_ints("axes")
        axes = None if attr is None else np.array(attr)
    if axes is None or axes.size != 1:
        return False
    axis = int(axes.reshape(-1)[0])
    return axis == -1 or (rank is not None and axis == rank - 1)


_ELEMENTWISE = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Cast",
    "Identity",
    "Relu",
    "Gelu",
    "Tanh",
    "Sigmoid",
    "Erf",
    "Neg",
    "LayerNormalization",
    "RMSNormalization",
    "Dropout",
}


def last_dim(value: ir.Value, depth: int = 16) -> int | None:
    """The static last dimension of `value`: recorded by the exporter, or worked out from the constants it is
    computed from (an embedding table, a weight) through elementwise ops."""
    if value.shape is not None and len(value.shape) and isinstance(value.shape[-1], int):
        return value.shape[-1]
    array = const_array(value) if is_const(value) else None
    if array is not None:
        return array.shape[-1] if array.ndim else 1
    node = value.producer()
    if depth == 0 or node is None or node.domain != "":
        return None
    if node.op_type == "Gather" and node.attributes.get_int("axis", 0) == 0:
        table = fixed_tensor(node.inputs[0])
        if table is not None:
            return table.shape.numpy()[-1]
    if node.op_type == "MatMul":
        weight = fixed_tensor(node.inputs[1])
        if weight is not None:
            return weight.shape.numpy()[-1]
    if node.op_type in _ELEMENTWISE:
        dims = [last_dim(v, depth - 1) for v in node.inputs[:2] if v is not None]
        if node.op_type in ("Add", "Sub", "Mul", "Div"):
            known = [dim for dim in dims if dim is not None]
            return max(known) if len(known) == len(dims) else None
        return dims[0]
    return None
