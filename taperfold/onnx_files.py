"""Checks on ONNX files on disk, shared by everything that opens one (runners, builders)."""

from __future__ import annotations

from pathlib import Path

from taperfold.errors import TaperfoldError, first_line


def check_onnx_file(path: str | Path):
    """The model's graph (an onnx ModelProto without its weights), or a TaperfoldError naming the file if the model
    or any of its external data is missing or cut short.

    Runtimes fail too, but with a message about the first tensor they trip on; this names the file to fix.
    Only the graph is parsed (weights stay on disk), so it is cheap even for large models.
    """
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    if not path.is_file():
        raise TaperfoldError(f"{path}: no such model file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise TaperfoldError(f"{path}: not a readable ONNX model: truncated or corrupt ({first_line(e)})") from None
    needed: dict[Path, int] = {}  # data file -> bytes the model reads from it
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entry = {e.key: e.value for e in tensor.external_data}
        data_file = path.parent / entry.get("location", "")
        end = int(entry.get("offset", 0)) + int(entry.get("length", 0))
        needed[data_file] = max(needed.get(data_file, 0), end)
    for data_file, end in needed.items():
        if not data_file.is_file():
            raise TaperfoldError(f"{data_file}: external data of {path.name} is missing")
        if data_file.stat().st_size < end:
            raise TaperfoldError(f"{data_file}: external data of {path.name} is truncated "
                                 f"({data_file.stat().st_size} bytes, the model reads up to byte {end})")
    return model
