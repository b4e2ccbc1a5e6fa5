"""ONNX Runtime runner: the CPU execution provider, or CUDA with IOBinding (`device="cuda"`).

Session construction (options, providers, the checks around it) and IOBinding set-up are functions of
their own, so that other code (a CUDA-graph runner, a tool) can open a session the same way."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from taperfold.errors import TaperfoldError, first_line
from taperfold.onnx_files import check_onnx_file
from taperfold.runners.base import InputSpec, Runner

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
DEVICES = ("cpu", "cuda")


def _ort_errors() -> tuple[type[BaseException], ...]:
    # ORT's pybind11 exceptions (Fail, InvalidArgument, NoSuchFile, ...) derive from Exception, not RuntimeError.
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException",
             "InvalidProtobuf", "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail")
    return (RuntimeError, *(getattr(state, n) for n in names if hasattr(state, n)))


def session_options(optimization: str = "all", threads: int | None = None):
    """SessionOptions for one of OPTIMIZATION_LEVELS and an intra-op thread count (None: ORT's default)."""
    import onnxruntime as ort

    levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[optimization]
    options.log_severity_level = 3  # errors only: ORT's warnings go to stderr and would break our output
    if threads is not None:
        options.intra_op_num_threads = threads
    return options


def providers_for(device: str) -> list[str]:
    import onnxruntime as ort

    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise TaperfoldError("--device cuda: this onnxruntime build has no CUDA execution provider "
                             "(install onnxruntime-gpu)")
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def open_session(path: Path, device: str = "cpu", optimization: str = "all", threads: int | None = None):
    """An InferenceSession for the model at `path` on `device`, or a one-line TaperfoldError naming the file."""
    import onnxruntime as ort

    check_onnx_file(path)
    try:
        session = ort.InferenceSession(str(path), sess_options=session_options(optimization, threads),
                                       providers=providers_for(device))
    except _ort_errors() as e:
        raise TaperfoldError(f"{path}: onnxruntime cannot load the model ({first_line(e)})") from None
    # ORT falls back to CPU with only a log line when the CUDA libraries or the GPU are missing.
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise TaperfoldError(f"{path}: onnxruntime could not start its CUDA execution provider "
                             "(no GPU, or CUDA/cuDNN libraries missing)")
    return session


@dataclass
class BoundInputs:
    """An IOBinding plus the device inputs it points at, kept alive as long as the binding is used."""

    binding: Any
    device_inputs: dict


def bind_on_cuda(session, feeds: dict, output_names: list[str]) -> BoundInputs:
    """IOBinding on CUDA device 0: host inputs are copied there once, outputs stay there, so timing sees no
    copies. OrtValues the session returned (a KV cache fed back while decoding) are already there: bound as is."""
    import onnxruntime as ort

    binding = session.io_binding()
    device_inputs = {name: value if isinstance(value, ort.OrtValue)
                     else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), "cuda", 0)
                     for name, value in feeds.items()}
    for name, value in device_inputs.items():
        binding.bind_ortvalue_input(name, value)
    for name in output_names:
        binding.bind_output(name, "cuda", 0)
    return BoundInputs(binding, device_inputs)


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
        super().__init__(str(path), device)
        self.path = Path(path)
        self.threads = threads
        self.optimization = optimization
        self.session = None

    def _load(self) -> None:
        self.session = open_session(self.path, self.device, self.optimization, self.threads)
        inputs = self.session.get_inputs()
        self._inputs = [i.name for i in inputs]
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._specs = {i.name: InputSpec(rank=len(i.shape), floating="float" in i.type) for i in inputs}

    def _prepare(self, feeds: dict[str, np.ndarray]) -> Any:
        import onnxruntime as ort

        if self.device == "cpu":
            return {name: value.numpy() if isinstance(value, ort.OrtValue) else np.ascontiguousarray(value)
                    for name, value in feeds.items()}
        return bind_on_cuda(self.session, feeds, self._outputs)

    def _run(self, prepared: Any) -> dict[str, Any]:
        try:
            if self.device == "cpu":
                return dict(zip(self._outputs, self.session.run(None, prepared)))
            self.session.run_with_iobinding(prepared.binding)
            return dict(zip(self._outputs, prepared.binding.get_outputs()))
        except _ort_errors() as e:
            raise self.error(f"onnxruntime run failed ({first_line(e)})") from None

    def _timed_run(self, prepared: Any) -> tuple[dict[str, Any], float]:
        """Wall time around one run. On CUDA, ORT exposes no CUDA events: `run_with_iobinding` returns
        only after the execution provider synchronised its stream, and `synchronize_outputs` makes sure
        of it, so the wall time covers the GPU work and no host/device copies."""
        start = time.perf_counter()
        outputs = self._run(prepared)
        if self.device == "cuda":
            prepared.binding.synchronize_outputs()
        return outputs, time.perf_counter() - start

    def to_numpy(self, value: Any) -> np.ndarray:
        import onnxruntime as ort

        return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)

    def _close(self) -> None:
        self.session = None
