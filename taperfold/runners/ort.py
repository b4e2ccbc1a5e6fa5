"""ONNX Runtime runner: the CPU execution provider, or CUDA with IOBinding (`device="cuda"`), optionally replaying
CUDA graphs (`cuda_graph=True`).

Session construction (options, providers, the checks around it) and IOBinding set-up are functions of
their own, so that other code (a tool) can open a session the same way.

CUDA graphs (the CUDA execution provider's `enable_cuda_graph`): a graph replays fixed device addresses, so each
input shape gets its own slot: an IOBinding with device inputs and outputs at fixed addresses and its own graph
id (RunOptions `gpu_graph_id`, 1, 2, ...). A slot is made on the first call with its shape: one run without
capture (`gpu_graph_id` -1) lets ONNX Runtime allocate the outputs, which the slot then keeps as its fixed
output buffers; then runs with the slot's id until ONNX Runtime has captured it (it wants regular runs first to
settle its memory arena; 1.31 captures on the third). Later calls write new values into the slot's inputs
(`update_inplace`, in `prepare`, untimed) and replay. A decode step feeds back the previous step's outputs: those
are the next slot's inputs already, so steady-state decoding copies nothing. Session creation fails when a node
would run on the CPU; that is reported as one line. taperfold's own KV-cached decoders always fail so in
ONNX Runtime 1.31 (measured on an H100: 5 shape nodes on the CPU at opset 23, 45 at opset 20): their
past length changes every step, so decode slots serve graphs whose every node runs on the GPU.

Static-cache decoders (`*.static.onnx`: a `cache_position` input, the cache a fixed-size buffer) run with IOBinding
on every device, as onnxruntime-genai's past_present_share_buffer does: each `present.{i}.key|value` output is bound
to the very buffer fed as `past_key_values.{i}.key|value`, which the graph's ScatterElements then updates in place
(ONNX Runtime's kernel skips its copy when input and output are one buffer). A step feeds back the presents it
returned, so the cache never moves and every step has one shape: one CUDA-graph slot serves all the steps."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from taperfold.engines import OPTIMIZATION_LEVELS
from taperfold.errors import TaperfoldError, first_line
from taperfold.exportdir import CACHE_POSITION, PAST, shared_cache_buffers
from taperfold.onnx_files import check_onnx_file, check_op_domains
from taperfold.runners.base import InputSpec, Runner, RunnerError

DEVICES = ("cpu", "cuda")


INSTALL_HINT = "pip install 'taperfold[onnxruntime]' (CPU), or 'taperfold[onnxruntime-gpu]' (CUDA)"


def onnxruntime():
    """The onnxruntime module, or one line saying how to install it: taperfold leaves the choice of build (CPU or
    CUDA, two packages that write one module) to its extras."""
    try:
        import onnxruntime
    except ImportError:
        raise TaperfoldError(f"onnxruntime is not installed: {INSTALL_HINT}") from None
    return onnxruntime


def _ort_errors() -> tuple[type[BaseException], ...]:
    # ORT's pybind11 exceptions (Fail, InvalidArgument, NoSuchFile, ...) derive from Exception, not RuntimeError.
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = (
        "Fail",
        "InvalidArgument",
        "NoSuchFile",
        "NoModel",
        "EngineError",
        "RuntimeException",
        "InvalidProtobuf",
        "ModelLoaded",
        "NotImplemented",
        "InvalidGraph",
        "EPFail",
    )
    return (RuntimeError, *(getattr(state, n) for n in names if hasattr(state, n)))


def session_options(optimization: str = "all", threads: int | None = None):
    """SessionOptions for one of OPTIMIZATION_LEVELS and an intra-op thread count (None: ORT's default)."""
    ort = onnxruntime()

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[optimization]
    # fatal only: warnings would break our output, and ORT's errors come back as exceptions that we report in one
    # line (on an H100 a refused graph capture printed ORT's own error line above ours)
    options.log_severity_level = 4
    if threads is not None:
        options.intra_op_num_threads = threads
    return options


def providers_for(device: str, cuda_graph: bool = False) -> list:
    ort = onnxruntime()

    if device == "cpu":
        if cuda_graph:
            raise TaperfoldError("--cuda-graph needs --device cuda")
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise TaperfoldError(
            "--device cuda: this onnxruntime build has no CUDA execution provider (install onnxruntime-gpu)"
        )
    # fp32 graphs compute in fp32: the CUDA provider's default TF32 matmuls put an fp32 fold 5e-4 away from its
    # reference on an H100, far outside fp32 tolerances (fp16 / bf16 graphs are unaffected)
    options = {"use_tf32": "0", **({"enable_cuda_graph": "1"} if cuda_graph else {})}
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def _is_growing_decoder(model) -> bool:
    names = [i.name for i in model.graph.input]
    return any(n.startswith(PAST) for n in names) and CACHE_POSITION not in names


def _has_bf16_outputs(model) -> bool:
    import onnx

    return any(o.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for o in model.graph.output)


def open_session(
    path: Path, device: str = "cpu", optimization: str = "all", threads: int | None = None, cuda_graph: bool = False
):
    """An InferenceSession for the model at `path` on `device`, or a one-line TaperfoldError naming the file."""
    ort = onnxruntime()

    ort.set_default_logger_severity(4)  # ONNX Runtime's own lines (a provider library it cannot load) stay quiet

    header = check_onnx_file(path)
    check_op_domains(header, path)
    try:
        session = ort.InferenceSession(
            str(path), sess_options=session_options(optimization, threads), providers=providers_for(device, cuda_graph)
        )
    except _ort_errors() as e:
        if cuda_graph:  # e.g. "... cannot use the graph capture feature ... not been partitioned to the CUDA EP"
            why = (
                "a KV-cached decoder: its past grows every step, and ONNX Runtime keeps the shape arithmetic "
                "that follows from it on the CPU; CUDA graphs are for prefill graphs, see "
                "docs/benchmarks.md#ort-decode-and-cuda-graphs"
                if _is_growing_decoder(header)
                else "every node must run on the GPU"
            )
            raise TaperfoldError(
                f"{path}: --cuda-graph: onnxruntime cannot capture this model as one CUDA graph "
                f"({why}; {first_line(e)})"
            ) from None
        if device == "cpu" and _has_bf16_outputs(header):  # e.g. "Could not find an implementation for Mul(14)"
            raise TaperfoldError(
                f"{path}: a bf16 graph: onnxruntime's CPU provider has no bf16 kernels for it "
                f"({first_line(e)}); run it with --device cuda, or check an fp16 or fp32 export "
                "on the CPU"
            ) from None
        raise TaperfoldError(f"{path}: onnxruntime cannot load the model ({first_line(e)})") from None
    # ORT falls back to CPU with only a log line when the CUDA libraries or the GPU are missing.
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise TaperfoldError(
            f"{path}: onnxruntime could not start its CUDA execution provider (no GPU, or CUDA/cuDNN libraries missing)"
        )
    return session


@dataclass
class BoundInputs:
    """An IOBinding plus the device inputs it points at, kept alive as long as the binding is used."""

    binding: Any
    device_inputs: dict


def device_copy(array: np.ndarray, device: str):
    """An OrtValue on `device` holding a copy of `array`, in memory ONNX Runtime owns: outputs bound to it (a static
    cache's present) stay valid after the binding is gone, and the graph never writes into the caller's array (an
    OrtValue made from a numpy array on the CPU would share that array's memory, freed with it)."""
    ort = onnxruntime()

    array = np.ascontiguousarray(array)
    value = ort.OrtValue.ortvalue_from_shape_and_type(array.shape, array.dtype, device, 0)
    value.update_inplace(array)
    return value


def bind_io(
    session, feeds: dict, output_names: list[str], device: str = "cuda", shared: dict[str, str] | None = None
) -> BoundInputs:
    """IOBinding on `device` (CUDA device 0, or the CPU): host inputs are copied there once, outputs stay there, so
    timing sees no copies. OrtValues the session returned (a KV cache fed back while decoding) are already there:
    bound as is. `shared` (output name -> input name): outputs bound to their input's buffer, a static cache's
    present to its past, which the graph then updates in place."""
    ort = onnxruntime()

    binding = session.io_binding()
    device_inputs = {
        name: value if isinstance(value, ort.OrtValue) else device_copy(value, device) for name, value in feeds.items()
    }
    for name, value in device_inputs.items():
        binding.bind_ortvalue_input(name, value)
    for name in output_names:
        if shared and name in shared:
            binding.bind_ortvalue_output(name, device_inputs[shared[name]])
        else:
            binding.bind_output(name, device, 0)
    return BoundInputs(binding, device_inputs)


def queued_run_options():
    """RunOptions whose run returns once its work is queued on the device: ONNX Runtime synchronizes the execution
    providers at the end of every run unless told not to (a run config key of onnxruntime_run_options_config_keys.h);
    the caller synchronizes instead (IOBinding.synchronize_outputs)."""
    ort = onnxruntime()

    options = ort.RunOptions()
    options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return options


class OrtRunner(Runner):
    """`threads`: intra-op threads (None: ORT's default, one per physical core); `optimization`: the graph
    optimization level, one of OPTIMIZATION_LEVELS."""

    name = "onnxruntime"

    def __init__(
        self,
        path: str | Path,
        device: str = "cpu",
        threads: int | None = None,
        optimization: str = "all",
        cuda_graph: bool = False,
    ):
        if device not in DEVICES:
            raise TaperfoldError(f"onnxruntime device must be one of {DEVICES}, got {device!r}")
        if optimization not in OPTIMIZATION_LEVELS:
            raise TaperfoldError(
                f"onnxruntime optimization level must be one of {OPTIMIZATION_LEVELS}, got {optimization!r}"
            )
        if threads is not None and threads < 1:
            raise TaperfoldError(f"onnxruntime threads must be at least 1, got {threads}")
        if cuda_graph and device != "cuda":
            raise TaperfoldError("--cuda-graph needs --device cuda")
        super().__init__(str(path), device)
        self.path = Path(path)
        self.threads = threads
        self.optimization = optimization
        self.cuda_graph = cuda_graph
        self.session: Any = None  # an onnxruntime.InferenceSession once loaded
        self._queued: Any = None
        self._sync_binding: Any = None  # CUDA: RunOptions that queue a run, a binding to synchronize with
        self.setup_log: list[tuple[str, tuple, float]] = []  # ("capture", shape signature, seconds) per slot
        self._shared: dict[str, str] = {}  # a static decoder's present -> past: one buffer each (shared_cache_buffers)
        self._slots: dict[tuple, GraphSlot] = {}
        self._slot_device = "cuda"  # where slots keep their buffers (tests check the bookkeeping on the CPU)

    @property
    def execution(self) -> str:
        return "cuda-graph" if self.cuda_graph else "eager"

    def _load(self) -> None:
        self.session = open_session(self.path, self.device, self.optimization, self.threads, self.cuda_graph)
        inputs = self.session.get_inputs()
        self._inputs = [i.name for i in inputs]
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._specs = {i.name: InputSpec(rank=len(i.shape), floating="float" in i.type) for i in inputs}
        if CACHE_POSITION in self._inputs:
            self._shared = shared_cache_buffers(sum(n.startswith(PAST) for n in self._inputs) // 2)
        if self.device == "cuda":
            self._queued = queued_run_options()
            self._sync_binding = self.session.io_binding()

    def _prepare(self, feeds: dict[str, np.ndarray]) -> Any:
        ort = onnxruntime()

        if self.cuda_graph:
            return self._prepare_slot(feeds)
        if self.device == "cpu" and not self._shared:
            return {
                name: value.numpy() if isinstance(value, ort.OrtValue) else np.ascontiguousarray(value)
                for name, value in feeds.items()
            }
        return bind_io(self.session, feeds, self._outputs, self.device, self._shared)

    def _launcher(self, prepared: Any):
        """One call on `prepared`. On CUDA the run is issued with IOBinding, outputs kept on the device, and
        RunOptions that skip ONNX Runtime's wait at the end of the run, so that calls can be queued back to back;
        `_synchronize` waits. On the CPU a call returns finished. A new CUDA-graph shape is captured here, untimed."""
        if isinstance(prepared, NewShape):
            prepared = self._slot_for(prepared)
        session, names = self.session, self._outputs
        if isinstance(prepared, GraphSlot):

            def replay():
                try:
                    session.run_with_iobinding(prepared.binding, prepared.run_options)
                except _ort_errors() as e:
                    raise self._run_failed(e) from None
                return dict(prepared.outputs)

            return replay
        if isinstance(prepared, dict):  # the CPU without IOBinding

            def run_on_cpu():
                try:
                    return dict(zip(names, session.run(None, prepared)))
                except _ort_errors() as e:
                    raise self._run_failed(e) from None

            return run_on_cpu
        binding, queued = prepared.binding, self._queued

        def run_bound():
            try:
                session.run_with_iobinding(binding, queued)
            except _ort_errors() as e:
                raise self._run_failed(e) from None
            return dict(zip(names, binding.get_outputs()))

        return run_bound

    def _run_failed(self, error: BaseException) -> RunnerError:
        return self.error(f"onnxruntime run failed ({first_line(error)})")

    def _synchronize(self) -> None:
        """On CUDA: the execution provider's Sync (cudaDeviceSynchronize), reached through IOBinding, the only
        handle ORT's Python API gives; any binding of the session will do (it syncs the providers, not the binding)."""
        if self.device == "cuda":
            self._sync_binding.synchronize_outputs()

    # ---- CUDA graphs: one slot per input shape ----

    def _prepare_slot(self, feeds: dict[str, Any]):
        """The captured slot of this shape with `feeds` written into its inputs, or a NewShape to capture."""
        ort = onnxruntime()

        signature = tuple((name, _shape_of(value), _type_of(value)) for name, value in feeds.items())
        slot = self._slots.get(signature)
        if slot is None:
            device_inputs = {
                name: value if isinstance(value, ort.OrtValue) else device_copy(value, self._slot_device)
                for name, value in feeds.items()
            }
            return NewShape(signature, device_inputs)
        for name, value in feeds.items():
            fixed = slot.inputs[name]
            if isinstance(value, ort.OrtValue):
                if value.data_ptr() != fixed.data_ptr():  # a fed-back output is usually the fixed input already
                    fixed.update_inplace(value.numpy())  # no device-to-device copy in ORT's Python API
            elif value.size:
                fixed.update_inplace(np.ascontiguousarray(value))
        return slot

    def _slot_for(self, new: NewShape) -> GraphSlot:
        slot = self._slots.get(new.signature)
        if slot is None:
            start = time.perf_counter()
            slot = self._slots[new.signature] = self._capture(new.inputs)
            self.setup_log.append(("capture", new.signature, time.perf_counter() - start))
        return slot

    def _capture(self, device_inputs: dict) -> GraphSlot:
        ort = onnxruntime()

        def bound(outputs: dict):
            binding = self.session.io_binding()
            for name, value in device_inputs.items():
                binding.bind_ortvalue_input(name, value)
            for name in self._outputs:
                if name not in outputs:
                    binding.bind_output(name, self._slot_device, 0)
                else:
                    binding.bind_ortvalue_output(name, outputs[name])
            return binding

        try:
            # ORT allocates the outputs (but a static cache's present: its past's buffer); the slot keeps them
            first = bound({out: device_inputs[past] for out, past in self._shared.items()})
            no_capture = ort.RunOptions()
            no_capture.add_run_config_entry("gpu_graph_id", "-1")
            self.session.run_with_iobinding(first, no_capture)
            first.synchronize_outputs()
            outputs = dict(zip(self._outputs, first.get_outputs()))
            run_options = queued_run_options()  # the capture runs below wait with synchronize_outputs
            run_options.add_run_config_entry("gpu_graph_id", str(len(self._slots) + 1))  # 0 is ORT's default id
            binding = bound(outputs)
            for _ in range(CAPTURE_RUNS):
                self.session.run_with_iobinding(binding, run_options)
                binding.synchronize_outputs()
        except _ort_errors() as e:
            raise self.error(f"CUDA graph capture failed ({first_line(e)})") from None
        return GraphSlot(binding, run_options, dict(device_inputs), outputs)

    def to_numpy(self, value: Any) -> np.ndarray:
        ort = onnxruntime()

        return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)

    def _close(self) -> None:
        self._slots.clear()
        self.session = None


# Runs with a slot's graph id before timing: ORT needs regular runs first (its min_num_runs_before_cuda_graph_capture,
# 1 or 2 depending on the version), then captures and replays in the same run.
CAPTURE_RUNS = 3


@dataclass
class NewShape:
    """Inputs of a shape that has no CUDA-graph slot yet (on the device already); captured before it is timed."""

    signature: tuple
    inputs: dict


@dataclass
class GraphSlot:
    binding: Any
    run_options: Any  # carries the slot's gpu_graph_id
    inputs: dict  # name -> OrtValue at a fixed device address
    outputs: dict


def _shape_of(value) -> tuple:
    return tuple(value.shape()) if callable(getattr(value, "shape", None)) else tuple(value.shape)


def _type_of(value) -> str:
    return value.data_type() if callable(getattr(value, "data_type", None)) else str(value.dtype)


# ---- the engine (taperfold.engines' "ort" row) ---------------------------------------------------------------


def open_runner(
    path, *, device, threads, graph, logits, name, shapes=None, optimization="all", cuda_graph=False
) -> OrtRunner:
    return OrtRunner(path, device=device, threads=threads, optimization=optimization, cuda_graph=cuda_graph)


def unavailable(device: str) -> str | None:
    """onnxruntime itself; on CUDA, its CUDA execution provider and a GPU. (ONNX Runtime would only find out when a
    session opens, after printing its own lines about the libraries it could not load.)"""
    try:
        ort = onnxruntime()
    except TaperfoldError as e:
        return str(e)
    if device != "cuda":
        return None
    import torch

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (
            "--device cuda: this onnxruntime build has no CUDA execution provider "
            "(pip install 'taperfold[onnxruntime-gpu]' in an environment without the CPU onnxruntime)"
        )
    if not torch.cuda.is_available():
        return "--device cuda: no CUDA device on this machine (torch sees none)"
    return None
