"""Running verify's models, one at a time (as Polygraphy's Comparator.run): each model is opened when its turn comes,
runs every case it is given and is closed before the next opens, so a model past 2 GB is never held twice; the
outputs come back as typed results (`ModelOutputs`) for the judge (taperfold.verify.judge), which keeps only what a
pair still waits for.

A case is a prefill (the logits of a batch of ids) or a decode: a prompt with an empty (or zeroed static) cache, then
its KV-cached steps (verify.inputs.decode_steps), each fed the next column of ids (the same for reference and
candidate); the logits of the prompt and of every step come back.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from taperfold.exportdir import INPUT, OUTPUT
from taperfold.runners.base import Runner, RunnerError


@dataclass(frozen=True)
class Case:
    """One input a model runs: `ids` [batch, sequence]; a decode case's last `steps` columns are its steps."""

    label: str
    ids: np.ndarray
    decode: bool = False
    steps: int = 0  # a decode case's KV-cached steps
    cache_len: int | None = None  # a static decoder's cache length; None: a growing cache (or a prefill)
    scored: bool = False  # the ids are the user's text or tokens: each known next token is scored for perplexity

    def ends(self, calls: int) -> list[int]:
        """How many of `ids`' columns had been fed when each of `calls` calls returned its logits: a prefill's one
        call all of them; a decode case's prompt, then one more per step."""
        prompt = self.ids.shape[1] - self.steps
        return [prompt + k for k in range(calls)] if self.decode else [self.ids.shape[1]] * calls


@dataclass
class ModelRun:
    """One model of the schedule: how to open its runner (when its turn comes), the cases it runs, the dtype its KV
    cache is fed in, and what to let go of once it has run (what no later model needs)."""

    name: str
    open_runner: Callable[[], Runner]
    cases: list[Case]
    cfg: object  # the model's shape (n_layers, kv_heads, head_dim) for its decoder feeds
    kv_dtype: str = "fp32"
    then: Callable[[], None] = lambda: None


@dataclass
class ModelOutputs:
    """What one model returned: per case label, the logits of the prompt (prefill: the only ones) and of each step;
    `error`: why it could not run (its engine refused it: a graph ONNX Runtime cannot run on these inputs)."""

    model: str
    logits: dict[str, list[np.ndarray]]
    error: str | None = None


def run_models(models: list[ModelRun], progress: Callable[[int, int, str], None]) -> Iterator[ModelOutputs]:
    """Run each model in turn on its cases, one model in memory at a time; yield its outputs once it is closed."""
    total, done = sum(len(m.cases) for m in models), 0
    for model in models:
        logits, error = {}, None
        with model.open_runner() as runner:
            for case in model.cases:
                progress(done, total, f"{model.name} {'decoding' if case.decode else 'on'} {case.label}")
                try:
                    logits[case.label] = (
                        runner.decode_logits(case.ids, case.steps, model.cfg, model.kv_dtype, case.cache_len)
                        if case.decode
                        else _prefill(runner, case)
                    )
                except RunnerError as e:  # the engine refused a call: this model's pairs fail, the others still run
                    error = str(e)
                    break
                done += 1
        del runner
        model.then()
        return_freed_memory()
        yield ModelOutputs(model.name, logits, error)


def _prefill(runner: Runner, case: Case) -> list[np.ndarray]:
    return [runner.infer({INPUT: case.ids})[OUTPUT].astype(np.float32)]


def return_freed_memory() -> None:
    """Hand the heap a closed model freed back to the system: glibc keeps it otherwise, and ONNX Runtime sessions
    opened one after another then grew the process by ~0.5x the weights each (a 1.5 GB model, measured)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)
