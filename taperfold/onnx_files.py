"""ONNX files on disk: the one check of a model file and its external data, shared by everything that opens
one (the passes' loader, the runners, the TensorRT builder), and the check of its graph (`check_graph`)."""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from pathlib import Path

from taperfold.errors import TaperfoldError, first_line
from taperfold.infiles import check_plain_file

MAX_ELEMENTS = 2**40  # elements one tensor may claim: far above any real weight (Llama 405B's largest: 2^31)


def initializers(graph):
    """Every initializer of a GraphProto and of its subgraphs (If / Loop / Scan bodies)."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            for subgraph in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from initializers(subgraph)


def stored_tensors(graph):
    """(tensor, what it is) for every TensorProto a GraphProto stores: initializers, sparse initializers' values
    and indices, and the tensors of node attributes (a Constant's value), in the graph and its subgraphs."""
    for tensor in graph.initializer:
        yield tensor, f"initializer '{tensor.name}'"
    for sparse in graph.sparse_initializer:
        yield sparse.values, f"sparse initializer '{sparse.values.name}'"
        yield sparse.indices, f"indices of sparse initializer '{sparse.values.name}'"
    for node in graph.node:
        for attr in node.attribute:
            what = f"attribute '{attr.name}' of {_node_name(node)}"
            yield from ((t, what) for t in ([attr.t] if attr.HasField("t") else []))
            yield from ((t, what) for t in attr.tensors)
            if attr.HasField("sparse_tensor"):
                yield attr.sparse_tensor.values, what
                yield attr.sparse_tensor.indices, what
            for subgraph in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from stored_tensors(subgraph)


def _node_name(node) -> str:
    return f"node '{node.name}' ({node.op_type})" if node.name else f"an unnamed {node.op_type} node"


def _type_name(data_type: int) -> str:
    import onnx

    try:
        return onnx.TensorProto.DataType.Name(data_type)
    except ValueError:
        return str(data_type)


def _bits(data_type: int) -> int | None:
    """Bits per element of an ONNX data type; None for strings; an error for an unknown type."""
    import onnx_ir as ir

    try:
        dtype = ir.DataType(data_type)
    except ValueError:
        return -1
    if dtype == ir.DataType.STRING:
        return None
    try:
        return dtype.bitwidth
    except TypeError:  # UNDEFINED
        return -1


def tensor_bytes(tensor, where: str) -> int | None:
    """Bytes the tensor's data takes (None for strings), once its type and shape are checked: a one-line error
    for an unknown data type, a negative dimension, or more than MAX_ELEMENTS elements."""
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        raise TaperfoldError(f"{where} has a negative dimension: shape {dims}")
    elements = math.prod(dims)
    if elements > MAX_ELEMENTS:
        raise TaperfoldError(
            f"{where} claims {elements:,} elements (shape {dims}), more than the 2^40 taperfold accepts"
        )
    bits = _bits(tensor.data_type)
    if bits == -1:
        raise TaperfoldError(f"{where} has no valid data type ({_type_name(tensor.data_type)})")
    return None if bits is None else (elements * bits + 7) // 8


def _check_in_file_data(tensor, where: str) -> None:
    """The data stored in the file matches the tensor's shape (raw bytes or the typed field)."""
    import onnx

    size = tensor_bytes(tensor, where)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return  # check_onnx_file compares it with its external data file
    dims, kind = list(tensor.dims), _type_name(tensor.data_type)
    if tensor.HasField("raw_data"):
        have = len(tensor.raw_data)
        if size is None:
            raise TaperfoldError(f"{where}: a {kind} tensor cannot hold raw data")
        if have != size:
            raise TaperfoldError(f"{where} has {have} bytes of data, its shape {dims} of {kind} needs {size}")
        return
    elements = math.prod(dims)
    bits = _bits(tensor.data_type)
    if kind in ("COMPLEX64", "COMPLEX128"):
        wanted = 2 * elements
    elif bits in (2, 4):  # packed, as in raw data
        wanted = size
    else:
        wanted = elements
    field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
    have = len(getattr(tensor, field))
    if have != wanted:
        raise TaperfoldError(f"{where} has {have} values, its shape {dims} of {kind} needs {wanted}")


def _external_location(tensor, path: Path, what: str) -> tuple[Path, int]:
    """(data file, the byte it reads up to) of an externally stored tensor, or a one-line error."""
    size = tensor_bytes(tensor, f"{path}: {what}")
    entry = {e.key: e.value for e in tensor.external_data}
    location = entry.get("location", "")
    where = f"{path}: external data file '{location}' ({what})"
    parts = Path(location)
    if not location or parts.is_absolute() or ".." in parts.parts:
        raise TaperfoldError(f"{where} points outside the model's directory; refusing to read it")
    try:
        offset = int(entry.get("offset", 0))
        length = int(entry["length"]) if "length" in entry else None
    except ValueError:
        raise TaperfoldError(
            f"{where}: offset and length must be integers, got {entry.get('offset')!r}, {entry.get('length')!r}"
        ) from None
    if offset < 0 or (length is not None and length < 0):
        raise TaperfoldError(f"{where}: negative offset or length ({offset}, {length})")
    if size is None:
        raise TaperfoldError(f"{where}: a STRING tensor cannot be stored externally")
    if length is not None and length != size:
        raise TaperfoldError(
            f"{where}: length {length} bytes, its shape {list(tensor.dims)} of "
            f"{_type_name(tensor.data_type)} needs {size}"
        )
    return path.parent / location, offset + size


def check_onnx_file(path: str | Path):
    """The model's graph (an onnx ModelProto without its weights), or a TaperfoldError naming the file if the
    model is unreadable or any external data is missing, cut short, of another length than its tensor's shape
    needs, or stored outside the model's directory.

    Runtimes fail too, but with a message about the first tensor they trip on, and may follow a location out
    of the folder; this names the file to fix. Only the graph is parsed (weights stay on disk), so it is cheap
    even for large models.
    """
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    check_plain_file(path, "an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise TaperfoldError(f"{path}: not a readable ONNX model: truncated or corrupt ({first_line(e)})") from None
    needed: dict[Path, tuple[int, str]] = {}  # data file -> (bytes the model reads from it, a tensor reading it)
    for tensor, what in stored_tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        data_file, end = _external_location(tensor, path, what)
        if end >= needed.get(data_file, (-1, ""))[0]:
            needed[data_file] = (end, what)
    for data_file, (end, what) in needed.items():
        where = f"{path}: external data file '{data_file.relative_to(path.parent)}' ({what})"
        if not data_file.is_file():
            raise TaperfoldError(f"{where} is missing")
        if data_file.stat().st_size < end:
            raise TaperfoldError(
                f"{where} is too short: {data_file.stat().st_size} bytes, the model reads up to byte {end}"
            )
    return model


def check_graph(graph, path: str | Path, outer: tuple[AbstractSet[str], ...] = (), context: str = "") -> set[str]:
    """Check a GraphProto (and its subgraphs) before anything builds on it, or raise a one-line TaperfoldError
    naming the file and the node or tensor:

    - every node input and graph output is defined: a graph input, an initializer, a node's output, or (in a
      subgraph) a value of an enclosing graph; each value is defined once, each initializer named once;
    - every stored tensor (initializers, Constant values) has a valid type, no negative dimension, at most
      MAX_ELEMENTS elements, and in-file data of exactly the size its shape needs (external data is
      check_onnx_file's);
    - the nodes have no cycle. A graph whose nodes are merely out of order is sorted in place (stable: a sorted
      graph is left exactly as it was).

    Only the protobuf is read (never external weights), in time linear in its size. `outer`: the names each
    enclosing graph defines. Returns the names the graph reads from enclosing graphs.
    """
    import onnx

    where = f"{path}: {context}"
    defined: dict[str, str] = {}  # name -> "input" | "initializer"
    for value in graph.input:
        if value.name in defined:
            raise TaperfoldError(f"{where}graph input '{value.name}' is listed twice")
        defined[value.name] = "input"
    stored = [(t, t.name) for t in graph.initializer] + [(s.values, s.values.name) for s in graph.sparse_initializer]
    named: set[str] = set()
    for tensor, name in stored:
        if name in named:
            raise TaperfoldError(f"{where}initializer '{name}' is defined twice")
        named.add(name)
        defined.setdefault(name, "initializer")
        _check_in_file_data(tensor, f"{where}initializer '{name}'")
    for sparse in graph.sparse_initializer:
        _check_in_file_data(sparse.indices, f"{where}indices of sparse initializer '{sparse.values.name}'")

    nodes = graph.node
    producer: dict[str, int] = {}
    for k, node in enumerate(nodes):
        for out in filter(None, node.output):
            if out in producer:
                raise TaperfoldError(
                    f"{where}value '{out}' is written by both {_node_name(nodes[producer[out]])} and {_node_name(node)}"
                )
            if out in defined:
                raise TaperfoldError(
                    f"{where}{_node_name(node)} writes '{out}', which is already a graph {defined[out]}"
                )
            producer[out] = k
    local = defined.keys() | producer.keys()
    scopes = (local, *outer)

    deps: list[set[int]] = []
    free: set[str] = set()
    for node in nodes:
        reads = [name for name in node.input if name]
        for name in reads:
            if not any(name in scope for scope in scopes):
                raise TaperfoldError(
                    f"{where}{_node_name(node)} reads '{name}', which no graph input, initializer or node defines"
                )
        for attr in node.attribute:
            what = f"{where}attribute '{attr.name}' of {_node_name(node)}"
            for tensor in [attr.t] if attr.HasField("t") else attr.tensors:
                _check_in_file_data(tensor, what)
            for subgraph in [attr.g] if attr.HasField("g") else attr.graphs:
                inner = f"{context}in attribute '{attr.name}' of {_node_name(node)}: "
                reads += check_graph(subgraph, path, scopes, inner)
        deps.append({producer[name] for name in reads if name in producer})
        free.update(name for name in reads if name not in local)
    for value in graph.output:
        if not any(value.name in scope for scope in scopes):
            raise TaperfoldError(f"{where}graph output '{value.name}' is not defined by any node, input or initializer")
        if value.name not in local:
            free.add(value.name)

    if any(d >= k for k, ds in enumerate(deps) for d in ds):  # out of order, or a cycle
        order = _topological_order(deps)
        if len(order) < len(deps):
            cycle = _a_cycle(deps, set(range(len(deps))) - set(order))
            raise TaperfoldError(
                f"{where}nodes form a cycle, each reading the next one's output: "
                + " -> ".join(_node_name(nodes[k]) for k in cycle)
            )
        copies = []
        for k in order:
            copy = onnx.NodeProto()
            copy.CopyFrom(nodes[k])
            copies.append(copy)
        del nodes[:]
        nodes.extend(copies)
    return free


def _topological_order(deps: list[set[int]]) -> list[int]:
    """Kahn's algorithm, lowest index first: the nodes that are not on or behind a cycle, in a valid order."""
    import heapq

    waiting = [len(ds) for ds in deps]
    readers: list[list[int]] = [[] for _ in deps]
    for k, ds in enumerate(deps):
        for d in ds:
            readers[d].append(k)
    ready = [k for k, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for reader in readers[k]:
            waiting[reader] -= 1
            if not waiting[reader]:
                heapq.heappush(ready, reader)
    return order


def _a_cycle(deps: list[set[int]], stuck: set[int]) -> list[int]:
    """One cycle among the nodes Kahn's algorithm could not order (each of them reads another one), closed."""
    seen: dict[int, int] = {}
    path: list[int] = []
    k = min(stuck)
    while k not in seen:
        seen[k] = len(path)
        path.append(k)
        k = min(d for d in deps[k] if d in stuck)
    return [*path[seen[k] :], k]


# The op domains the runtimes implement themselves: ONNX's, and ONNX Runtime's contrib ops (MatMulNBits,
# GroupQueryAttention, ...; OpenVINO's ONNX frontend reads those too). Any other domain needs a custom-op library
# loaded into the runtime, and taperfold never loads one.
BUILT_IN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc"})


def check_op_domains(model, path: str | Path) -> None:
    """One line naming the first node (in the graph or a function of the model) whose op is neither a built-in
    runtime's (BUILT_IN_DOMAINS) nor a function the model itself defines: running it would take a custom-op
    library, which a model never gets to name."""
    functions = {(f.domain, f.name) for f in model.functions}
    for owner, top in [("", model.graph.node)] + [(f" in function '{f.name}'", f.node) for f in model.functions]:
        for node in (inner for outer in top for inner in _nodes_of(outer)):
            if node.domain not in BUILT_IN_DOMAINS and (node.domain, node.op_type) not in functions:
                raise TaperfoldError(
                    f"{path}: {_node_name(node)}{owner} is an op of domain '{node.domain}', which no runtime here "
                    "implements without a custom-op library; taperfold loads none"
                )


def _nodes_of(node):
    """`node` and the nodes of its subgraphs (If / Loop / Scan bodies), at any depth."""
    yield node
    for attr in node.attribute:
        for subgraph in [attr.g] if attr.HasField("g") else attr.graphs:
            for inner in subgraph.node:
                yield from _nodes_of(inner)
