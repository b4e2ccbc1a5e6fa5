"""The runner interface every engine implements, with the guards done once here (as Polygraphy's BaseRunner).

A subclass implements the engine part: `_load`, `_prepare`, `_run`, `_timed_run`, `to_numpy` and, if it
holds resources, `_close`. The base class makes sure the model is loaded before it runs, and checks host
feeds against the runner's inputs (names, integer vs floating type, rank) before the engine sees them,
so that every engine answers bad feeds with the same one-line `RunnerError` naming the model.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np

from taperfold.errors import TaperfoldError


class RunnerError(TaperfoldError):
    """A runner was misused or its engine failed; the message starts with the model's name."""


@dataclass(frozen=True)
class InputSpec:
    rank: int
    floating: bool  # False: integer ids


class Runner(abc.ABC):
    """Load a model, run it on named inputs, time one run with the engine's own clock.

    Life cycle: `load()` once, then any number of `prepare()` / `run()` / `timed_run()`, then `close()`.
    `prepare` moves host arrays to where the engine runs (outside any timing); `run` and `timed_run`
    take what `prepare` returned and return outputs in the engine's native form (kept on the device,
    so a KV cache can be fed back without a copy); `to_numpy` brings one output back to the host.
    """

    name: str = "runner"

    def __init__(self, model_name: str, device: str = "cpu"):
        self.model_name = model_name  # names the model in every error: a file path, or what was built
        self.device = device
        # Subclasses fill these (in __init__ or _load): IO names in order, and what each input takes.
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self._specs: dict[str, InputSpec] = {}
        self._loaded = False

    # ---- what subclasses implement ----

    @abc.abstractmethod
    def _load(self) -> None: ...

    @abc.abstractmethod
    def _prepare(self, feeds: dict[str, Any]) -> Any: ...

    @abc.abstractmethod
    def _run(self, prepared: Any) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _timed_run(self, prepared: Any) -> tuple[dict[str, Any], float]:
        """Run once; return (outputs, seconds) measured with CUDA events on a GPU, perf_counter on CPU."""

    @abc.abstractmethod
    def to_numpy(self, value: Any) -> np.ndarray: ...

    def _close(self) -> None:
        """Release the model and its buffers."""

    # ---- the interface, guarded ----

    def error(self, message: str) -> RunnerError:
        return RunnerError(f"{self.model_name}: {message}")

    def load(self) -> None:
        self._load()
        self._loaded = True

    def close(self) -> None:
        """Release the model and its buffers; the runner can be loaded again."""
        if self._loaded:
            self._loaded = False
            self._close()

    @property
    def is_loaded(self) -> bool:
        return self._loaded

    @property
    def input_names(self) -> list[str]:
        return list(self._inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self._outputs)

    def prepare(self, feeds: dict[str, Any]) -> Any:
        self._require_loaded("prepare")
        self._check_feeds(feeds)
        return self._prepare(feeds)

    def run(self, prepared: Any) -> dict[str, Any]:
        self._require_loaded("run")
        return self._run(prepared)

    def timed_run(self, prepared: Any) -> tuple[dict[str, Any], float]:
        self._require_loaded("timed_run")
        return self._timed_run(prepared)

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Host in, host out: what `taperfold verify` needs."""
        return {k: self.to_numpy(v) for k, v in self.run(self.prepare(feeds)).items()}

    def __enter__(self):
        self.load()
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- guards ----

    def _require_loaded(self, call: str) -> None:
        if not self._loaded:
            raise self.error(f"{type(self).__name__}.{call}() called before load()")

    def _check_feeds(self, feeds: dict[str, Any]) -> None:
        missing = [n for n in self._inputs if n not in feeds]
        unknown = sorted(set(feeds) - set(self._inputs))
        if missing or unknown:
            raise self.error(f"feeds do not match the model's inputs {self._inputs} (missing {missing}, "
                             f"unknown {unknown})")
        for name, value in feeds.items():
            spec = self._specs.get(name)
            if spec is None or not isinstance(value, np.ndarray):
                continue  # a value this runner returned (a KV cache fed back) is already in its native form
            if value.ndim != spec.rank:
                raise self.error(f"input {name!r} needs rank {spec.rank}, got shape {list(value.shape)}")
            floating = np.issubdtype(value.dtype, np.floating)
            if floating != spec.floating or not (floating or np.issubdtype(value.dtype, np.integer)):
                raise self.error(f"input {name!r} needs {'floating-point' if spec.floating else 'integer'} "
                                 f"values, got {value.dtype}")
