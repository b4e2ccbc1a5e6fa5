"""Find the norms of an exported graph. A pure analysis: `detect_norms(model)` changes nothing.

Three things are told apart:

- **candidates**: constant-scale norms, what TaperNorm / TaperLN compute at g = 0, and the only things a
  fold may remove. RMS form (`h * c * weight_tilde`): a chain of Muls by constants (scalars or
  per-channel [d] vectors, either operand order), possibly with Cast/Identity steps in between. LN form
  (`(h - h.mean(-1, keepdim=True)) * c * weight_tilde + bias`): ReduceMean(h, last axis) -> Sub(h, mean)
  -> that chain -> optional Add(., beta). The centering may be shared by several chains (parallel
  residual blocks read one input through two norms, and the exporter computes its mean once). DyT form
  (`tanh(alpha * h) * weight + bias`): Mul(h, scalar) -> Tanh -> that chain -> Add(., beta); the fold takes
  the chain and keeps the Tanh.
- **real norms**: anything that divides by a statistic of its input, x·rsqrt(mean(x²)+ε),
  (x−μ)/sqrt(var+ε), or a fused op (LayerNormalization, RMSNormalization, ORT's Simplified/Skip
  variants). A Mul by γ after one looks exactly like a candidate chain; it is the real norm's gain, and
  is never folded by default.
- **tapered layers at g ≠ 0** (TaperNorm / TaperLN in the dynamo exporter's metadata whose nodes compute
  statistics): not foldable.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import NamedTuple, TypeGuard

import numpy as np
import onnx_ir as ir

from taperfold.norms import NormKind, kind_of_class, norm_kinds, tapered_kind_of_class
from taperfold.passes._graph import (
    FLOAT_TYPES,
    NormMatch,
    cast_to,
    channel_const,
    const_array,
    is_const,
    last_dim,
    node_producing,
    reduces_last_axis_only,
    sole_use,
    with_const_producers,
)

_REDUCES = {"ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2"}
GATE_NOT_ZERO = "gate ≠ 0: the layer still computes per-token statistics; export it at g = 0"


@dataclasses.dataclass(eq=False)
class Candidate:
    """A constant-scale norm: a fold may move its arithmetic into the weights around it."""

    name: str
    match: NormMatch
    # the exporter's metadata places it in modules none of which is a norm: the model's own per-channel scale
    # (Gemma 3n's AltUp output scale), folded all the same
    outside_norm: bool = False

    @property
    def note(self) -> str:
        """What a report says of it besides its status."""
        if not self.outside_norm:
            return ""
        return "no norm module: a per-channel scale the model applies itself, which folds as a g = 0 norm does"

    @property
    def kind(self) -> str:
        return self.match.kind


@dataclasses.dataclass(eq=False)
class RealNorm:
    """A norm that computes statistics of its input; `gain` is its γ (and β) chain when it has one."""

    name: str
    kind: str
    form: str  # what it computes, for the report
    gain: NormMatch | None = None
    fused: ir.Node | None = None  # the fused op (LayerNormalization, ...) whose scale/bias inputs are the gain


@dataclasses.dataclass(eq=False)
class GateNotZero:
    name: str
    kind: str


@dataclasses.dataclass
class NormAnalysis:
    candidates: list[Candidate]
    real_norms: list[RealNorm]
    gate_not_zero: list[GateNotZero]
    order: list[str]  # every name above, in graph order

    def __bool__(self) -> bool:
        return bool(self.order)


def scopes(node: ir.Node) -> list[tuple[str, str]]:
    """(module path, class) of each module around `node`, outermost first.

    Read from the dynamo exporter's `namespace` metadata, e.g.
    ": m.LM/model.layers.0.input_layernorm: taperfold.nn.TaperNorm/mul: aten.mul.Tensor"
    (the last segment is the op itself; the same classes are in `pkg.torch.onnx.class_hierarchy`).
    """
    segments = node.metadata_props.get("namespace", "").split("/")[:-1]
    return [(path, cls) for path, _, cls in (seg.rpartition(": ") for seg in segments)]


# ---- constant-scale chains -------------------------------------------------------------------------


def _data_index(node: ir.Node) -> int | None:
    """Which input a chain step passes along: a Mul by a per-channel constant, a float Cast or an Identity."""
    if node.domain != "" or len(node.outputs) != 1:
        return None
    if node.op_type == "Identity" or (node.op_type == "Cast" and cast_to(node) in FLOAT_TYPES):
        source = node.inputs[0]
        dtype = _dtype_of(source)
        if source is None or is_const(source) or (dtype is not None and dtype not in FLOAT_TYPES):
            return None  # a Cast from integers starts positions (RoPE), not a norm
        return 0
    if node.op_type == "Mul" and len(node.inputs) == 2:
        a, b = node.inputs
        if a is not None and not is_const(a) and channel_const(b, a) is not None:
            return 0
        if b is not None and not is_const(b) and channel_const(a, b) is not None:
            return 1
    return None


def _data_input(node: ir.Node) -> ir.Value | None:
    """The value a chain step passes along (`_data_index`); None when `node` is no chain step."""
    i = _data_index(node)
    return None if i is None else node.inputs[i]


def _step_factor(node: ir.Node) -> np.ndarray | None:
    """The per-channel constant a Mul chain step multiplies by, as float64 [1] or [d]; None for any other node."""
    i = _data_index(node)
    if i is None or node.op_type != "Mul":
        return None
    return channel_const(node.inputs[1 - i], node.inputs[i])


_SAME_DTYPE = {"Unsqueeze", "Squeeze", "Reshape", "Expand", "Transpose", "Slice", "Identity", "Flatten", "Range"}


def _dtype_of(value: ir.Value | None, depth: int = 8) -> ir.DataType | None:
    """The value's element type, looked up through dtype-keeping ops when the exporter did not record it."""
    for _ in range(depth):
        if value is None:
            return None
        if value.dtype is not None:
            return value.dtype
        if is_const(value):
            array = const_array(value)
            return None if array is None else ir.DataType.from_numpy(array.dtype)
        node = value.producer()
        if node is None or node.domain != "" or (node.op_type not in _SAME_DTYPE and node.op_type != "Gather"):
            return None
        value = node.inputs[0]
    return None if value is None else value.dtype


def _from_integers(value: ir.Value) -> bool:
    node = value.producer()
    if node is None or node.domain != "" or node.op_type != "Cast":
        return False
    dtype = _dtype_of(node.inputs[0])
    return dtype is not None and dtype not in FLOAT_TYPES


def _continues(node: ir.Node) -> bool:
    """Whether `node` is a chain step whose data input is the sole output of another chain step."""
    data = _data_input(node)
    prev = data.producer() if data is not None else None
    return prev is not None and _data_index(prev) is not None and sole_use(prev.outputs[0]) is not None


def _chain_from(start: ir.Node) -> list[ir.Node]:
    chain = [start]
    while (use := sole_use(chain[-1].outputs[0])) is not None and _data_index(use[0]) == use[1]:
        chain.append(use[0])
    return chain


def _chain_scale(chain: list[ir.Node], centered_input: ir.Value | None) -> np.ndarray | None:
    """Product of the chain's constants as float64 [d]. None unless one of them is a per-channel vector, or the
    chain scales a centered input (`centered_input`: h of h - mean(h)) by scalars alone and ends the chain: a
    weightless LayerNorm (OLMo) at g = 0 is (h - mean)·c, the same c for each of h's d channels."""
    scale, d = np.ones(1), None
    for node in chain:
        factor = _step_factor(node)
        if factor is None:  # a Cast or Identity step
            continue
        if factor.size > 1:
            if d not in (None, factor.size):
                return None
            d = factor.size
        scale = scale * factor
    if d is not None:
        return scale
    if centered_input is None or any(_data_index(u.node) == u.idx for u in chain[-1].outputs[0].uses()):
        return None  # no centering, or a factor that chains reading on share (parallel norms with equal c)
    d = last_dim(centered_input)
    return None if d is None else np.full(d, scale[0])


def _shared_prefix(x: ir.Value) -> tuple[list[ir.Node], ir.Value]:
    """Scalar chain steps in front of `x` whose output only chain steps read, several of them: two norms of a
    parallel block read one input, and when their c are equal (calibration gives equal c to two norms of one
    input) the exporter computes (h - mean)·c once for both. Outermost first; each chain includes them. Returns
    them and the value the first of them reads (`x` when there are none)."""
    prefix: list[ir.Node] = []
    while (node := x.producer()) is not None and (data := _data_input(node)) is not None and not x.is_graph_output():
        if any(_data_index(u.node) != u.idx for u in x.uses()):
            break
        if (factor := _step_factor(node)) is not None and factor.size > 1:
            break  # a per-channel step is a chain of its own, not a shared factor
        prefix.insert(0, node)
        x = data
    return prefix, x


def _is_last_axis_mean(node: ir.Node | None, h: ir.Value | None) -> TypeGuard[ir.Node]:
    if node is None or h is None or node.op_type != "ReduceMean" or node.domain != "" or node.inputs[0] is not h:
        return False
    return reduces_last_axis_only(node, len(h.shape) if h.shape is not None else None)


def _centering(x: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """(h, [ReduceMean, Sub]) when x = Sub(h, ReduceMean(h, last axis)) and only constant-scale chain steps read x
    (possibly several: parallel-residual exports share one centering between two norms)."""
    sub = x.producer()
    if sub is None or sub.op_type != "Sub" or sub.domain != "" or len(sub.inputs) != 2:
        return None
    h, mean_value = sub.inputs
    mean = node_producing(mean_value)
    if h is None or mean_value is None or not _is_last_axis_mean(mean, h) or mean_value.is_graph_output():
        return None
    if any(u.node.op_type != "Sub" or u.node.inputs[0] is not h or u.idx != 1 for u in mean_value.uses()):
        return None
    if x.is_graph_output() or any(_data_index(u.node) != u.idx for u in x.uses()):
        return None
    return h, [mean, sub]


def _scaled_elementwise(x: ir.Value, op_type: str) -> list[ir.Node] | None:
    """[Mul, op] when x = op(a·h) for a scalar constant a (DyT: tanh(α·h)), else None."""
    node = x.producer()
    if node is None or node.op_type != op_type or node.domain != "" or len(node.inputs) != 1:
        return None
    mul = node_producing(node.inputs[0])
    if (
        mul is None
        or mul.op_type != "Mul"
        or mul.domain != ""
        or len(mul.inputs) != 2
        or sole_use(mul.outputs[0]) is None
    ):
        return None
    for i in (0, 1):
        factor = channel_const(mul.inputs[1 - i], mul.inputs[i])
        if not is_const(mul.inputs[i]) and factor is not None and factor.size == 1:
            return [mul, node]
    return None


def _with_bias(match: NormMatch) -> NormMatch:
    """The match extended by an Add of a per-channel constant (LN's beta) that alone reads its output."""
    use = sole_use(match.output)
    if use is None or use[0].op_type != "Add" or use[0].domain != "":
        return match
    add, i = use
    beta = channel_const(add.inputs[1 - i], add.inputs[i])
    if beta is None or is_const(add.inputs[i]):
        return match
    beta = np.broadcast_to(beta, match.scale.shape).copy()
    return dataclasses.replace(match, output=add.outputs[0], nodes=[*match.nodes, add], bias=beta)


def match_norm(start: ir.Node) -> NormMatch | None:
    """The constant-scale chain that starts at `start`, as the first norm kind whose pattern it fits
    (taperfold.norms: a centering before it when the kind is `centered`, an Add of β after it when the kind
    has a `shift`), or None."""
    start_input = _data_input(start)
    if start_input is None or _continues(start):
        return None
    shared, x = _shared_prefix(start_input)
    chain = [*shared, *_chain_from(start)]
    centering = _centering(x)
    scale = _chain_scale(chain, centering[0] if centering else None)
    if scale is None or _from_integers(x):  # positions times RoPE frequencies: a broadcast, not a scale
        return None
    for kind in norm_kinds():
        kept = _scaled_elementwise(x, kind.elementwise) if kind.elementwise else []
        if kept is None:
            continue
        if kind.centered:
            if centering is None:
                continue
            h, head = centering
            match = NormMatch(kind.name, h, chain[-1].outputs[0], [*head, *chain], scale, centered=True)
        else:
            match = NormMatch(kind.name, x, chain[-1].outputs[0], chain, scale, kept=kept)
        return _with_bias(match) if kind.shift else match
    return None


# ---- real norms ------------------------------------------------------------------------------------


_STAT_STEPS = {"Add", "Sqrt", "Reciprocal", "Div", "Pow", "Cast", "Max", "Clip", "Identity"}
_SQUARE_STEPS = {"Pow", "Cast", "Identity", "Mul", "Abs"}


def _strip_casts(value: ir.Value) -> ir.Value:
    while (
        (node := value.producer()) is not None
        and node.domain == ""
        and node.op_type in ("Cast", "Identity")
        and (source := node.inputs[0]) is not None
    ):
        value = source
    return value


def _same(a: ir.Value, b: ir.Value) -> bool:
    """The same value up to Casts, or two nodes of one op on the same inputs (an exporter without CSE
    computes x - mean twice)."""
    a, b = _strip_casts(a), _strip_casts(b)
    if a is b:
        return True
    pa, pb = a.producer(), b.producer()
    return (
        pa is not None
        and pb is not None
        and pa.op_type == pb.op_type
        and pa.domain == pb.domain
        and list(pa.inputs) == list(pb.inputs)
        and a.index() == b.index()
    )


def _statistic_of(r: ir.Value, depth: int = 8) -> list[ir.Value]:
    """The values r is a root-mean statistic of: walking up from r through eps-adds, roots, reciprocals and
    Casts to a reduction, then from its input through squares and Casts. Empty when r is no such statistic."""
    frontier, reduces, roots = [r], [], False
    for _ in range(depth):
        next_frontier: list[ir.Value] = []
        for value in frontier:
            node = value.producer()
            if node is None or node.domain != "":
                continue
            if node.op_type in _REDUCES:
                reduces.append(node)
                roots |= node.op_type == "ReduceL2"
            elif node.op_type in _STAT_STEPS:
                roots |= node.op_type in ("Sqrt", "Pow")
                next_frontier.extend(v for v in node.inputs if v is not None and not is_const(v))
        frontier = next_frontier
    if not roots:  # softmax divides by a sum too, but takes no root
        return []
    bases = []
    for reduce in reduces:
        base = reduce.inputs[0]
        for _ in range(depth):
            if base is None:
                break
            bases.append(base)
            node = base.producer()
            if node is None or node.domain != "" or node.op_type not in _SQUARE_STEPS:
                break
            data = [v for v in node.inputs if v is not None and not is_const(v)]
            if not data or (node.op_type == "Mul" and (len(data) != 2 or not _same(data[0], data[1]))):
                break
            base = data[0]
    return bases


def normalizes(node: ir.Node) -> ir.Value | None:
    """For Mul(x, r) / Div(x, r) where r is a root-mean statistic of x (x·rsqrt(mean(x²)+ε),
    (x−μ)/sqrt(var+ε)), the x; else None."""
    if node.domain != "" or node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
        return None
    for i in (0, 1) if node.op_type == "Mul" else (0,):
        x, r = node.inputs[i], node.inputs[1 - i]
        if x is None or r is None or is_const(r) or is_const(x):
            continue
        if any(_same(base, x) for base in _statistic_of(r)):
            return x
    return None


def _fused_kind(node: ir.Node) -> NormKind | None:
    """The kind of a fused norm op (LayerNormalization, RMSNormalization, ORT's Simplified/Skip variants)."""
    if node.domain not in ("", "com.microsoft"):
        return None
    return next((kind for kind in norm_kinds() if node.op_type in kind.fused_ops), None)


def _reduces(node: ir.Node) -> bool:
    """Whether `node` reduces over an axis (a Reduce* op, a fused norm op): what computing a statistic takes."""
    return (node.domain == "" and node.op_type.startswith("Reduce")) or _fused_kind(node) is not None


def _real_norm_at(value: ir.Value) -> tuple[NormKind, str, ir.Node] | None:
    """(kind, form, node) when `value` is the output of a real norm's normalization, before its gain."""
    node = value.producer()
    if node is None:
        return None
    if (kind := _fused_kind(node)) is not None:
        return kind, node.op_type, node
    x = normalizes(node)
    if x is None:
        return None
    centered = _centering_of(x)
    kind = next((k for k in norm_kinds() if k.gated and k.centered == centered), None)
    if kind is None:
        return None
    return kind, "(x−mean)/sqrt(var+ε)" if centered else "x·rsqrt(mean(x²)+ε)", node


def _centering_of(x: ir.Value) -> bool:
    sub = x.producer()
    return (
        sub is not None
        and sub.op_type == "Sub"
        and sub.domain == ""
        and len(sub.inputs) == 2
        and _is_last_axis_mean(node_producing(sub.inputs[1]), sub.inputs[0])
    )


def _gain_of(value: ir.Value, kind: NormKind, chains: dict[ir.Value, NormMatch]) -> NormMatch | None:
    """The γ chain (and β) reading a real norm's normalized output, seen through nothing but chain steps."""
    match = chains.get(value)
    if match is None:
        return None
    return _with_bias(match) if kind.shift else match


def _fused_gain(node: ir.Node, kind: NormKind) -> NormMatch | None:
    """A fused norm's scale (and bias) as a gain applied to its output, when they are constant vectors."""
    out = node.outputs[0]
    scale_at, bias_at = kind.fused_ops[node.op_type]
    scale = channel_const(node.inputs[scale_at], out) if len(node.inputs) > scale_at else None
    if scale is None or scale.size == 1:
        return None
    bias = None
    if bias_at is not None and len(node.inputs) > bias_at and node.inputs[bias_at] is not None:
        bias = channel_const(node.inputs[bias_at], out)
        if bias is None:
            return None
        bias = np.broadcast_to(bias, scale.shape).copy()
    return NormMatch(kind.name, out, out, [], scale, bias)


# ---- module metadata -------------------------------------------------------------------------------


class _NormModule(NamedTuple):
    path: str
    cls: str  # the class name
    kind: NormKind


def _norm_module(node: ir.Node) -> _NormModule | None:
    """The innermost normalization module around `node`: a tapered norm, or a class a norm kind claims (RMSNorm,
    LayerNorm, LlamaRMSNorm, ...)."""
    for path, cls in reversed(scopes(node)):
        name = cls.rpartition(".")[2]
        if (kind := kind_of_class(name)) is not None:
            return _NormModule(path or name, name, kind)
    return None


def norm_name(nodes: list[ir.Node]) -> str:
    """The module path of the norm (dynamo metadata), else its first node's name."""
    for node in nodes:
        if (module := _norm_module(node)) is not None:
            return module.path
    for node in nodes:
        if (around := scopes(node)) and around[-1][0]:
            return around[-1][0]
    return nodes[0].name or nodes[0].op_type


def _owned_nodes(match: NormMatch) -> set[ir.Node]:
    """The match's nodes, those it keeps, and the nodes that compute the constants they read."""
    return set(with_const_producers([*match.kept, *match.nodes]))


def detect_norms(model: ir.Model) -> NormAnalysis:
    """Every candidate, real norm and tapered layer at g ≠ 0 of the main graph, in graph order."""
    graph = model.graph
    position = {node: i for i, node in enumerate(graph)}
    found: list[tuple[int, Candidate | RealNorm | GateNotZero]] = []

    matches = [m for node in graph if (m := match_norm(node)) is not None]
    by_input: dict[ir.Value, NormMatch] = {}
    for m in matches:
        by_input.setdefault(m.input, m)

    # Real norms by pattern: the normalization, then (optionally) its gain chain.
    gains: set[NormMatch] = set()
    real_nodes: set[ir.Node] = set()
    for node in graph:
        if (real := _real_norm_at(node.outputs[0]) if node.outputs else None) is None:
            continue
        kind, form, at = real
        module = _norm_module(at)
        if module is not None and tapered_kind_of_class(module.cls):  # a tapered layer that computes statistics
            real_nodes.add(at)
            continue  # reported from its metadata below
        fused = at if _fused_kind(at) is not None else None
        gain = _fused_gain(at, kind) if fused else _gain_of(at.outputs[0], kind, by_input)
        if gain is not None and not fused:
            gains.add(by_input[at.outputs[0]])
        name = norm_name([at, *(gain.nodes if gain else [])])
        real_nodes.add(at)
        found.append((position[at], RealNorm(name, kind.name, form, gain, fused)))

    # Real norms and tapered layers at g ≠ 0 by metadata: a norm module with nodes outside every matched chain
    # computes per-token statistics, and a chain inside it is just its γ. A tapered layer's own nodes outside them
    # are statistics only where one reduces over its features: the others are a gated norm's gate, h·act(z).
    owned = set().union(*(_owned_nodes(m) for m in matches))
    modules: dict[str, tuple[_NormModule, list[ir.Node]]] = {}
    for node in graph:
        if (module := _norm_module(node)) is not None:
            modules.setdefault(module.path, (module, []))[1].append(node)
    with_stats = {
        path: (module, nodes)
        for path, (module, nodes) in modules.items()
        if any(not tapered_kind_of_class(module.cls) or _reduces(n) for n in nodes if n not in owned)
    }
    stats_nodes = {n for _, nodes in with_stats.values() for n in nodes}
    named = {entry.name for _, entry in found}
    for path, (module, nodes) in with_stats.items():
        if path in named:
            continue
        if (tapered := tapered_kind_of_class(module.cls)) is not None:
            found.append((position[nodes[0]], GateNotZero(path, tapered.name)))
        else:
            found.append((position[nodes[0]], RealNorm(path, module.kind.name, module.cls, None)))

    counts = Counter(node for m in matches for node in m.nodes)
    for m in matches:
        if m in gains or stats_nodes.intersection(m.nodes) or real_nodes.intersection(m.nodes):
            continue
        own = [node for node in m.nodes if counts[node] == 1] or m.nodes  # a shared centering names neither
        # a bare constant scale in no norm module is the model's own; a match with a kept element-wise op (DyT's
        # tanh) is a norm by its form, whatever class wrote it
        outside_norm = not m.kept and any(scopes(n) for n in own) and all(_norm_module(n) is None for n in own)
        found.append((position[m.nodes[0]], Candidate(norm_name(own), m, outside_norm)))

    found.sort(key=lambda pair: pair[0])
    items = [item for _, item in found]
    seen: dict[str, int] = {}
    for item in items:  # a module applied twice gives two norms of one name
        seen[item.name] = seen.get(item.name, 0) + 1
        if seen[item.name] > 1:
            item.name = f"{item.name}#{seen[item.name]}"
    return NormAnalysis(
        candidates=[i for i in items if isinstance(i, Candidate)],
        real_norms=[i for i in items if isinstance(i, RealNorm)],
        gate_not_zero=[i for i in items if isinstance(i, GateNotZero)],
        order=[i.name for i in items],
    )


def subgraph_candidates(model: ir.Model) -> list[tuple[Candidate, str]]:
    """The constant-scale norms inside subgraphs (If branches, Loop and Scan bodies, at any depth), each named by its
    path (`if/then_branch/mul`, never a main-graph norm's name) with where it sits. The fold rewrites the main graph
    only (a subgraph may read an outer weight under its own conditions), so these stay in place, with that said."""
    found: list[tuple[Candidate, str]] = []

    def visit(graph: ir.Graph, prefix: str = "") -> None:
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    bodies = [attr.as_graph()]
                elif attr.type == ir.AttributeType.GRAPHS:
                    bodies = list(attr.as_graphs())
                else:
                    continue
                for i, body in enumerate(bodies):
                    path = f"{prefix}{node.name or node.op_type}/{attr.name}{f'[{i}]' if len(bodies) > 1 else ''}/"
                    where = f"inside the {attr.name} of {node.op_type} '{node.name}'"
                    for candidate in detect_norms(ir.Model(body, ir_version=model.ir_version)).candidates:
                        found.append((dataclasses.replace(candidate, name=path + candidate.name), where))
                    visit(body, path)

    visit(model.graph)
    return found
