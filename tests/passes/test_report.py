"""The report observes: ObserveNormsPass records what the analysis found; statuses are a closed set."""

from __future__ import annotations

import json

from _graphs import D, F32, RMS_CONSTS, X, build, n, rand, rms_real, serialized

from taperfold.passes import FoldReport, NormStatus, ObserveNormsPass


def two_norms():
    """A real RMSNorm, then a constant-scale norm read by a residual Add (kept)."""
    return build([*rms_real(), n("MatMul", ["h", "W"], ["a"]), n("Mul", ["a", "w2"], ["b"]), n("Add", ["a", "b"], ["y"])],
                 [X], [("y", F32, [2, 3, D])], {**RMS_CONSTS, "g": rand(D), "W": rand(D, D), "w2": rand(D)})


def test_observe_records_every_norm_in_graph_order_and_changes_nothing():
    model = two_norms()
    before = serialized(model)
    report = FoldReport()
    ObserveNormsPass(report)(model)
    assert serialized(model) == before
    assert [(e.kind, e.status) for e in report.norms] == [("rms", NormStatus.REAL_NORM), ("rms", NormStatus.KEPT)]
    assert "per-token statistics" in report.norms[0].reason


def test_the_summary_counts_each_status_and_the_report_round_trips_as_json():
    report = FoldReport()
    for i, status in enumerate(NormStatus):
        report.entry(f"norm{i}", "rms", status).bytes_rewritten = 10 * i
    report.entry("norm0", "rms").copied.append("W -> W.folded")  # an existing entry, not a new one
    data = report.to_dict()
    summary = data["summary"]
    assert all(summary[status.value] == 1 for status in NormStatus)
    assert summary["norms"] == len(NormStatus) == sum(summary[status.value] for status in NormStatus)
    assert summary["bytes_rewritten"] == 10 * sum(range(len(NormStatus))) and summary["initializers_copied"] == 1
    assert json.loads(json.dumps(data)) == data
    assert report.norms[0].message == report.norms[0].status.value  # no reason: the status alone
