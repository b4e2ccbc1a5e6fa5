"""Rounds: every variant is measured in turn, a slice at a time, so that drift of a shared machine
(other jobs, thermal and frequency changes) lands on all variants alike instead of on whichever ran last.

For one cell (one input shape) with variants A, B, C and R rounds:

    first runs:  A B C                       (one call each on a fresh shape: reported apart)
    round 0:     A(w + i) B(w + i) C(w + i)  (w warm-up calls, then i timed calls)
    round 1:     B(w + i) C(w + i) A(w + i)  (order rotated by one each round)
    ...

`--iters` is the total number of timed calls per variant and cell, spread as evenly as possible over the
rounds; `--warmup` likewise, but every slice gets at least one warm-up call when warm-up is asked for,
because the variant measured just before has pushed this one's weights out of the caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

Sample = TypeVar("Sample")


@dataclass(frozen=True)
class Schedule:
    warmup: int
    iters: int
    rounds: int

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
        return 1 + sum(self.warmup_slices) + self.iters


def split(total: int, parts: int) -> list[int]:
    """`total` as `parts` near-equal counts, the larger ones first: split(10, 4) == [3, 3, 2, 2]."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def rotated(names: list[str], round_index: int) -> list[str]:
    k = round_index % len(names)
    return names[k:] + names[:k]


@dataclass
class CellSamples:
    first: dict  # variant -> the first call's sample
    timed: dict  # variant -> list of samples, in the order taken


def run_rounds(jobs: dict[str, Callable[[], Sample]], schedule: Schedule,
               on_call: Callable[[], None] = lambda: None) -> CellSamples:
    """Call each job (one measured run of one variant, returning its sample) as the schedule says."""
    names = list(jobs)
    first = {}
    for name in names:
        first[name] = jobs[name]()
        on_call()
    timed: dict[str, list] = {name: [] for name in names}
    for r, (n_warm, n_iter) in enumerate(zip(schedule.warmup_slices, schedule.iter_slices)):
        for name in rotated(names, r):
            for _ in range(n_warm):
                jobs[name]()
                on_call()
            for _ in range(n_iter):
                timed[name].append(jobs[name]())
                on_call()
    return CellSamples(first, timed)
