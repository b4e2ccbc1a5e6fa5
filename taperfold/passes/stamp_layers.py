"""A whole model's graph from a trace of its first few decoder layers (export's layer stamping).

Tracing is most of an export's time, and it grows with the layers; yet every layer of a model whose layers are alike
exports to the same nodes. So export traces the model cut to its first three layers, layers 1 and 2 holding distinct
random weights (so that no optimizer merges two of them, or drops a multiply by one: each of their constants then
comes from one weight), and this pass makes the whole model's graph from that trace. Layer 0 stays as traced (it
shares work with what comes before the layers: a mask reads its cache's length); layers 1 and 2 are the pattern,
`first` and `template` below. A model whose first layers differ from the rest (DeepSeek-V3's dense layers before its
MoE ones) has those traced as they are too, and the two after them are the pattern:

- their nodes are matched one to one (same ops, attributes and wiring; a commutative op's operands either way);
  what `template` reads from `first` and `first` from the layer before is the chain from one layer to the next, what
  both read alike (rotary tables, masks, input ids, work layer 0 did for all) is shared, and a graph input or output
  one layer has (its cache, past_key_values.1.key) each layer has, named by its index;
- each constant that differs between the two is traced to the weight of its layer it was made from, by its name or
  the optimizer's `folded_from`, and to how (as is, transposed, or plus a number: Gemma's norms scale by 1 + γ),
  checked bit for bit against that weight's traced value;
- the layers after `template` are copies of it on their own weights, what follows the layers reads the last one,
  and `first` and `template` get their real weights back.

Anything else (a layer reading two layers back, a constant made of two weights, layers that differ) is refused before
the graph is touched, the pass's `refused` saying why; export then traces every layer.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from taperfold.passes.detect import scopes

FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"  # the onnxscript optimizer's note on a constant it computed

COMMUTATIVE = {"Add", "Mul", "Max", "Min", "Sum", "And", "Or", "Xor", "Equal"}

# how a layer's constant is made from its weight
AS_IS, TRANSPOSED, OFFSET = "as is", "transposed", "plus a number"


class StampRefused(Exception):
    """The trace's layers are not alike in a way this pass can stamp out; the message says what differs."""


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """The layers of the model a graph is stamped for, and of the trace."""

    scope: str  # module path of the layers' ModuleList as the graph's metadata names it ("hf.model.layers")
    count: int  # layers of the model
    traced: Callable[[int, str], ir.TensorProtocol]  # (layer, path in the layer) -> the weight the trace ran with
    real: Callable[[int, str], ir.TensorProtocol]  # (layer, path in the layer) -> the model's weight
    # the first of the two layers matched node for node (random weights), the other its template; the layers before
    # it stay as traced: layer 0, and the layers unlike the rest before them (DeepSeek-V3's dense first layers)
    first: int = 1

    @property
    def template(self) -> int:
        """The layer the copies are made from: the last traced."""
        return self.first + 1

    @property
    def in_trace(self) -> int:
        return self.first + 2


@dataclasses.dataclass(frozen=True)
class _Weight:
    path: str  # in the layer
    made: str  # AS_IS, TRANSPOSED or OFFSET
    offset: float = 0.0  # OFFSET's number, added in the weight's dtype as the optimizer folded it

    def of(self, weight: ir.TensorProtocol) -> ir.TensorProtocol:
        """The constant made from `weight` as this one was made from the weight the trace ran with, computed each time
        it is read or written: every layer's weights transposed at once would hold the model twice."""
        if self.made == AS_IS:
            return weight
        shape = list(weight.shape.numpy())
        if self.made == TRANSPOSED:
            shape[-2:] = shape[-1], shape[-2]
        return ir.LazyTensor(lambda: ir.tensor(self._made(_array(weight))), dtype=weight.dtype, shape=ir.Shape(shape))

    def _made(self, array: np.ndarray) -> np.ndarray:
        if self.made == TRANSPOSED:
            return np.ascontiguousarray(array.swapaxes(-1, -2))
        return array + np.asarray(self.offset, array.dtype)

    @property
    def suffix(self) -> str:
        """What the stamped constant's name adds to the weight's."""
        return {AS_IS: "", TRANSPOSED: "_transposed", OFFSET: f"_plus_{self.offset:g}"}[self.made]


def _layer_of(node: ir.Node, scope: str) -> int | None:
    for path, _ in scopes(node):
        index = path.removeprefix(scope + ".")
        if index != path and index.isdigit():
            return int(index)
    return None


def _renamed(name: str, layer: int, to: int) -> str:
    """A per-layer graph input or output's name for layer `to` (past_key_values.1.key -> past_key_values.7.key)."""
    return re.sub(rf"(?<![^.]){layer}(?=\.)", str(to), name, count=1)


def _const(value: ir.Value) -> ir.TensorProtocol:
    assert value.const_value is not None  # a constant: the callers checked
    return value.const_value


def _array(tensor: ir.TensorProtocol) -> np.ndarray:
    return np.asarray(tensor.numpy())


def _same_attributes(a: ir.Node, b: ir.Node) -> bool:
    if a.attributes.keys() != b.attributes.keys():
        return False
    for key, attr in a.attributes.items():
        other = b.attributes[key]
        if attr.type != other.type or attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return False  # subgraphs are not compared, so not stamped
        if attr.type == ir.AttributeType.TENSOR:
            if not np.array_equal(_array(attr.value), _array(other.value)):
                return False
        elif attr.value != other.value:
            return False
    return True


class _Plan:
    """What the trace's layers are made of, read before anything is changed."""

    def __init__(self, graph: ir.Graph, layers: LayerWeights):
        self.layers = layers
        self.first, self.template = layers.first, layers.template
        nodes = list(graph)
        self.per_layer_inputs = _per_layer(graph.inputs, layers.in_trace)
        self.per_layer_outputs = _per_layer(graph.outputs, layers.in_trace)
        where = {node: _layer_of(node, layers.scope) for node in nodes}
        for node in nodes:  # a node an optimizer's rule made has no module path: it is where what it reads is
            if "namespace" not in node.metadata_props:
                producers = [x.producer() for x in node.inputs if x is not None]
                made_in = {where[p] for p in producers if p is not None and where[p] is not None}
                if len(made_in) == 1:
                    where[node] = made_in.pop()
        found = sorted({i for i in where.values() if i is not None})
        if found != list(range(layers.in_trace)):
            raise StampRefused(f"the trace has layers {found} under {layers.scope}, not {list(range(layers.in_trace))}")
        self._own_cache_work(nodes, where)
        for node in self._shared_work(nodes, where):
            where[node] = None  # computed once for every layer, as before the layers
        self.where = where
        self.first_nodes = [n for n in nodes if where[n] == self.first]
        self.template_nodes = [n for n in nodes if where[n] == self.template]
        if len(self.first_nodes) != len(self.template_nodes):
            raise StampRefused(
                f"layer {self.first} has {len(self.first_nodes)} nodes, "
                f"layer {self.template} {len(self.template_nodes)}"
            )
        self.counterpart: dict[ir.Value, ir.Value] = {}  # an output of layer `first` -> layer `template`'s
        for a, b in zip(self.first_nodes, self.template_nodes, strict=True):
            if (a.domain, a.op_type, a.overload, len(a.inputs), len(a.outputs)) != (
                b.domain,
                b.op_type,
                b.overload,
                len(b.inputs),
                len(b.outputs),
            ) or not _same_attributes(a, b):
                raise StampRefused(
                    f"layer {self.first}'s node {a.name} ({a.op_type}) differs from layer {self.template}'s {b.name}"
                )
            self.counterpart.update(zip(a.outputs, b.outputs, strict=True))
        self.weights: dict[tuple[int, ir.Value], _Weight] = {}  # (layer, constant) -> its weight
        for a, b in zip(self.first_nodes, self.template_nodes, strict=True):
            try:
                self._check_inputs(a, b, a.inputs)
            except StampRefused as straight:
                # the tracer orders a sum of two lengths by its symbols' names, which differ by layer
                if not (a.domain == "" and a.op_type in COMMUTATIVE and len(a.inputs) == 2):
                    raise
                try:
                    self._check_inputs(a, b, a.inputs[::-1])
                except StampRefused:
                    raise straight from None  # why the operands in their own order differ
        self._check_readers(graph)

    def _check_inputs(self, a: ir.Node, b: ir.Node, inputs) -> None:
        for slot, (x1, x2) in enumerate(zip(inputs, b.inputs, strict=True)):
            self._check_input(a, b, slot, x1, x2)

    def _own_cache_work(self, nodes: list[ir.Node], where: dict) -> None:
        """A node outside the layers that reads one layer's cache inputs alone, for that layer alone (the exporter
        reads each input's length before the layers), belongs to that layer."""
        cache_of: dict[ir.Value, int] = dict(self.per_layer_inputs)
        owned: dict[ir.Node, int] = {}
        for node in nodes:
            if where[node] is not None:
                continue
            owners = {cache_of[x] for x in node.inputs if x is not None and x in cache_of}
            if len(owners) == 1 and all(x in cache_of or x.producer() is None for x in node.inputs if x is not None):
                owned[node] = owners.pop()
                cache_of.update(dict.fromkeys(node.outputs, owned[node]))
        for node in reversed(nodes):
            layer = owned.get(node)
            users = [user for out in node.outputs for user, _ in out.uses()]
            if layer is not None and users and all(where[user] == layer for user in users):
                where[node] = layer

    def _shared_work(self, nodes: list[ir.Node], where: dict) -> list[ir.Node]:
        """Layer `first`'s nodes that the exporter's optimizer kept for both it and layer `template` (common
        subexpressions): they read no activation, cache input or weight of their layer, and layer `template` reads
        them (or what it reads is made from them)."""
        varying = set(self.per_layer_inputs)
        independent = []
        for node in nodes:
            layer = where[node]
            if layer is None:
                continue
            if any(x in varying or self._is_weight(x, layer) for x in node.inputs if x is not None):
                varying.update(node.outputs)
            elif layer == self.first:
                independent.append(node)
        shared: set[ir.Node] = set()
        for node in reversed(independent):
            if any(where[user] == self.template or user in shared for out in node.outputs for user, _ in out.uses()):
                shared.add(node)
        return [node for node in independent if node in shared]

    def _is_weight(self, value: ir.Value, layer: int) -> bool:
        return (
            layer in (self.first, self.template)
            and value.const_value is not None
            and value.producer() is None
            and self._weight(value, layer) is not None
        )

    def _made_in(self, value: ir.Value) -> int | None:
        producer = value.producer()
        return self.where.get(producer) if producer is not None else None

    def _check_input(self, a: ir.Node, b: ir.Node, slot: int, x1: ir.Value | None, x2: ir.Value | None) -> None:
        differs = StampRefused(
            f"layer {self.template}'s node {b.name} reads input {slot} unlike layer {self.first}'s {a.name}"
        )
        if x1 is None or x2 is None:
            if x1 is not x2:
                raise differs
            return
        made_in = self._made_in(x2)
        if made_in == self.template:  # within the layer
            if self.counterpart.get(x1) is not x2:
                raise differs
        elif made_in == self.first:  # the chain: what each layer reads from the one before
            if self._made_in(x1) != self.first - 1:
                raise differs
        elif x2 in self.per_layer_inputs:  # its cache, named by its index
            if x1 not in self.per_layer_inputs or _renamed(x2.name or "", self.template, self.first) != x1.name:
                raise differs
        elif x2.const_value is not None and x2.producer() is None:
            self._check_constant(b, x1, x2, differs)
        elif x1 is not x2:  # one value for every layer (made before the layers, or by layer 0 for all)
            raise differs

    def _check_constant(self, b: ir.Node, x1: ir.Value, x2: ir.Value, differs: StampRefused) -> None:
        w1, w2 = self._weight(x1, self.first), self._weight(x2, self.template)
        if w1 is None and w2 is None:
            if x1 is not x2 and not np.array_equal(_array(_const(x1)), _array(_const(x2))):
                raise differs
        elif w1 is None or w2 is None or w1 != w2:
            raise StampRefused(
                f"layer {self.template}'s node {b.name} reads a weight unlike layer {self.first}'s ({w1} / {w2})"
            )
        else:
            self.weights[self.first, x1], self.weights[self.template, x2] = w1, w2

    def _weight(self, value: ir.Value, layer: int) -> _Weight | None:
        """The weight of `layer` that `value` (a constant) was made from, and how; None: made of no layer's weight.
        Besides that weight, the optimizer's `folded_from` may name constants made before the layers (Gemma's 1)."""
        named = [value.name or ""]
        if FOLDED_FROM in value.metadata_props:
            named = ast.literal_eval(value.metadata_props[FOLDED_FROM])
        prefix = self.layers.scope + "."
        ours = [name for name in named if name.startswith(prefix)]
        if not any(name.startswith(f"{prefix}{layer}.") for name in ours):
            return None  # made before the layers or in layer 0 (Falcon's constants, one for all): shared, if alike
        if len(ours) != 1:
            raise StampRefused(f"constant {value.name} of layer {layer} is made from {named}")
        path = ours[0].removeprefix(f"{prefix}{layer}.")
        try:
            traced = self.layers.traced(layer, path)
        except (AttributeError, KeyError) as e:
            raise StampRefused(f"constant {value.name}: no weight {path} in layer {layer}") from e
        array = _array(_const(value))
        for weight in self._ways(path, traced, array, alone=len(named) == 1):
            made = _array(weight.of(traced))
            if made.dtype == array.dtype and made.shape == array.shape and made.tobytes() == array.tobytes():
                return weight
        raise StampRefused(f"constant {value.name} is {path} of layer {layer}, changed in a way not stamped")

    @staticmethod
    def _ways(path: str, traced: ir.TensorProtocol, array: np.ndarray, alone: bool) -> list[_Weight]:
        """How a constant `array` may have been made from weight `traced`: as is or transposed where the weight is
        all it was made from; plus the number the two differ by (in the weight's dtype) where it was made with other
        constants too."""
        if alone:
            return [_Weight(path, AS_IS), _Weight(path, TRANSPOSED)]
        weight = _array(traced)
        if not np.issubdtype(weight.dtype, np.floating) or weight.shape != array.shape:
            return []
        difference = np.median(array.astype(np.float64) - weight.astype(np.float64))
        return [_Weight(path, OFFSET, float(np.asarray(difference, weight.dtype)))]

    def _check_readers(self, graph: ir.Graph) -> None:
        """Layer `first`'s values are read by it or the next layer, or are its cache outputs; layer `template`'s are
        read by it or what follows the layers, or are its cache outputs, as layer `first`'s are."""
        for v1, v2 in self.counterpart.items():
            if (v1 in self.per_layer_outputs) != (v2 in self.per_layer_outputs) or (
                v2 in self.per_layer_outputs and _renamed(v2.name or "", self.template, self.first) != v1.name
            ):
                raise StampRefused(f"graph output {v2.name or v1.name} of one layer has no counterpart in the other")
            if v2 in graph.outputs and v2 not in self.per_layer_outputs:
                raise StampRefused(f"graph output {v2.name} is made in layer {self.template}")
            for user, _ in v1.uses():
                if self.where.get(user) not in (self.first, self.template):
                    raise StampRefused(
                        f"node {user.name} outside layers {self.first} and {self.template} reads {v1.name}"
                    )
            for user, _ in v2.uses():
                if self.where.get(user) in range(self.template):
                    raise StampRefused(f"node {user.name} of an earlier layer reads layer {self.template}'s {v2.name}")


def _per_layer(values, traced: int) -> dict[ir.Value, int]:
    """The graph inputs or outputs one per layer (a cache: past_key_values.3.key), by their layer."""
    names = {v.name for v in values}
    out = {}
    for v in values:
        for match in re.finditer(r"(?<![^.])(\d+)(?=\.)", v.name or ""):
            layer = int(match.group(1))
            if any(_renamed(v.name or "", layer, other) in names for other in range(traced) if other != layer):
                out[v] = layer
                break
    return out


class StampLayersPass(ir.passes.InPlacePass):
    """The whole model's graph from a trace of its first layers (see the module docstring); or, where the trace's
    layers are not alike in a way it stamps out, the graph as it was and `refused` saying why."""

    def __init__(self, layers: LayerWeights):
        super().__init__()
        self.layers = layers
        self.refused: str | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, layers = model.graph, self.layers
        try:
            plan = _Plan(graph, layers)  # reads the graph, changes nothing
        except StampRefused as refused:
            self.refused = str(refused)
            return ir.passes.PassResult(model, modified=False)
        self.refused = None
        made: dict[tuple[int, _Weight], ir.Value] = {}

        def weight(layer: int, w: _Weight) -> ir.Value:
            if (layer, w) not in made:
                tensor = w.of(layers.real(layer, w.path))
                name = f"{layers.scope}.{layer}.{w.path}{w.suffix}"
                made[layer, w] = value = ir.Value(
                    name=name,
                    shape=ir.Shape(tensor.shape.numpy()),
                    type=ir.TensorType(tensor.dtype),
                    const_value=tensor,
                )
                graph.register_initializer(value)
            return made[layer, w]

        for _, old in plan.weights:  # random values: replaced below, in the copies and the traced layers alike
            graph.initializers.pop(old.name or "", None)
        inputs = _by_layer(plan.per_layer_inputs)
        outputs = _by_layer(plan.per_layer_outputs)
        template_inputs = inputs.get(plan.template, [])
        previous = {v: v for v in plan.counterpart.values()}  # layer `template`'s values, as the last layer's
        copies: list[ir.Node] = []
        for layer in range(layers.in_trace, layers.count):
            current: dict[ir.Value, ir.Value] = {}
            cache = {
                x: ir.Value(name=_renamed(x.name or "", plan.template, layer), shape=x.shape, type=x.type)
                for x in template_inputs
            }
            for node in plan.template_nodes:
                copy = ir.Node(
                    node.domain,
                    node.op_type,
                    [self._input(x, layer, plan, current, previous, cache, weight) for x in node.inputs],
                    list(node.attributes.values()),
                    overload=node.overload,
                    num_outputs=len(node.outputs),
                    version=node.version,
                    name=f"{node.name}_layer{layer}",
                    metadata_props={k: self._moved(v, layer) for k, v in node.metadata_props.items()},
                )
                for old, new in zip(node.outputs, copy.outputs, strict=True):
                    new.name = (
                        _renamed(old.name or "", plan.template, layer)
                        if old in plan.per_layer_outputs
                        else f"{old.name}_layer{layer}"
                    )
                    new.shape, new.type = old.shape, old.type
                    current[old] = new
                copies.append(copy)
            inputs[layer] = [cache[x] for x in template_inputs]
            outputs[layer] = [current[v] for v in outputs.get(plan.template, [])]
            previous = current
        for (layer, old), w in plan.weights.items():
            for user, slot in list(old.uses()):
                user.replace_input_with(slot, weight(layer, w))
        copied = set(copies)
        for v2, last in previous.items():  # what follows the layers reads the last one
            for user, slot in list(v2.uses()):
                if last is not v2 and plan.where.get(user) != plan.template and user not in copied:
                    user.replace_input_with(slot, last)
        graph.insert_after(plan.template_nodes[-1], copies)
        self._order(graph.inputs, inputs)
        self._order(graph.outputs, outputs)
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _input(x, layer, plan, current, previous, cache, weight) -> ir.Value | None:
        """What a copy of layer `template`'s node reads in layer `layer` where the template reads `x`."""
        if x is None:
            return None
        if x in current:
            return current[x]
        if plan._made_in(x) == plan.first:  # the chain
            return previous[plan.counterpart[x]]
        if x in cache:
            return cache[x]
        if (plan.template, x) in plan.weights:
            return weight(layer, plan.weights[plan.template, x])
        return x

    @staticmethod
    def _order(values, per_layer: dict[int, list[ir.Value]]) -> None:
        """The graph's inputs or outputs: those no layer has, then each layer's in layer order."""
        layered = {v for vs in per_layer.values() for v in vs}
        ordered = [v for v in values if v not in layered] + [v for layer in sorted(per_layer) for v in per_layer[layer]]
        values.clear()
        values.extend(ordered)

    def _moved(self, text: str, layer: int) -> str:
        """Node metadata naming layer `template`'s modules, naming layer `layer`'s."""
        return re.sub(
            rf"{re.escape(self.layers.scope)}\.{self.layers.template}(?![0-9])", f"{self.layers.scope}.{layer}", text
        )


def _by_layer(per_layer: dict[ir.Value, int]) -> dict[int, list[ir.Value]]:
    out: dict[int, list[ir.Value]] = {}
    for value, layer in per_layer.items():
        out.setdefault(layer, []).append(value)
    return out
