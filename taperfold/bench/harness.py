"""Rounds: every variant is measured in turn, a slice at a time, so that drift of a shared machine
(other jobs, thermal and frequency changes) lands on all variants alike instead of on whichever ran last.

For one cell (one input shape) with variants A, B, C and R rounds:

    first runs:  A B C                             (one call each on a fresh shape: reported apart)
    round 0:     A(w + i + i) B(w + i + i) C(...)  (w warm-up calls, i synced calls, then i pipelined calls)
    round 1:     B(...) C(...) A(...)              (order rotated by one each round)
    ...

Synced calls are each a sample (one call timed alone, waited for: latency). The i pipelined calls of a slice are
one sample (issued back to back, one wait at the end: time per call, for throughput); a schedule without
pipelining (a decode run: one sample is one whole generation) skips them.

`--iters` is the total number of timed calls per variant and cell in each mode, spread as evenly as possible over
the rounds; `--warmup` likewise, but every slice gets at least one warm-up call when warm-up is asked for,
because the variant measured just before has pushed this one's weights out of the caches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Sample = TypeVar("Sample")


@dataclass(frozen=True)
class Schedule:
    warmup: int
    iters: int
    rounds: int
    pipelined: bool = False  # also a pipelined sample of each slice's iters calls

    def __post_init__(self):
        if self.warmup < 0 or self.iters < 1 or self.rounds < 1:
            raise ValueError(f"need warmup >= 0, iters >= 1, rounds >= 1; got {self}")
        if self.rounds > self.iters:
            raise ValueError(f"rounds ({self.rounds}) cannot exceed iters ({self.iters}): a round needs a timed call")

    @property
    def iter_slices(self) -> list[int]:
        return split(self.iters, self.rounds)

    @property
    def warmup_slices(self) -> list[int]:
        if self.warmup == 0:
            return [0] * self.rounds
        return [max(1, n) for n in split(self.warmup, self.rounds)]

    def calls_per_variant(self) -> int:
        """Calls of one variant in one cell, the first run included (for a progress bar)."""
        return 1 + sum(self.warmup_slices) + self.iters * (2 if self.pipelined else 1)


def split(total: int, parts: int) -> list[int]:
    """`total` as `parts` near-equal counts, the larger ones first: split(10, 4) == [3, 3, 2, 2]."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def rotated(names: list[str], round_index: int) -> list[str]:
    k = round_index % len(names)
    return names[k:] + names[:k]


@dataclass(frozen=True)
class Job(Generic[Sample]):
    """How one variant is measured in one cell: `synced()` makes one call, waited for, and returns its sample;
    `pipelined(n)` makes n calls back to back with one wait and returns their sample (None: not measured so)."""

    synced: Callable[[], Sample]
    pipelined: Callable[[int], Sample] | None = None


@dataclass
class CellSamples:
    first: dict  # variant -> the first call's sample (synced)
    synced: dict  # variant -> list of samples, in the order taken
    pipelined: dict = field(default_factory=dict)  # variant -> list of samples, one per round (pipelined schedules)


def run_rounds(jobs: dict[str, Job], schedule: Schedule, on_call: Callable[[], None] = lambda: None) -> CellSamples:
    """Measure each job as the schedule says; `on_call` ticks once per model call."""
    names = list(jobs)
    if schedule.pipelined and any(jobs[name].pipelined is None for name in names):
        raise ValueError("a pipelined schedule needs every job's pipelined measurement")
    first = {}
    for name in names:
        first[name] = jobs[name].synced()
        on_call()
    synced: dict[str, list] = {name: [] for name in names}
    pipelined: dict[str, list] = {name: [] for name in names} if schedule.pipelined else {}
    for r, (n_warm, n_iter) in enumerate(zip(schedule.warmup_slices, schedule.iter_slices)):
        for name in rotated(names, r):
            job = jobs[name]
            for _ in range(n_warm):
                job.synced()
                on_call()
            for _ in range(n_iter):
                synced[name].append(job.synced())
                on_call()
            if schedule.pipelined and job.pipelined is not None:  # (every job has one: checked above)
                pipelined[name].append(job.pipelined(n_iter))
                for _ in range(n_iter):
                    on_call()
    return CellSamples(first, synced, pipelined)
