"""Summary statistics of latency samples, with the definitions benchmark users know.

Percentiles interpolate linearly between order statistics (numpy's default, as optimum-benchmark);
std is the population standard deviation (ddof = 0, numpy's default); CV = std / mean in percent,
the figure trtexec warns about.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Stats:
    n: int
    median: float
    mean: float
    p90: float
    p99: float
    min: float
    max: float
    std: float
    cv_pct: float

    def to_dict(self) -> dict:
        return asdict(self)

    def scaled(self, factor: float) -> Stats:
        """The same statistics in another unit (seconds → milliseconds); CV is unit-free."""
        values = {k: v * factor for k, v in asdict(self).items() if k not in ("n", "cv_pct")}
        return Stats(n=self.n, cv_pct=self.cv_pct, **values)


def summarize(samples) -> Stats:
    x = np.asarray(samples, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("no samples to summarize")
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    mean, std = float(x.mean()), float(x.std())
    return Stats(
        n=int(x.size),
        median=float(p50),
        mean=mean,
        p90=float(p90),
        p99=float(p99),
        min=float(x.min()),
        max=float(x.max()),
        std=std,
        cv_pct=100.0 * std / mean if mean else 0.0,
    )
