"""TensorRT runner: one deserialized plan, one execution context, on a CUDA device.

Buffers are torch CUDA tensors (the GPU image has CUDA PyTorch, and torch gives device memory, streams,
events and CUDA-graph capture without another dependency such as cuda-python). Output buffers are
allocated once, for the profile's largest input shape; each run uses a prefix of them. The outputs that
`run` returns are views of those buffers: valid until the next run, and `to_numpy` copies them.
Not yet run on a GPU (no machine here could install TensorRT); see docs/tensorrt.md.
"""

from __future__ import annotations

import math
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from taperfold import trt_support
from taperfold.errors import TaperfoldError
from taperfold.runners.base import CudaEventClock, InputSpec, Runner

# trt.DataType member name -> torch dtype
_DTYPES = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT64": torch.int64,
    "INT32": torch.int32,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "BOOL": torch.bool,
}


class _Prepared:
    """Device copies of one set of inputs (a plain class so a captured CUDA graph can be keyed on it)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors


class TrtRunner(Runner):
    name = "trt"

    def __init__(self, plan_path, device: str = "cuda", cuda_graph: bool = False):
        super().__init__(str(plan_path), device)
        if not str(device).startswith("cuda"):
            raise TaperfoldError(f"TensorRT runs on CUDA devices only, got device {device!r}")
        self._trt = trt_support.require_tensorrt()  # the same one-line error as `export --trt` when it is missing
        self.plan_path = Path(plan_path)
        self.cuda_graph = cuda_graph
        self._engine = None

    # ---- life cycle ----

    def _load(self) -> None:
        trt = self._trt
        if not self.plan_path.is_file():
            raise TaperfoldError(f"{self.plan_path}: no such TensorRT engine; build it with `taperfold export --trt`")
        self._device = torch.device(self.device)
        with torch.cuda.device(self._device):
            self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            engine = self._runtime.deserialize_cuda_engine(self.plan_path.read_bytes())
            if engine is None:
                raise TaperfoldError(
                    f"{self.plan_path}: TensorRT cannot load this engine (built by another "
                    f"TensorRT than {trt.__version__}, or for another GPU?); rebuild it"
                )
            context = engine.create_execution_context()
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
            self._inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
            self._outputs = [n for n in names if n not in self._inputs]
            self._dtypes = {n: self._torch_dtype(engine.get_tensor_dtype(n)) for n in names}
            self._profile = {n: [tuple(d) for d in engine.get_tensor_profile_shape(n, 0)] for n in self._inputs}
            self._specs = {
                n: InputSpec(rank=len(self._profile[n][0]), floating=self._dtypes[n].is_floating_point)
                for n in self._inputs
            }
            # the largest outputs come from the largest inputs: ask the context, then allocate once
            for n in self._inputs:
                self._check(context.set_input_shape(n, self._profile[n][2]), f"set_input_shape({n!r})")
            self._out_buffers = {
                n: torch.empty(math.prod(context.get_tensor_shape(n)), dtype=self._dtypes[n], device=self._device)
                for n in self._outputs
            }
            self._stream = torch.cuda.Stream(self._device)  # TensorRT warns about the default stream
        self._engine, self._context = engine, context
        self._bound: _Prepared | None = None  # the prepared inputs whose shapes and addresses the context holds
        self._bound_outputs: dict[str, torch.Tensor] = {}
        self._graphs: weakref.WeakKeyDictionary[_Prepared, Any] = weakref.WeakKeyDictionary()

    def _close(self) -> None:
        # a graph and a context reference memory of the engine: release them first
        self._graphs = weakref.WeakKeyDictionary()
        self._bound, self._bound_outputs = None, {}
        self._context = self._engine = self._runtime = None
        self._out_buffers = {}

    # ---- running ----

    def _prepare(self, feeds: dict[str, np.ndarray]) -> _Prepared:
        tensors = {}
        for name, array in feeds.items():
            lo, _, hi = self._profile[name]
            shape = tuple(array.shape)
            if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
                raise self.error(
                    f"{name} shape {shape} is outside the engine's profile "
                    f"(min {lo}, max {hi}); rebuild the engine with a wider profile"
                )
            tensors[name] = torch.from_numpy(np.ascontiguousarray(array)).to(self._device, self._dtypes[name])
        torch.cuda.synchronize(self._device)
        return _Prepared(tensors)

    def _launcher(self, prepared: _Prepared):
        """Enqueue one inference (or a graph replay) on the runner's stream; shapes, addresses and graph capture are
        set here, before any clock. Outputs are read on other streams (to_numpy, verify, torch) only after
        `_synchronize`, which every public call ends with."""
        outputs, launch = self._bind(prepared), self._executor(prepared)
        device, stream = self._device, self._stream

        def enqueue():
            with torch.cuda.device(device), torch.cuda.stream(stream):
                launch()
            return dict(outputs)

        return enqueue

    def _synchronize(self) -> None:
        self._stream.synchronize()

    def _clock(self) -> CudaEventClock:
        return CudaEventClock(self._stream)

    def to_numpy(self, value) -> np.ndarray:
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16
            value = value.float()
        return value.detach().cpu().numpy()

    # ---- helpers ----

    def _bind(self, prepared: _Prepared) -> dict:
        """Set input shapes and every IO tensor's address for `prepared`; return the output views."""
        if self._bound is prepared:
            return self._bound_outputs
        ctx = self._context
        for name, t in prepared.tensors.items():
            self._check(ctx.set_input_shape(name, tuple(t.shape)), f"set_input_shape({name!r}, {tuple(t.shape)})")
            self._check(ctx.set_tensor_address(name, t.data_ptr()), f"set_tensor_address({name!r})")
        outputs = {}
        for name in self._outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            view = self._out_buffers[name][: math.prod(shape)].view(shape)
            self._check(ctx.set_tensor_address(name, view.data_ptr()), f"set_tensor_address({name!r})")
            outputs[name] = view
        self._bound, self._bound_outputs = prepared, outputs
        return outputs

    def _execute(self) -> None:
        self._check(self._context.execute_async_v3(self._stream.cuda_stream), "execute_async_v3")

    def _executor(self, prepared: _Prepared):
        """execute_async_v3 on the stream, or the replay of the graph captured for `prepared`."""
        if not self.cuda_graph:
            return self._execute
        graph = self._graphs.get(prepared)
        if graph is None:
            graph = self._graphs[prepared] = self._capture()
        return graph.replay

    def _capture(self):
        """Capture one inference as a CUDA graph for the bound shapes and addresses."""
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._execute()  # one plain run first: TensorRT finishes shape-dependent setup outside the capture
        self._stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self._device), torch.cuda.graph(graph, stream=self._stream):
            self._execute()
        return graph

    def _torch_dtype(self, trt_dtype):
        for name, dtype in _DTYPES.items():
            if trt_dtype == getattr(self._trt.DataType, name, None):
                return dtype
        raise TaperfoldError(f"{self.plan_path}: tensor type {trt_dtype} is not supported by TrtRunner")

    def _check(self, ok, call: str) -> None:
        if ok is False:  # the bindings return False, not raise, when TensorRT rejects a call
            raise self.error(f"TensorRT {call} failed (its log above says why)")


# ---- the engine (taperfold.engines' "trt" row) ---------------------------------------------------------------


def open_runner(path, *, device, threads, graph, logits, name, shapes=None, cuda_graph=False) -> TrtRunner:
    return TrtRunner(path, device=device, cuda_graph=cuda_graph)


def unavailable(device: str) -> str | None:
    return trt_support.unavailable()
