"""The report observes: ObserveNormsPass records what the analysis found; statuses are a closed set."""

from __future__ import annotations

import json

from _graphs import D, F32, RMS_CONSTS, X, build, n, rand, rms_real, serialized

from taperfold.passes import FoldReport, NormStatus, ObserveNormsPass, fold_model


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


def test_statuses_are_a_closed_set_and_the_report_is_json():
    report = fold_model(two_norms())
    data = json.loads(json.dumps(report.to_dict()))
    assert set(data["summary"]) >= {status.value for status in NormStatus}
    assert {e["status"] for e in data["norms"]} <= {status.value for status in NormStatus}
    kept = report.norms[1]
    assert kept.message == "kept: read by Add 'y' (residual)"
    assert data["summary"]["real_norm"] == 1 and data["summary"]["folded"] == 0
