"""OpenVINO on the CPU: the exported ONNX graphs (prefill, growing and static decoders; `--engine openvino`), and
the stateful IR optimum-intel exports (`bench --against optimum-intel`).

OpenVINO's ONNX frontend reads the graphs as they are, standard ops and ONNX Runtime's MatMulNBits alike. Every model
is compiled for the CPU with the latency hint and `threads` inference threads, and the inference precision pinned to
f32: on a CPU with bf16 units OpenVINO would otherwise run an fp32 graph in bf16, which is another model than the one
exported (and than the one ONNX Runtime runs). Outputs are copied out of the request (a KV cache's presents are fed
back as the next step's pasts, and the request reuses its buffers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from taperfold.errors import TaperfoldError, first_line
from taperfold.exportdir import OUTPUT
from taperfold.runners.base import Generation, InputSpec, Runner

INSTALL = "pip install 'taperfold[openvino]'"


def openvino():
    try:
        import openvino as ov
    except ImportError:
        raise TaperfoldError(f"--engine openvino: openvino is not installed ({INSTALL})") from None
    return ov


class OpenVinoRunner(Runner):
    name = "openvino"

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None):
        if device != "cpu":
            raise TaperfoldError(f"--engine openvino runs on the CPU here, not {device!r}")
        super().__init__(str(path), device)
        self.path = Path(path)
        self.threads = threads
        self._compiled: Any = None
        self._request: Any = None

    def _load(self) -> None:
        self._compiled = compile_for_cpu(self, self.path, self.threads)
        self._request = self._compiled.create_infer_request()
        inputs = self._compiled.inputs
        self._inputs = [i.any_name for i in inputs]
        self._outputs = [o.any_name for o in self._compiled.outputs]
        self._specs = {
            i.any_name: InputSpec(rank=i.partial_shape.rank.get_length(), floating=i.element_type.is_real())
            for i in inputs
        }

    def _prepare(self, feeds: dict[str, Any]) -> dict[str, np.ndarray]:
        return {name: np.ascontiguousarray(value) for name, value in feeds.items()}

    def _launcher(self, prepared: dict[str, np.ndarray]) -> Callable[[], dict[str, Any]]:
        request, outputs = self._request, self._compiled.outputs

        def run() -> dict[str, Any]:
            try:
                results = request.infer(prepared, share_inputs=True, share_outputs=False)
            except RuntimeError as e:
                raise self.error(f"OpenVINO run failed ({first_line(e)})") from None
            return {o.any_name: results[o] for o in outputs}

        return run

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def _close(self) -> None:
        self._request = self._compiled = None


def compile_for_cpu(runner: Runner, path: Path, threads: int | None) -> Any:
    ov = openvino()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    try:
        core = ov.Core()
        return core.compile_model(core.read_model(str(path)), "CPU", config)
    except RuntimeError as e:
        raise runner.error(f"OpenVINO cannot compile it ({first_line(e)})") from None


class StatefulOpenVinoRunner(Runner):
    """A stateful decoder as optimum-intel exports it (`openvino_model.xml`: input_ids, attention_mask, position_ids
    and beam_idx in, logits out, the KV cache held in the request's state), run the way optimum-intel's
    OVModelForCausalLM runs it: the state reset, the prompt in one call, then one call per greedy token, the attention
    mask one longer each step. It makes no single graph calls: bench times its whole generations."""

    name = "openvino-stateful"
    MODEL = "openvino_model.xml"

    def __init__(self, folder: str | Path, threads: int | None = None, name: str | None = None):
        super().__init__(name or str(folder), "cpu")
        self.path = Path(folder) / self.MODEL
        self.threads = threads
        self._inputs, self._outputs = ["input_ids"], [OUTPUT]

    def _load(self) -> None:
        self._compiled = compile_for_cpu(self, self.path, self.threads)
        self._request = self._compiled.create_infer_request()
        wanted = {"input_ids", "attention_mask", "position_ids", "beam_idx"}
        names = {name for i in self._compiled.inputs for name in i.names}
        if not wanted <= names or not self._request.query_state():
            raise self.error(
                f"is not a stateful decoder as optimum-intel exports it (inputs {', '.join(sorted(wanted))} and a "
                "KV cache in the model's state)"
            )

    def _close(self) -> None:
        self._request = self._compiled = None

    def _prepare(self, feeds: dict[str, Any]) -> Any:
        raise self.error("a stateful OpenVINO decoder runs whole generations (bench --mode decode), not single calls")

    def _launcher(self, prepared: Any) -> Callable[[], dict[str, Any]]:
        raise self.error("a stateful OpenVINO decoder runs whole generations (bench --mode decode), not single calls")

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def _step(self, ids: np.ndarray, start: int) -> np.ndarray:
        """The logits of the last position, after `ids` [batch, n] at positions start..start+n-1."""
        batch, n = ids.shape
        feeds = {
            "input_ids": np.ascontiguousarray(ids, dtype=np.int64),
            "attention_mask": np.ones((batch, start + n), dtype=np.int64),
            "position_ids": np.broadcast_to(np.arange(start, start + n, dtype=np.int64), (batch, n)).copy(),
            "beam_idx": np.arange(batch, dtype=np.int32),
        }
        try:
            logits = self._request.infer(feeds, share_inputs=True, share_outputs=False)[self._compiled.output(OUTPUT)]
        except RuntimeError as e:
            raise self.error(f"OpenVINO run failed ({first_line(e)})") from None
        return np.asarray(logits)[:, -1, :].astype(np.float32)

    def generate(
        self, prompt_ids: np.ndarray, steps: int, cfg: Any, dtype: str, cache_len: int | None = None
    ) -> Generation:
        """The prompt and the first token's choice (prefill_s), then `steps` calls, each timed with its argmax."""
        self._require_loaded("generate")
        if cache_len is not None:
            raise self.error("a stateful OpenVINO decoder holds a growing cache, not a static one")
        prompt = prompt_ids.shape[1]
        self._request.reset_state()
        start = time.perf_counter()
        logits = self._step(prompt_ids, 0)
        token = logits.argmax(-1)
        prefill_s = time.perf_counter() - start
        tokens, step_s = [token], []
        for k in range(steps):
            start = time.perf_counter()
            logits = self._step(token[:, None], prompt + k)
            token = logits.argmax(-1)
            step_s.append(time.perf_counter() - start)
            tokens.append(token)
        return Generation(prefill_s, step_s, np.stack(tokens, axis=1).astype(np.int64), logits)

    def decode_logits(
        self, ids: np.ndarray, steps: int, cfg: Any, kv_dtype: str, cache_len: int | None = None
    ) -> list[np.ndarray]:
        """Logits of the prompt (ids minus the last `steps` columns) and of each step fed the next column."""
        self._require_loaded("decode_logits")
        if cache_len is not None:
            raise self.error("a stateful OpenVINO decoder holds a growing cache, not a static one")
        prompt = ids.shape[1] - steps
        self._request.reset_state()
        logits = [self._step(ids[:, :prompt], 0)]
        logits += [self._step(ids[:, prompt + k : prompt + k + 1], prompt + k) for k in range(steps)]
        return logits


# ---- the engine (taperfold.engines' "openvino" row) ----------------------------------------------------------


def open_runner(path, *, device, threads, graph, logits, name, shapes=None) -> OpenVinoRunner:
    return OpenVinoRunner(path, device=device, threads=threads)


def unavailable(device: str) -> str | None:
    try:
        openvino()
    except TaperfoldError as e:
        return str(e)
    return None if device == "cpu" else f"--engine openvino runs on the CPU here, not {device}"
