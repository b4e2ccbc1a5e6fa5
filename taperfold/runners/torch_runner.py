"""PyTorch runner: eager, torch.compile, or replayed CUDA graphs, on the CPU or a CUDA device.

Three input/output layouts, so that one benchmark loop drives torch and ONNX Runtime alike:
- full forward: `input_ids` → `logits`;
- growing-cache decoder (`graph="growing"`): the names of the exported KV-cached decoders, `input_ids` and
  `past_key_values.{i}.key|value` → `logits` and `present.{i}.key|value` (see taperfold.exportdir);
- static-cache decoder (`graph="static"`): also `cache_position`; the model writes the new keys and values into
  the fed cache buffers in place and returns those same tensors as present (so a step feeds back its presents
  without a copy and every step has the same shapes), and `next_token`: the greedy token, taken on the device.

torch.compile (`compile=True`): dynamo caches compiled graphs on the Python code object, and every variant of a
model runs the same `CausalLM.forward`; compiled through one code object, three variants times six shapes
overran dynamo's recompile limit (8) and the rest silently ran eager. So each runner compiles its own copy of
the forward's code (its own cache), with a recompile limit that fits the shapes it will see, `fullgraph=True`,
and a hit of the limit or any graph break raised as an error instead of a fallback. The first call on a new
shape compiles; it is run untimed and its time recorded apart (`setup_log`).

CUDA graphs (`cuda_graph=True`): one graph per input shape (a static cache's steps all share one), captured on
the first call with that shape as torch documents (warm-up calls on a side stream, then capture into a private
memory pool). The tensors of that first call become the graph's static inputs and its outputs the static outputs;
later calls copy new values into the static inputs (in `prepare`, untimed) and replay. A decode step feeds the
presents the previous step's graph returned: those are the next graph's static inputs already, so steady-state
decoding copies nothing (with a static cache the step's graph writes its own static cache inputs in place, and only the
`next_token` it returned, [batch, 1], is copied into its input ids). Outputs are the graph's buffers: valid until
the next call with the same shape.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from taperfold.engines import COMPILE_MODES
from taperfold.errors import first_line
from taperfold.exportdir import (
    CACHE_POSITION,
    GRAPH_TYPES,
    INPUT,
    NEXT_TOKEN,
    OUTPUT,
    PREFILL,
    Graph,
    check_graph,
    decoder_io_names,
)
from taperfold.runners.base import CudaEventClock, InputSpec, Runner, WallClock
from taperfold.taper import TaperedLM


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


def _signature(tensors: dict[str, torch.Tensor]) -> tuple:
    return tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items())


def own_forward(model: torch.nn.Module):
    """`model.forward` bound to a fresh copy of its code object: dynamo's cache and recompile count are per code
    object, so a copy gives this model a cache no other instance of its class shares."""
    forward = type(model).forward
    code = forward.__code__.replace()  # a new code object, equal in content
    fn = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__)
    fn.__kwdefaults__ = forward.__kwdefaults__
    return types.MethodType(fn, model)


def configure_dynamo(shapes: int) -> None:
    """A recompile limit that fits `shapes` compiles of one code object, and no silent fallback to eager."""
    import torch._dynamo.config as dynamo

    limit = max(getattr(dynamo, "recompile_limit", 8), shapes)
    for name in ("recompile_limit", "cache_size_limit"):  # the older name is an alias in torch >= 2.6
        if hasattr(dynamo, name):
            setattr(dynamo, name, limit)
    if hasattr(dynamo, "accumulated_recompile_limit"):
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * limit)
    dynamo.suppress_errors = False  # TORCHDYNAMO_SUPPRESS_ERRORS would turn compile errors into eager runs
    for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, True)


class TorchRunner(Runner):
    """`name` labels the model in errors (a checkpoint path, or which variant was built). `shapes`: how many
    distinct input shapes the caller will run (sizes the recompile limit with `compile`)."""

    name = "torch"

    def __init__(
        self,
        model: TaperedLM,
        device: str = "cpu",
        compile: bool = False,
        graph: Graph = PREFILL,
        logits: str = "last",
        name: str = "torch model",
        compile_mode: str = "default",
        cuda_graph: bool = False,
        shapes: int | None = None,
    ):
        super().__init__(name, device)
        if compile_mode not in COMPILE_MODES:
            raise self.error(f"torch.compile mode must be one of {COMPILE_MODES}, got {compile_mode!r}")
        if cuda_graph and not str(device).startswith("cuda"):
            raise self.error("CUDA graphs need a CUDA device (--cuda-graph needs --device cuda)")
        if cuda_graph and compile:
            raise self.error("choose torch.compile or CUDA graphs, not both")
        self.model, self.compile, self.graph, self.logits = model, compile, check_graph(graph), logits
        self.graph_type = GRAPH_TYPES[self.graph]
        if self.graph_type.fixed_cache and not model.static_cache:
            raise self.error(
                "this model takes no static KV cache (its transformers cache has layers that hold more than keys "
                "and values); use --kv-cache growing"
            )
        self.compile_mode, self.cuda_graph, self.shapes = compile_mode, cuda_graph, shapes or 8
        self._outputs_in_graph_pool = (
            compile and compile_mode in ("reduce-overhead", "max-autotune") and self.device.startswith("cuda")
        )
        if self.graph_type.has_past:
            self._inputs, self._outputs = decoder_io_names(model.cfg.n_layers, graph)
        else:
            self._inputs, self._outputs = [INPUT], [OUTPUT]
        # a cache written in place leaves the greedy token (taken on the device) all that a step feeds back
        if self.graph_type.fixed_cache:
            self._outputs.append(NEXT_TOKEN)
        self._specs = {n: InputSpec(rank=4, floating=True) for n in self._inputs}
        self._specs[INPUT] = InputSpec(rank=2, floating=False)
        self._specs[CACHE_POSITION] = InputSpec(rank=1, floating=False)
        self._module: Any = None  # the model, or its compiled forward
        # one-off work per input shape, outside every timing: ("compile" | "capture", shape signature, seconds)
        self.setup_log: list[tuple[str, tuple, float]] = []
        self._seen: set[tuple] = set()
        self._graphs: dict[tuple, _Graph] = {}

    @property
    def execution(self) -> str:
        """How the model runs, as reports label it: eager, compile:MODE or cuda-graph."""
        return f"compile:{self.compile_mode}" if self.compile else "cuda-graph" if self.cuda_graph else "eager"

    def _load(self) -> None:
        self.model.to(self.device).eval()
        self._module = self.model
        if self.compile:
            configure_dynamo(self.shapes)
            # a growing cache changes shape every step: let dynamo turn the changing sizes dynamic after the first
            # recompile instead of compiling every step; prefill cells and a static cache's prompt and step are
            # few and fixed shapes: one static graph each
            self._module = torch.compile(
                own_forward(self.model),
                mode=None if self.compile_mode == "default" else self.compile_mode,
                fullgraph=True,
                dynamic=None if self.graph_type.grows else False,
            )

    # ---- running ----

    def _prepare(self, feeds: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Host arrays → tensors on the device; tensors this runner returned pass through without a copy. With CUDA
        graphs, values are copied into the static inputs of the shape's graph (when it has one)."""
        dtype = next(self.model.parameters()).dtype
        out = {}
        for name, value in feeds.items():
            if isinstance(value, np.ndarray) and self.graph_type.fixed_cache:
                value = np.array(value)  # the model writes into its cache: never into the caller's arrays
            t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
            if t.is_floating_point():
                t = t.to(dtype)  # the KV cache lives in the model's dtype
            out[name] = t.to(self.device, non_blocking=True)
        captured = self._graphs.get(_signature(out)) if self.cuda_graph else None
        if captured is not None:
            with torch.inference_mode():  # static inputs may be a graph's outputs: inference tensors
                for name, t in out.items():
                    static = captured.inputs[name]
                    if t.data_ptr() != static.data_ptr():  # a fed-back present is the static input already
                        static.copy_(t)
            return dict(captured.inputs)
        return out

    def _forward(self, prepared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            if not self.graph_type.has_past:
                return {OUTPUT: self._module(prepared[INPUT], logits=self.logits)}
            cache_names = [n for n in self._inputs if n not in (INPUT, CACHE_POSITION)]  # key, value per layer
            past = [(prepared[k], prepared[v]) for k, v in zip(cache_names[::2], cache_names[1::2])]
            if self.graph_type.fixed_cache:
                logits, present = self._module(
                    prepared[INPUT],
                    logits="last",
                    past_key_values=past,
                    use_cache=True,
                    cache_position=prepared[CACHE_POSITION],
                )
                presents = dict(zip(self._outputs[1:-1], (t for kv in present for t in kv)))
                return {OUTPUT: logits, **presents, NEXT_TOKEN: logits.argmax(-1, keepdim=True)}
            logits, present = self._module(prepared[INPUT], logits="last", past_key_values=past, use_cache=True)
            if self._outputs_in_graph_pool:
                # reduce-overhead / max-autotune replay CUDA graphs whose outputs live in a pool that the next
                # replay may overwrite ("accessing tensor output of CUDAGraphs that has been overwritten"); the
                # cache is the next step's input, so it is copied out, inside the timing: it is part of the cost
                present = [(k.clone(), v.clone()) for k, v in present]
        return {OUTPUT: logits, **dict(zip(self._outputs[1:], (t for kv in present for t in kv)))}

    def _launcher(self, prepared: dict[str, torch.Tensor]):
        """What runs `prepared` once: the eager or compiled forward, or a graph's replay (on a GPU it returns once the
        kernels are queued). A shape seen for the first time is compiled or captured here, its time logged apart."""
        signature = _signature(prepared)
        if self.cuda_graph:
            captured = self._graphs.get(signature)
            if captured is None:
                captured = self._graphs[signature] = self._timed_setup("capture", signature, self._capture, prepared)
            elif any(prepared[n] is not captured.inputs[n] for n in prepared):
                raise self.error("a graph replay needs the tensors prepare() returned for this shape")
            return lambda: self._replay(captured)
        if self.compile and signature not in self._seen:
            self._timed_setup("compile", signature, self._compile_call, prepared)
        self._seen.add(signature)
        return lambda: self._forward(prepared)

    def _timed_setup(self, kind: str, signature: tuple, work, prepared):
        self._synchronize()
        t0 = time.perf_counter()
        result = work(prepared)
        self._synchronize()
        self.setup_log.append((kind, signature, time.perf_counter() - t0))
        return result

    def _compile_call(self, prepared) -> None:
        """The first call on a shape compiles (dynamo, then inductor); dynamo's errors become one line."""
        dynamo_log = logging.getLogger("torch._dynamo")
        level = dynamo_log.level
        dynamo_log.setLevel(logging.ERROR)  # its multi-line recompile warnings: the error below says it in one
        try:
            self._forward(prepared)
        except Exception as e:  # dynamo raises many types (Unsupported, FailOnRecompileLimitHit, BackendCompilerFailed)
            if type(e).__module__.startswith("torch._dynamo") or type(e).__module__.startswith("torch._inductor"):
                raise self.error(
                    f"torch.compile failed instead of falling back to eager ({type(e).__name__}: {first_line(e)})"
                ) from None
            raise
        finally:
            dynamo_log.setLevel(level)

    def _capture(self, prepared: dict[str, torch.Tensor]) -> _Graph:
        """Warm up on a side stream, then capture one call (torch.cuda.graphs, 'whole network capture')."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # lazy initialisation (cuBLAS handles, autotuning) must not happen during capture
                self._forward(prepared)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = self._forward(prepared)
        except RuntimeError as e:
            raise self.error(f"CUDA graph capture failed ({first_line(e)})") from None
        return _Graph(graph, dict(prepared), outputs)

    def _replay(self, captured: _Graph) -> dict[str, torch.Tensor]:
        captured.graph.replay()
        return dict(captured.outputs)

    def _synchronize(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def _clock(self) -> WallClock | CudaEventClock:
        """CUDA events on the stream the calls are issued on; perf_counter on the CPU (calls are synchronous)."""
        if self.device.startswith("cuda"):
            return CudaEventClock(torch.cuda.current_stream(self.device))
        return WallClock()

    def to_numpy(self, value: torch.Tensor) -> np.ndarray:
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16
            value = value.float()
        return value.detach().cpu().numpy()

    def _close(self) -> None:
        self._module = None
        self._graphs.clear()  # graphs hold their memory pools: release them before the model moves
        self._seen.clear()
        self.model.to("cpu")
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


# ---- the engine (taperfold.engines' "torch" row) -------------------------------------------------------------


def open_runner(
    model,
    *,
    device,
    threads,
    graph,
    logits,
    name,
    shapes=None,
    compile=False,
    compile_mode="default",
    cuda_graph=False,
) -> TorchRunner:
    return TorchRunner(
        model,
        device=device,
        compile=compile,
        compile_mode=compile_mode,
        cuda_graph=cuda_graph,
        shapes=shapes,
        graph=graph,
        logits=logits,
        name=name or "torch model",
    )


def unavailable(device: str) -> str | None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "--device cuda: torch sees no CUDA device on this machine"
    return None
