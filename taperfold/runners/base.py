"""The runner interface every engine implements, with the guards and the timing done once here (as Polygraphy's
BaseRunner).

A subclass implements the engine part: `_load`, `_prepare`, `_launcher`, `to_numpy`; an engine whose calls return
before the device has finished also `_synchronize` and `_clock` (CUDA events), and one that holds resources
`_close`. The base class makes sure the model is loaded before it runs, checks host feeds against the runner's
inputs (names, integer vs floating type, rank) before the engine sees them, so that every engine answers bad
feeds with the same one-line `RunnerError` naming the model, and times calls the same way on every engine:

- synced (`timed_run`, latency): one call between two timestamps, its outputs waited for before the clock stops;
- pipelined (`pipelined_run`, throughput): N calls issued back to back between two timestamps and one wait at
  the end; the time divided by N. On an engine whose calls are synchronous (the CPU) both are the same
  measurement; on a GPU pipelined lets the host queue the next call while the device runs this one.

KV-cached decoders run through the export's decoder IO (`input_ids`, [`cache_position`,]
`past_key_values.{i}.key|value` → `logits`, `present.{i}.key|value`; taperfold.exportdir) call by call: `generate`
(bench's greedy generations) and `decode_logits` (verify's decode cases). The prompt is one call; then every step
feeds a token and the presents the runner returned, which stay in its native form (device tensors, OrtValues)
between steps. With a growing cache the prompt runs with an empty past and each present is one longer than its past;
with a static one the cache is `cache_len` zeros, `cache_position` says where the new tokens go and the presents are
the cache buffers, written in place. An engine that runs whole generations itself (onnxruntime-genai) overrides the
two methods instead.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from taperfold.errors import TaperfoldError
from taperfold.exportdir import CACHE_POSITION, NEXT_TOKEN, OUTPUT, prompt_feeds, step_feeds

SYNCED, PIPELINED = "synced", "pipelined"  # the two timing modes, as reports name them


class RunnerError(TaperfoldError):
    """A runner was misused or its engine failed; the message starts with the model's name."""


@dataclass(frozen=True)
class InputSpec:
    rank: int
    floating: bool  # False: integer ids


@dataclass
class Generation:
    """A greedy generation (`Runner.generate`)."""

    prefill_s: float
    step_s: list[float]  # one per decode step (one new token per sequence of the batch)
    tokens: np.ndarray  # [batch, 1 + steps]: the greedy tokens, the first from the prefill's logits
    last_logits: np.ndarray  # [batch, vocab] of the final step


class WallClock:
    """perf_counter: the clock stops after the wait, so the time covers the device's work."""

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, wait: Callable[[], None]) -> float:
        wait()
        return time.perf_counter() - self._start


class CudaEventClock:
    """Two CUDA events on `stream` (None: the current stream): the end is recorded behind the last queued call,
    before the host waits, so the time is the device's from the first call's start to the last call's end."""

    def __init__(self, stream=None):
        import torch

        self._stream = stream
        self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._start.record(self._stream)

    def stop(self, wait: Callable[[], None]) -> float:
        self._end.record(self._stream)
        wait()
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


class Runner(abc.ABC):
    """Load a model, run it on named inputs, time calls synced (latency) or pipelined (throughput).

    Life cycle: `load()` once, then any number of `prepare()` / `run()` / `timed_run()` / `pipelined_run()`, then
    `close()`. `prepare` moves host arrays to where the engine runs (outside any timing); the others take what
    `prepare` returned and return outputs in the engine's native form (kept on the device, so a KV cache can be
    fed back without a copy); `to_numpy` brings one output back to the host.
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
    def _launcher(self, prepared: Any) -> Callable[[], dict[str, Any]]:
        """What issues one call on `prepared` and returns its outputs, without waiting for the device. One-off work
        for a new input (compiling, capturing a CUDA graph, binding addresses) is done here, before any clock."""

    @abc.abstractmethod
    def to_numpy(self, value: Any) -> np.ndarray: ...

    def _synchronize(self) -> None:  # noqa: B027 - a default on purpose: a synchronous engine has nothing to wait for
        """Wait until every call issued so far has finished (nothing to wait for when calls are synchronous)."""

    def _clock(self) -> WallClock | CudaEventClock:
        return WallClock()

    def _close(self) -> None:  # noqa: B027 - a default on purpose: an engine holding nothing to release keeps it
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
        """One call, waited for, untimed."""
        self._require_loaded("run")
        outputs = self._launcher(prepared)()
        self._synchronize()
        return outputs

    def timed_run(self, prepared: Any) -> tuple[dict[str, Any], float]:
        """Synced (latency): one call timed alone, its outputs waited for before the clock stops; (outputs, seconds)."""
        self._require_loaded("timed_run")
        return self._timed(prepared, 1, SYNCED)

    def pipelined_run(self, prepared: Any, calls: int) -> tuple[dict[str, Any], float]:
        """Pipelined (throughput): `calls` calls issued back to back between two timestamps, one wait at the end;
        (the last call's outputs, seconds per call)."""
        self._require_loaded("pipelined_run")
        if calls < 1:
            raise self.error(f"pipelined_run needs at least one call, got {calls}")
        outputs, seconds = self._timed(prepared, calls, PIPELINED)
        return outputs, seconds / calls

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Host in, host out: what `taperfold verify` needs."""
        return {k: self.to_numpy(v) for k, v in self.run(self.prepare(feeds)).items()}

    # ---- KV-cached decoding ----

    def generate(
        self, prompt_ids: np.ndarray, steps: int, cfg: Any, dtype: str, cache_len: int | None = None
    ) -> Generation:
        """A prompt and `steps` greedy steps, each call timed synced; `cfg` is the model's shape (n_layers, kv_heads,
        head_dim), `dtype` the cache's, `cache_len` the static cache's length for a static decoder. The greedy token
        is the `next_token` output where the runner has one (the torch runner's static decoder takes the argmax on
        the device and is fed that device tensor); otherwise the logits come back to the host for the argmax."""
        static = self._check_cache(cache_len)
        on_device = NEXT_TOKEN in self.output_names

        def greedy(out) -> tuple:
            """(what the next step is fed, the tokens on the host)."""
            if on_device:
                return out[NEXT_TOKEN], self.to_numpy(out[NEXT_TOKEN])[:, 0]  # fed as it is: it stays on the device
            token = self.to_numpy(out[OUTPUT]).argmax(-1)
            return token[:, None].astype(np.int64), token

        prompt = prompt_ids.shape[1]
        out, prefill_s = self.timed_run(self.prepare(prompt_feeds(cfg, prompt_ids, dtype, cache_len)))
        feed, token = greedy(out)
        tokens, step_s = [token], []
        for k in range(steps):
            out, seconds = self.timed_run(self.prepare(step_feeds(cfg, feed, out, prompt + k, static)))
            step_s.append(seconds)
            feed, token = greedy(out)
            tokens.append(token)
        return Generation(prefill_s, step_s, np.stack(tokens, axis=1), self.to_numpy(out[OUTPUT]))

    def decode_logits(
        self, ids: np.ndarray, steps: int, cfg: Any, kv_dtype: str, cache_len: int | None = None
    ) -> list[np.ndarray]:
        """Logits (host, float32) of the prompt (ids minus the last `steps` columns; a static cache of `cache_len`,
        else a growing one) and of each KV-cached step fed the next column of ids."""
        self._check_cache(cache_len)
        prompt = ids.shape[1] - steps
        feeds = prompt_feeds(cfg, ids[:, :prompt], kv_dtype, cache_len)
        logits = []
        for k in range(steps + 1):
            out = self.infer(feeds)
            logits.append(out[OUTPUT].astype(np.float32))
            if k < steps:
                feeds = step_feeds(cfg, ids[:, prompt + k : prompt + k + 1], out, prompt + k, cache_len is not None)
        return logits

    def _check_cache(self, cache_len: int | None) -> bool:
        """Whether this decoder takes a static cache (a cache_position input), refused in one line where that is
        not the cache it was opened as (a manifest whose static decoder file is a growing one, or the reverse): bad
        input (exit 2), not a failure of the engine."""
        static = CACHE_POSITION in self.input_names
        if static != (cache_len is not None):
            has, asked = ("a static", "a growing") if static else ("a growing", "a static")
            raise TaperfoldError(
                f"{self.model_name}: is {has} KV-cache decoder (its inputs {'hold' if static else 'lack'} "
                f"{CACHE_POSITION}) where {asked} one was asked for: the file does not match the manifest's graph"
            )
        return static

    def __enter__(self):
        self.load()
        return self

    def __exit__(self, *exc):
        self.close()

    def _timed(self, prepared: Any, calls: int, mode: str) -> tuple[dict[str, Any], float]:
        launch = self._launcher(prepared)  # one-off work for a new input (its errors are its own), untimed
        try:
            self._synchronize()  # work queued before (a prepare's copies) stays out of the clock
            clock = self._clock()
            clock.start()
            for _ in range(calls):
                outputs = launch()
            return outputs, clock.stop(self._synchronize)
        except RunnerError as e:  # say which measurement failed, still in one line
            what = "synced call" if mode == SYNCED else f"pipelined run of {calls} calls"
            raise RunnerError(f"{e} (during a {what})") from None

    # ---- guards ----

    def _require_loaded(self, call: str) -> None:
        if not self._loaded:
            raise self.error(f"{type(self).__name__}.{call}() called before load()")

    def _check_feeds(self, feeds: dict[str, Any]) -> None:
        missing = [n for n in self._inputs if n not in feeds]
        unknown = sorted(set(feeds) - set(self._inputs))
        if missing or unknown:
            raise self.error(
                f"feeds do not match the model's inputs {self._inputs} (missing {missing}, unknown {unknown})"
            )
        for name, value in feeds.items():
            spec = self._specs.get(name)
            if spec is None or not isinstance(value, np.ndarray):
                continue  # a value this runner returned (a KV cache fed back) is already in its native form
            if value.ndim != spec.rank:
                raise self.error(f"input {name!r} needs rank {spec.rank}, got shape {list(value.shape)}")
            floating = np.issubdtype(value.dtype, np.floating)
            if floating != spec.floating or not (floating or np.issubdtype(value.dtype, np.integer)):
                raise self.error(
                    f"input {name!r} needs {'floating-point' if spec.floating else 'integer'} values, got {value.dtype}"
                )
