"""Judging verify's pairs (as Polygraphy's compare_accuracy, apart from running): the judge takes each model's
outputs as the scheduler yields them, compares a pair as soon as both its models have run every case it needs,
keeps only the logits a pair still waits for, and pools each pair's metrics over its inputs against its bound.

A pair of two graphs (unfolded -> folded, baseline-decomposed -> baseline) is judged after its `anchor`, the pair
holding its first graph to the torch model: that graph's own distance from the torch model may widen its bound
(compare.between_graphs), unless the user set the bound.

On the user's own tokens (`scored` cases) each row of logits whose next token is known is scored too: both models'
negative log-likelihood of it, pooled into their perplexities (compare.Metrics).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from taperfold.compare import Metrics, between_graphs, compare_logits, violations
from taperfold.verify.inputs import next_token_ids
from taperfold.verify.report import PairResult
from taperfold.verify.run import Case, ModelOutputs


@dataclass
class PlannedPair:
    """A pair of the comparison plan: its result (filled in when judged), the cases it compares, and its anchor."""

    result: PairResult
    cases: list[str]  # labels of the inputs both its models run
    anchor: str | None = None  # the name of the pair whose metrics may widen this one's bound
    graph: str = "prefill"  # the graph its candidate is (prefill, or a decoder)
    metrics: list[Metrics] = field(default_factory=list)

    @property
    def needs(self) -> set[tuple[str, str]]:
        return {(model, case) for model in (self.result.reference, self.result.candidate) for case in self.cases}


class Judge:
    """Compares pairs as their models' outputs arrive (`take`), then concludes them (`results`). `given`: the bounds
    the user set (rtol, max_kl), never widened."""

    def __init__(self, pairs: list[PlannedPair], given: Collection[str] = (), scored: Mapping[str, Case] | None = None):
        self.pairs = pairs
        self.given = given
        self.scored = scored or {}  # the cases of the user's tokens, by label: their next tokens are known
        self._waiting = [p for p in pairs if p.result.status != "skipped"]
        self._logits: dict[tuple[str, str], list[np.ndarray]] = {}
        self._by_name = {p.result.name: p for p in pairs}

    def take(self, outputs: ModelOutputs) -> None:
        if outputs.error is not None:
            self._could_not_run(outputs.model, outputs.error)
        for case, logits in outputs.logits.items():
            self._logits[(outputs.model, case)] = logits
        for pair in [p for p in self._waiting if p.needs <= self._logits.keys()]:
            self._compare(pair)
            self._waiting.remove(pair)
        needed = set().union(*(p.needs for p in self._waiting)) if self._waiting else set()
        self._logits = {key: value for key, value in self._logits.items() if key in needed}

    def _could_not_run(self, model: str, error: str) -> None:
        """Every pair still waiting on `model` fails, saying why it did not run."""
        for pair in [p for p in self._waiting if model in (p.result.reference, p.result.candidate)]:
            pair.result.status, pair.result.reason = "fail", f"{model} did not run: {error}"
            pair.metrics.clear()
            self._waiting.remove(pair)

    def results(self) -> list[PairResult]:
        for pair in self.pairs:
            if pair.result.status != "skipped":
                _conclude(pair.result, pair.metrics)
        return [p.result for p in self.pairs]

    def _compare(self, pair: PlannedPair) -> None:
        result = pair.result
        anchor = self._by_name.get(pair.anchor) if pair.anchor else None
        if anchor is not None and anchor.metrics and result.tolerance is not None:
            result.tolerance = between_graphs(
                result.tolerance,
                Metrics.merge(anchor.metrics),
                anchor.result.name,
                rtol_given="rtol" in self.given,
                max_kl_given="max_kl" in self.given,
            )
        for case in pair.cases:
            references = self._logits[(result.reference, case)]
            candidates = self._logits[(result.candidate, case)]
            scored = self.scored.get(case)
            ends = scored.ends(len(references)) if scored else []
            for step, (reference, candidate) in enumerate(zip(references, candidates)):
                label = case if len(references) == 1 else f"{case} {'prompt' if step == 0 else f'step {step}'}"
                next_ids = next_token_ids(scored.ids, ends[step], reference.shape) if scored else None
                _compare_one(result, label, reference, candidate, pair.metrics, next_ids)


def _compare_one(
    pair: PairResult,
    label: str,
    reference: np.ndarray,
    candidate: np.ndarray,
    collected: list[Metrics],
    next_ids: np.ndarray | None = None,
) -> None:
    rtol = pair.tolerance.tie_margin if pair.tolerance else 0.0
    if not np.isfinite(reference).all():  # every metric would be NaN and say nothing of the candidate
        why = f"the {pair.reference}'s logits on '{label}' are not finite (Inf/NaN): the model overflows there"
        pair.reason = f"{why}, nothing to compare"
        if pair.tolerance is not None:  # a judged pair: verify cannot vouch for its candidate (a cost pair stays info)
            pair.status = "fail"
        pair.per_input.append({"input": label, "metrics": None, "violations": [why]})
        return
    try:
        metrics = compare_logits(reference, candidate, rtol, next_ids)
    except ValueError as e:  # shapes differ: the export is broken for this input
        pair.status, pair.reason = "fail", f"{e} on input {label}"
        pair.per_input.append({"input": label, "metrics": None, "violations": [str(e)]})
        return
    collected.append(metrics)
    broken = violations(metrics, pair.tolerance) if pair.tolerance else []
    pair.per_input.append({"input": label, "metrics": metrics.to_dict(), "violations": broken})


def _conclude(pair: PairResult, collected: list[Metrics]) -> None:
    """Pool the inputs; judge the pooled metrics (top-1 and KL are means over all rows). The worst input is one that
    could not be compared at all (its logits' shapes differ, its reference's are not finite), else the farthest."""
    unmeasured = [r for r in pair.per_input if r["metrics"] is None]
    ranked = [r for r in pair.per_input if r["metrics"] is not None]
    if unmeasured or ranked:
        worst = unmeasured[0] if unmeasured else max(ranked, key=lambda r: _max_rel_or_inf(r["metrics"]["max_rel"]))
        pair.worst_input = worst["input"]
    if not collected:
        return
    pair.metrics = Metrics.merge(collected)
    if pair.tolerance is not None:
        pair.violations = violations(pair.metrics, pair.tolerance)
        if pair.violations:
            pair.status = "fail"


def _max_rel_or_inf(max_rel: float) -> float:
    return math.inf if math.isnan(max_rel) else max_rel
