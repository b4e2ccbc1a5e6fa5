"""Load and save ONNX models with their external data, turning bad input into one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx_ir as ir

from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_path


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_model(path: str | os.PathLike) -> ir.Model:
    """Load lazily (external weights stay on disk, memory-mapped when read); check the data files exist."""
    path = Path(path)
    if not path.is_file():
        raise TaperfoldError(f"{path}: no such file")
    try:
        model = ir.load(path)
    except Exception as e:  # protobuf's DecodeError and onnx's parse errors all mean the same here
        raise TaperfoldError(f"{path}: not a readable ONNX model ({first_line(e)})") from None
    if not model.ir_version:  # an empty file parses as an empty ModelProto
        raise TaperfoldError(f"{path}: not an ONNX model (no IR version)")
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if not isinstance(tensor, ir.ExternalTensor):
                continue
            data, where = Path(tensor.path), f"external data file '{tensor.location}' (initializer '{value.name}')"
            if not data.is_file():
                raise TaperfoldError(f"{path}: {where} is missing")
            if (tensor.offset or 0) + (tensor.length or 0) > data.stat().st_size:
                raise TaperfoldError(f"{path}: {where} is too short")
    return model


def _initializers(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            for subgraph in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from _initializers(subgraph)


def _point_external_data_at(path: Path, location: str) -> None:
    """The model was saved under a temporary name: make its tensors name the final data file."""
    proto = onnx.load(path, load_external_data=False)
    for tensor in _initializers(proto.graph):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(proto, path)


def save_model(model: ir.Model, dst: str | os.PathLike) -> None:
    """Write dst and its weights to dst + '.data' as temporary files, renamed into place once both are
    complete: a failure leaves any earlier dst as it was."""
    dst = Path(dst)
    try:
        with atomic_path(dst, sidecars=(".data",)) as tmp:
            ir.save(model, tmp, format="protobuf", external_data=tmp.name + ".data")
            _point_external_data_at(tmp, dst.name + ".data")
    except OSError as e:
        raise TaperfoldError(f"{dst}: cannot write ({e.strerror or first_line(e)})") from None
