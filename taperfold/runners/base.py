"""The runner interface every backend implements."""

from __future__ import annotations

import abc
from typing import Any

import numpy as np


class Runner(abc.ABC):
    """Load a model, run it on named inputs, time one run with the backend's own clock.

    Life cycle: `load()` once, then any number of `prepare()` / `run()` / `timed_run()`, then `close()`.
    `prepare` moves host arrays to where the backend runs (outside any timing); `run` and `timed_run`
    take what `prepare` returned and return outputs in the backend's native form (kept on the device,
    so a KV cache can be fed back without a copy); `to_numpy` brings one output back to the host.
    """

    name: str = "runner"

    def __init__(self, device: str = "cpu"):
        self.device = device
        # Runners that know their tensor names fill these (in __init__ or load); others override the properties.
        self._inputs: list[str] = []
        self._outputs: list[str] = []

    @abc.abstractmethod
    def load(self) -> None: ...

    @property
    def input_names(self) -> list[str]:
        return list(self._inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self._outputs)

    @abc.abstractmethod
    def prepare(self, feeds: dict[str, np.ndarray]) -> Any: ...

    @abc.abstractmethod
    def run(self, prepared: Any) -> dict[str, Any]: ...

    @abc.abstractmethod
    def timed_run(self, prepared: Any) -> tuple[dict[str, Any], float]:
        """Run once; return (outputs, seconds) measured with CUDA events on a GPU, perf_counter on CPU."""

    @abc.abstractmethod
    def to_numpy(self, value: Any) -> np.ndarray: ...

    def close(self) -> None:
        """Release the model and its buffers; the runner can be loaded again."""

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Host in, host out: what `taperfold verify` needs."""
        return {k: self.to_numpy(v) for k, v in self.run(self.prepare(feeds)).items()}

    def __enter__(self):
        self.load()
        return self

    def __exit__(self, *exc):
        self.close()
