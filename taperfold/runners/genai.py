"""onnxruntime-genai as an engine: whole greedy generations through its Generator, on a folder it loads
(`genai_config.json` beside a KV-cached decoder: the artifact kind taperfold.artifacts.genai_folder writes).

genai owns the KV cache and the loop, so this runner makes no single graph calls: it overrides `generate` (bench:
the prompt through `append_tokens`, then one `generate_next_token` per step, as a user of genai runs it) and
`decode_logits` (verify: the prompt and each given token through `append_tokens`, the logits read back after each).
genai appends tokens more than once only at batch 1, so verify's cases run row by row. A generation runs exactly the
steps asked: the folder's end-of-sequence ids are cleared for the runner's own Model, as taperfold's other engines
never stop at one either.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from taperfold.errors import first_line
from taperfold.exportdir import INPUT, OUTPUT
from taperfold.genai_config import check_genai_folder
from taperfold.runners.base import Generation, Runner

INSTALL_HINT = "pip install 'taperfold[genai]'"


def _genai():
    import onnxruntime_genai

    return onnxruntime_genai


class GenaiRunner(Runner):
    name = "genai"

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None, name: str | None = None):
        path = Path(path)
        super().__init__(name or str(path), device)
        self.folder = path.parent if path.is_file() else path  # genai_config.json names it, or the folder itself
        self.threads = threads
        self._inputs, self._outputs = [INPUT], [OUTPUT]

    def _load(self) -> None:
        og = _genai()
        check_genai_folder(self.folder)  # before genai reads a word of it: no library, provider or path it names runs
        overlay: dict[str, Any] = {"model": {"eos_token_id": []}}
        if self.threads:
            overlay["model"]["decoder"] = {"session_options": {"intra_op_num_threads": self.threads}}
        try:
            config = og.Config(str(self.folder))
            config.overlay(json.dumps(overlay))
            self.model = og.Model(config)
        except RuntimeError as e:
            raise self.error(f"onnxruntime-genai cannot load the folder ({first_line(e)})") from None

    def _close(self) -> None:
        del self.model

    def _prepare(self, feeds: dict[str, Any]) -> Any:
        raise self.error("onnxruntime-genai runs whole generations (bench --mode decode, verify), not single calls")

    def _launcher(self, prepared: Any) -> Callable[[], dict[str, Any]]:
        raise self.error("onnxruntime-genai runs whole generations (bench --mode decode, verify), not single calls")

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def _generator(self, batch: int, length: int):
        og = _genai()
        params = og.GeneratorParams(self.model)
        # greedy, one sequence a row, whatever search the folder's config defaults to
        params.set_search_options(
            do_sample=False, num_beams=1, num_return_sequences=1, batch_size=batch, max_length=length
        )
        return og.Generator(self.model, params)

    def _genai_call(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except RuntimeError as e:
            raise self.error(f"onnxruntime-genai failed ({what}: {first_line(e)})") from None

    def generate(
        self, prompt_ids: np.ndarray, steps: int, cfg: Any, dtype: str, cache_len: int | None = None
    ) -> Generation:
        """genai's own greedy loop: the prompt and the first token's choice (prefill_s), then `steps` calls of
        generate_next_token, each running the decoder on the previous token and choosing the next."""
        self._require_loaded("generate")
        if cache_len is not None:
            raise self.error("an onnxruntime-genai folder holds a growing-cache decoder, not a static one")
        batch, prompt = prompt_ids.shape
        generator = self._generator(batch, prompt + steps + 1)
        ids = prompt_ids.astype(np.int32)
        start = time.perf_counter()
        self._genai_call("the prompt", lambda: (generator.append_tokens(ids), generator.generate_next_token()))
        prefill_s = time.perf_counter() - start
        tokens, step_s = [generator.get_next_tokens().copy()], []
        for _ in range(steps):
            start = time.perf_counter()
            self._genai_call("a step", generator.generate_next_token)
            step_s.append(time.perf_counter() - start)
            tokens.append(generator.get_next_tokens().copy())
        last_logits = np.asarray(generator.get_output(OUTPUT))[:, -1, :].astype(np.float32)
        return Generation(prefill_s, step_s, np.stack(tokens, axis=1).astype(np.int64), last_logits)

    def decode_logits(
        self, ids: np.ndarray, steps: int, cfg: Any, kv_dtype: str, cache_len: int | None = None
    ) -> list[np.ndarray]:
        """Logits of the prompt and of each given step, row by row (genai appends more than once at batch 1 only)."""
        self._require_loaded("decode_logits")
        if cache_len is not None:
            raise self.error("an onnxruntime-genai folder holds a growing-cache decoder, not a static one")
        prompt = ids.shape[1] - steps
        rows = []
        for row in ids.astype(np.int32):
            generator = self._generator(1, ids.shape[1])
            logits = []
            for start, stop in [(0, prompt)] + [(prompt + k, prompt + k + 1) for k in range(steps)]:
                self._genai_call("append_tokens", lambda: generator.append_tokens(row[None, start:stop]))  # noqa: B023 - called at once
                logits.append(np.asarray(generator.get_output(OUTPUT))[:, -1, :].astype(np.float32))
            rows.append(logits)
        return [np.concatenate([row[k] for row in rows]) for k in range(steps + 1)]


# ---- the engine (taperfold.engines' "genai" row) ---------------------------------------------------------------


def open_runner(path, *, device, threads, graph, logits, name, shapes=None) -> GenaiRunner:
    return GenaiRunner(path, device=device, threads=threads, name=name)


def unavailable(device: str) -> str | None:
    try:
        _genai()
    except ImportError:
        return f"onnxruntime-genai is not installed ({INSTALL_HINT})"
    if device != "cpu":
        return f"--device {device}: taperfold runs onnxruntime-genai's CPU build only"
    return None
