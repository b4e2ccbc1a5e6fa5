"""ONNX files on disk: the one check of a model file and its external data, shared by everything that opens
one (the passes' loader, the runners, the TensorRT builder)."""

from __future__ import annotations

from pathlib import Path

from taperfold.errors import TaperfoldError, first_line


def initializers(graph):
    """Every initializer of a GraphProto and of its subgraphs (If / Loop / Scan bodies)."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            for subgraph in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from initializers(subgraph)


def _external_location(tensor, path: Path) -> tuple[Path, int]:
    """(data file, the byte it reads up to) of an externally stored tensor, or a one-line error."""
    entry = {e.key: e.value for e in tensor.external_data}
    location = entry.get("location", "")
    where = f"{path}: external data file '{location}' (initializer '{tensor.name}')"
    parts = Path(location)
    if not location or parts.is_absolute() or ".." in parts.parts:
        raise TaperfoldError(f"{where} points outside the model's directory; refusing to read it")
    try:
        offset, length = int(entry.get("offset", 0)), int(entry.get("length", 0))
    except ValueError:
        raise TaperfoldError(f"{where}: offset and length must be integers, got {entry.get('offset')!r}, "
                             f"{entry.get('length')!r}") from None
    if offset < 0 or length < 0:
        raise TaperfoldError(f"{where}: negative offset or length ({offset}, {length})")
    return path.parent / location, offset + length


def check_onnx_file(path: str | Path):
    """The model's graph (an onnx ModelProto without its weights), or a TaperfoldError naming the file if the
    model is unreadable or any external data is missing, cut short, or stored outside the model's directory.

    Runtimes fail too, but with a message about the first tensor they trip on, and may follow a location out
    of the folder; this names the file to fix. Only the graph is parsed (weights stay on disk), so it is cheap
    even for large models.
    """
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    if not path.is_file():
        raise TaperfoldError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise TaperfoldError(f"{path}: not a readable ONNX model: truncated or corrupt ({first_line(e)})") from None
    needed: dict[Path, tuple[int, str]] = {}  # data file -> (bytes the model reads from it, a tensor reading it)
    for tensor in initializers(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        data_file, end = _external_location(tensor, path)
        if end >= needed.get(data_file, (-1, ""))[0]:
            needed[data_file] = (end, tensor.name)
    for data_file, (end, name) in needed.items():
        where = f"{path}: external data file '{data_file.relative_to(path.parent)}' (initializer '{name}')"
        if not data_file.is_file():
            raise TaperfoldError(f"{where} is missing")
        if data_file.stat().st_size < end:
            raise TaperfoldError(f"{where} is too short: {data_file.stat().st_size} bytes, the model reads up to "
                                 f"byte {end}")
    return model
