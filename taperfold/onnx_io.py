"""Load and save ONNX models with their external data, turning bad input into one-line errors."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx_ir as ir

from taperfold.errors import TaperfoldError, first_line
from taperfold.fsutil import atomic_path
from taperfold.onnx_files import check_graph, check_onnx_file, initializers


def load_model(path: str | os.PathLike) -> ir.Model:
    """Load lazily (external weights stay on disk, memory-mapped when read), after checking the file and its
    external data (taperfold.onnx_files.check_onnx_file) and its graph (check_graph: every value defined, no
    duplicate initializer, every stored tensor's shape and in-file data, no cycle), so that a malformed model
    is one line naming the node or tensor, before any pass sees it."""
    path = Path(path)
    proto = check_onnx_file(path)
    if not proto.ir_version:  # an empty file parses as an empty ModelProto
        raise TaperfoldError(f"{path}: not an ONNX model (no IR version)")
    if not len(proto.graph.node) and not proto.graph.output:  # a few stray bytes parse as a ModelProto too
        raise TaperfoldError(f"{path}: not an ONNX model (no graph: no nodes and no outputs)")
    check_graph(proto.graph, path)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # noqa: BLE001 - SerdeError, or what the parts onnx_ir does not wrap raise: all unreadable
        raise TaperfoldError(f"{path}: not a readable ONNX model ({first_line(e)})") from None
    ir.external_data.set_base_dir(model.graph, os.path.dirname(path))  # as ir.load does: weights beside the file
    return model


def _point_external_data_at(path: Path, location: str) -> None:
    """The model was saved under a temporary name: make its tensors name the final data file."""
    proto = onnx.load(path, load_external_data=False)
    for tensor in initializers(proto.graph):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(proto, path)


def save_model(model: ir.Model, dst: str | os.PathLike, before_commit: Callable[[Path], None] | None = None) -> None:
    """Write dst and its weights to dst + '.data' as temporary files, renamed into place once both are
    complete: a failure leaves any earlier dst as it was. `before_commit` is given the complete temporary model
    (its weights beside it) before the renames: what it raises leaves nothing written either."""
    dst = Path(dst)
    try:
        with atomic_path(dst, sidecars=(".data",)) as tmp:
            ir.save(model, tmp, format="protobuf", external_data=tmp.name + ".data")
            if before_commit is not None:
                before_commit(tmp)
            _point_external_data_at(tmp, dst.name + ".data")
    except OSError as e:
        raise TaperfoldError(f"{dst}: cannot write ({e.strerror or first_line(e)})") from None
