"""OpenVINO's stateful IR on the CPU (`--engine openvino-ir`): a decoder whose KV cache lives in the model's state,
as taperfold's `openvino` artifacts (taperfold.artifacts.openvino_ir) and optimum-intel's export
(`bench --against optimum-intel`) hold it. Compiled as `--engine openvino` compiles the ONNX graphs
(taperfold.runners.openvino.compile_for_cpu).

The runner makes no single graph calls, since the cache is inside: it overrides `generate` (bench: the state reset,
the prompt in one call, then one call per greedy token, as optimum-intel's OVModelForCausalLM runs it) and
`decode_logits` (verify: the prompt, then each given token). It feeds `input_ids` and `beam_idx` (arange: every row
continues its own cache), and `attention_mask` and `position_ids` to a model that takes them (optimum-intel's, the
mask one longer each step); taperfold's IR takes neither (its positions follow the cache's length).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from taperfold.errors import TaperfoldError
from taperfold.exportdir import INPUT, OUTPUT
from taperfold.runners.base import Generation, Runner
from taperfold.runners.openvino import compile_for_cpu, openvino_reason
from taperfold.runners.openvino import unavailable as openvino_unavailable

MODEL = "openvino_model.xml"  # a folder's model, as optimum-intel and taperfold name it
BEAM_IDX = "beam_idx"
OPTIONAL_INPUTS = ("attention_mask", "position_ids")


class StatefulOpenVinoRunner(Runner):
    name = "openvino-ir"

    def __init__(self, path: str | Path, threads: int | None = None, name: str | None = None):
        path = Path(path)
        super().__init__(name or str(path), "cpu")
        self.path = path if path.suffix == ".xml" else path / MODEL  # the model, or the folder that holds it
        self.threads = threads
        self._inputs, self._outputs = [INPUT], [OUTPUT]

    def _load(self) -> None:
        self._compiled = compile_for_cpu(self, self.path, self.threads)
        self._request = self._compiled.create_infer_request()
        names = {name for i in self._compiled.inputs for name in i.names}
        if not {INPUT, BEAM_IDX} <= names or not self._request.query_state():
            raise self.error(
                f"is not a stateful decoder (inputs {INPUT} and {BEAM_IDX}, and a KV cache in the model's state)"
            )
        self._takes = [name for name in OPTIONAL_INPUTS if name in names]
        self._logits = self._compiled.output(OUTPUT)

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
        feeds = {INPUT: np.ascontiguousarray(ids, dtype=np.int64), BEAM_IDX: np.arange(batch, dtype=np.int32)}
        if "attention_mask" in self._takes:
            feeds["attention_mask"] = np.ones((batch, start + n), dtype=np.int64)
        if "position_ids" in self._takes:
            feeds["position_ids"] = np.broadcast_to(np.arange(start, start + n, dtype=np.int64), (batch, n)).copy()
        try:
            logits = np.asarray(self._request.infer(feeds, share_inputs=True, share_outputs=False)[self._logits])
        except RuntimeError as e:
            raise self.error(f"OpenVINO run failed ({openvino_reason(e)})") from None
        return (logits[:, -1, :] if logits.ndim == 3 else logits).astype(np.float32)

    def _growing_only(self, cache_len: int | None) -> None:
        if cache_len is not None:
            raise self.error("a stateful OpenVINO decoder holds a growing cache, not a static one")

    def generate(
        self, prompt_ids: np.ndarray, steps: int, cfg: Any, dtype: str, cache_len: int | None = None
    ) -> Generation:
        """The prompt and the first token's choice (prefill_s), then `steps` calls, each timed with its argmax."""
        self._require_loaded("generate")
        self._growing_only(cache_len)
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
        self._growing_only(cache_len)
        prompt = ids.shape[1] - steps
        self._request.reset_state()
        logits = [self._step(ids[:, :prompt], 0)]
        logits += [self._step(ids[:, prompt + k : prompt + k + 1], prompt + k) for k in range(steps)]
        return logits


# ---- the engine (taperfold.engines' "openvino-ir" row) -------------------------------------------------------


def open_runner(path, *, device, threads, graph, logits, name, shapes=None) -> StatefulOpenVinoRunner:
    if device != "cpu":
        raise TaperfoldError(f"--engine openvino-ir runs on the CPU here, not {device!r}")
    return StatefulOpenVinoRunner(path, threads=threads, name=name)


def unavailable(device: str) -> str | None:
    return openvino_unavailable(device, "openvino-ir")
