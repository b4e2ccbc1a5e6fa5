"""verify.json: the judged pairs, typed (`VerifyReport`, `PairResult`), written and read back by `to_json` /
`from_json`; the terminal table (taperfold.ui.print_verify) is a view of the same object."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from taperfold.compare import Metrics, Tolerance
from taperfold.errors import TaperfoldError

REPORT = "verify.json"
FORMAT = "taperfold-verify"
FORMAT_VERSION = 1  # reports before it had no `format` key: read as version 1 (the same keys)

# A pair's kind: how its candidate relates to its reference, which sets the bound it is held to
EXPORT = "export"  # an artifact against the torch model it was made from
FOLD = "fold"  # a graph against the graph the fold made it from (the fold alone)
FUSE = "fuse"  # the fused-norm baseline against the plain ops it replaced
COST = "cost"  # reported, never judged: what forcing g = 0 cost
CHECK = "check"  # an artifact no engine runs, checked by its kind (taperfold.artifacts)
GENERATE = "generate"  # an engine's greedy generations held to the checkpoint's (taperfold.verify.generations)
PAIR_KINDS = (EXPORT, FOLD, FUSE, COST, CHECK, GENERATE)
STATUSES = ("pass", "fail", "info", "skipped")


def _finite_or_none(obj: Any) -> Any:
    """JSON has no NaN or Infinity: write them as null (the violations still say what happened)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_or_none(v) for v in obj]
    return obj


def _metrics_from(data: dict | None) -> Metrics | None:
    if data is None:
        return None
    values: dict[str, Any] = {k: math.nan if v is None else v for k, v in data.items()}
    return Metrics(**values)


@dataclass
class PairResult:
    reference: str
    candidate: str
    kind: str  # one of PAIR_KINDS
    tolerance: Tolerance | None
    status: str = "pass"  # one of STATUSES
    reason: str | None = None
    metrics: Metrics | None = None
    violations: list[str] = field(default_factory=list)
    worst_input: str | None = None
    per_input: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.reference} -> {self.candidate}"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "reference": self.reference,
            "candidate": self.candidate,
            "kind": self.kind,
            "status": self.status,
            "reason": self.reason,
            "tolerance": self.tolerance.to_dict() if self.tolerance else None,
            "metrics": self.metrics.to_dict() if self.metrics else None,
            "violations": self.violations,
            "worst_input": self.worst_input,
            "per_input": self.per_input,
        }

    @classmethod
    def from_json(cls, data: dict) -> PairResult:
        tolerance = data.get("tolerance")
        return cls(
            reference=data["reference"],
            candidate=data["candidate"],
            kind=data["kind"],
            tolerance=Tolerance(**tolerance) if tolerance else None,
            status=data["status"],
            reason=data.get("reason"),
            metrics=_metrics_from(data.get("metrics")),
            violations=list(data.get("violations") or []),
            worst_input=data.get("worst_input"),
            per_input=list(data.get("per_input") or []),
        )


@dataclass
class VerifyReport:
    export_dir: str
    checkpoint: dict
    dtype: str
    logits: str
    device: str
    forced_gate0: bool
    inputs: list[dict]
    pairs: list[PairResult]
    note: str | None = None  # e.g. verify.NOTHING_FOLDED
    engine: str = "ort"  # what ran the ONNX graphs (other artifacts ran on their own engine)

    @property
    def passed(self) -> bool:
        return all(p.status != "fail" for p in self.pairs)

    def failure_message(self) -> str:
        """One line naming the worst failing pair, its output and the bounds it breaks."""
        failed = [p for p in self.pairs if p.status == "fail"]
        if not failed:
            return ""

        def excess(p: PairResult) -> float:
            if p.reason or p.metrics is None or p.tolerance is None or not math.isfinite(p.metrics.max_rel):
                return math.inf
            if p.tolerance.rtol is None:  # a quantized pair: how far past its KL bound
                return p.metrics.kl / p.tolerance.max_kl if p.tolerance.max_kl > 0 else math.inf
            return p.metrics.max_rel / p.tolerance.rtol if p.tolerance.rtol > 0 else math.inf

        worst = max(failed, key=excess)
        where = f" (worst input: {worst.worst_input})" if worst.worst_input else ""
        more = f"; {len(failed) - 1} more pair(s) failed" if len(failed) > 1 else ""
        what = "logits " if worst.kind not in (CHECK, GENERATE) else ""  # the violations name a metric of them
        detail = worst.reason or what + ", ".join(worst.violations)
        return f"{worst.name}: {detail}{where}{more}"

    def closer(self) -> str:
        """Which of unfolded.onnx and model.onnx is closer to the checkpoint (max rel), as one sentence."""
        pairs = {p.name: p.metrics for p in self.pairs if p.metrics is not None and p.kind == EXPORT}
        unfolded = next((m for name, m in pairs.items() if name.endswith("-> unfolded")), None)
        folded = next((m for name, m in pairs.items() if name.endswith("-> folded")), None)
        if unfolded is None or folded is None or not (unfolded.max_rel > 0 and math.isfinite(folded.max_rel)):
            return ""
        ratio = folded.max_rel / unfolded.max_rel
        which = "folded" if ratio < 1 else "unfolded" if ratio > 1 else "neither"
        return (
            f"closer to the checkpoint: {which} (max rel folded {folded.max_rel:.3g}, unfolded "
            f"{unfolded.max_rel:.3g}, ratio {ratio:.2f})"
        )

    def to_json(self) -> dict:
        return _finite_or_none(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "export_dir": self.export_dir,
                "passed": self.passed,
                "closer": self.closer(),
                "checkpoint": self.checkpoint,
                "dtype": self.dtype,
                "logits": self.logits,
                "device": self.device,
                "engine": self.engine,
                "forced_gate0": self.forced_gate0,
                "note": self.note,
                "inputs": self.inputs,
                "pairs": [p.to_json() for p in self.pairs],
            }
        )

    @classmethod
    def from_json(cls, data: dict, origin: str = REPORT) -> VerifyReport:
        """A report `to_json` wrote (any version this taperfold reads), or one line naming `origin`."""
        if data.get("format", FORMAT) != FORMAT or data.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise TaperfoldError(
                f"{origin}: not a {FORMAT} report of version {FORMAT_VERSION} (keys 'format', 'format_version')"
            )
        try:
            return cls(
                export_dir=data["export_dir"],
                checkpoint=data["checkpoint"],
                dtype=data["dtype"],
                logits=data["logits"],
                device=data["device"],
                forced_gate0=data["forced_gate0"],
                inputs=data["inputs"],
                pairs=[PairResult.from_json(p) for p in data["pairs"]],
                note=data.get("note"),
                engine=data.get("engine", "ort"),
            )
        except (KeyError, TypeError) as e:
            raise TaperfoldError(f"{origin}: not a readable {FORMAT} report (key {e})") from None
