"""ONNX Runtime runner: the CPU execution provider, or CUDA with IOBinding (`device="cuda"`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from taperfold.errors import TaperfoldError
from taperfold.runners.base import Runner

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
DEVICES = ("cpu", "cuda")


def _ort_errors() -> tuple[type[BaseException], ...]:
    # ORT's pybind11 exceptions (Fail, InvalidArgument, NoSuchFile, ...) derive from Exception, not RuntimeError.
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException",
             "InvalidProtobuf", "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail")
    return (RuntimeError, *(getattr(state, n) for n in names if hasattr(state, n)))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_onnx_file(path: Path) -> None:
    """Raise a TaperfoldError naming the file if the model or any of its external data is missing or cut short.

    ORT would fail too, but with a message about the first tensor it trips on; this names the file to fix.
    Only the graph is parsed (weights stay on disk), so it is cheap even for large models.
    """
    import onnx
    from google.protobuf.message import DecodeError

    if not path.is_file():
        raise TaperfoldError(f"{path}: no such model file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise TaperfoldError(f"{path}: not a readable ONNX model: truncated or corrupt ({_first_line(e)})") from None
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


class OrtRunner(Runner):
    """`threads`: intra-op threads (None: ORT's default, one per physical core); `optimization`: the graph
    optimization level, one of OPTIMIZATION_LEVELS."""

    name = "onnxruntime"

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None, optimization: str = "all"):
        if device not in DEVICES:
            raise TaperfoldError(f"onnxruntime device must be one of {DEVICES}, got {device!r}")
        if optimization not in OPTIMIZATION_LEVELS:
            raise TaperfoldError(f"onnxruntime optimization level must be one of {OPTIMIZATION_LEVELS}, "
                                 f"got {optimization!r}")
        if threads is not None and threads < 1:
            raise TaperfoldError(f"onnxruntime threads must be at least 1, got {threads}")
        super().__init__(device)
        self.path = Path(path)
        self.threads = threads
        self.optimization = optimization
        self.session = None

    def load(self) -> None:
        import onnxruntime as ort

        check_onnx_file(self.path)
        levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                  "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[self.optimization]
        options.log_severity_level = 3  # errors only: ORT's warnings go to stderr and would break our output
        if self.threads is not None:
            options.intra_op_num_threads = self.threads
        providers = ["CPUExecutionProvider"]
        if self.device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise TaperfoldError("--device cuda: this onnxruntime build has no CUDA execution provider "
                                     "(install onnxruntime-gpu)")
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        try:
            session = ort.InferenceSession(str(self.path), sess_options=options, providers=providers)
        except _ort_errors() as e:
            raise TaperfoldError(f"{self.path}: onnxruntime cannot load the model ({_first_line(e)})") from None
        # ORT falls back to CPU with only a log line when the CUDA libraries or the GPU are missing.
        if self.device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise TaperfoldError(f"{self.path}: onnxruntime could not start its CUDA execution provider "
                                 "(no GPU, or CUDA/cuDNN libraries missing)")
        self.session = session

    def _require_session(self):
        if self.session is None:
            raise TaperfoldError(f"{self.path}: runner used before load()")
        return self.session

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self._require_session().get_inputs()]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self._require_session().get_outputs()]

    def prepare(self, feeds: dict[str, np.ndarray]) -> Any:
        session = self._require_session()
        missing = [n for n in self.input_names if n not in feeds]
        unknown = [n for n in feeds if n not in self.input_names]
        if missing or unknown:
            raise TaperfoldError(f"{self.path}: inputs do not match the model (missing {missing}, unknown {unknown})")
        import onnxruntime as ort

        if self.device == "cpu":
            return {name: value.numpy() if isinstance(value, ort.OrtValue) else np.ascontiguousarray(value)
                    for name, value in feeds.items()}
        # Inputs are copied to the GPU once here; outputs stay on the device, so timing sees no copies.
        # OrtValues this runner returned (a KV cache fed back while decoding) are already there: bound as is.
        binding = session.io_binding()
        device_inputs = {name: value if isinstance(value, ort.OrtValue)
                         else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), "cuda", 0)
                         for name, value in feeds.items()}
        for name, value in device_inputs.items():
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, "cuda", 0)
        return _Bound(binding, device_inputs)

    def run(self, prepared: Any) -> dict[str, Any]:
        session = self._require_session()
        try:
            if self.device == "cpu":
                return dict(zip(self.output_names, session.run(None, prepared)))
            session.run_with_iobinding(prepared.binding)
            return dict(zip(self.output_names, prepared.binding.get_outputs()))
        except _ort_errors() as e:
            raise TaperfoldError(f"{self.path}: onnxruntime run failed ({_first_line(e)})") from None

    def timed_run(self, prepared: Any) -> tuple[dict[str, Any], float]:
        """Wall time around one run. On CUDA, ORT exposes no CUDA events: `run_with_iobinding` returns
        only after the execution provider synchronised its stream, and `synchronize_outputs` makes sure
        of it, so the wall time covers the GPU work and no host/device copies."""
        start = time.perf_counter()
        outputs = self.run(prepared)
        if self.device == "cuda":
            prepared.binding.synchronize_outputs()
        return outputs, time.perf_counter() - start

    def to_numpy(self, value: Any) -> np.ndarray:
        import onnxruntime as ort

        return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)

    def close(self) -> None:
        self.session = None


@dataclass
class _Bound:
    """An IOBinding plus the device inputs it points at, kept alive as long as the binding is used."""

    binding: Any
    device_inputs: dict
