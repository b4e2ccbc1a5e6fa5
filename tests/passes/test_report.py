"""The report observes: ObserveNormsPass records what the analysis found; statuses are a closed set."""

from __future__ import annotations

import contextlib
import io
import json

import onnx_ir as ir
import pytest
from _graphs import F32, RMS_CONSTS, D, X, build, n, rand, rms_real, serialized

from taperfold.errors import TaperfoldError
from taperfold.passes import FoldReport, NormStatus, ObserveNormsPass
from taperfold.passes.report import FusedGroup, LeftReader, ProjectionReport


def two_norms():
    """A real RMSNorm, then a constant-scale norm read by a residual Add (kept)."""
    return build(
        [*rms_real(), n("MatMul", ["h", "W"], ["a"]), n("Mul", ["a", "w2"], ["b"]), n("Add", ["a", "b"], ["y"])],
        [X],
        [("y", F32, [2, 3, D])],
        {**RMS_CONSTS, "g": rand(D), "W": rand(D, D), "w2": rand(D)},
    )


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
    data = report.to_json()
    summary = data["summary"]
    assert all(summary[status.value] == 1 for status in NormStatus)
    assert summary["norms"] == len(NormStatus) == sum(summary[status.value] for status in NormStatus)
    assert summary["bytes_rewritten"] == 10 * sum(range(len(NormStatus))) and summary["initializers_copied"] == 1
    assert json.loads(json.dumps(data)) == data
    assert report.norms[0].message == report.norms[0].status.value  # no reason: the status alone
    assert FoldReport.from_json(data).to_json() == data  # every status, the copies and byte counts read back


# ---- to_json / from_json: the report as `fold --report`, `fold --json` and manifest.json hold it --------------


def test_a_synthetic_report_with_projections_round_trips():
    report = FoldReport(
        nodes_before=20,
        nodes_after=12,
        constants_folded=2,
        constants_left=["big"],
        check_input="passed",
        check_output="passed",
        source="in.onnx",
        output="out.onnx",
    )
    report.entry("model.norm", "rms", NormStatus.FOLDED).consumers.append("q")
    report.projections = ProjectionReport(
        groups=[FusedGroup("h", ["q", "k"], ["attn.q", ""], "qk", [8, 4], bias=True, bytes_written=384)],
        left=[LeftReader("h", "add", "not a linear layer")],
        linear_before=3,
        linear_after=2,
    )
    data = report.to_json()
    assert (data["format"], data["format_version"]) == ("taperfold-fold-report", 1)
    assert list(data) == [
        "format",
        "format_version",
        "source",
        "output",
        "summary",
        "constants_left",
        "norms",
        "projections",
    ]
    again = FoldReport.from_json(json.loads(json.dumps(data)), "r.json")
    assert again == report and again.to_json() == data


@pytest.fixture(scope="module")
def llama_unfolded(tmp_path_factory):
    """taperfold's tiny llama at g = 0 as the torch exporter writes it: tapered norms, sibling projections unfused."""
    from taperfold.export import ExportOptions
    from taperfold.models import random_gate0_model
    from taperfold.tracing import export_to_ir

    path = tmp_path_factory.mktemp("llama") / "unfolded.onnx"
    model = random_gate0_model("tiny", "llama", n_layers=2, max_seq_len=32)
    ir.save(export_to_ir(model, ExportOptions()), path, external_data=path.name + ".data")
    return path


@pytest.mark.slow
def test_a_real_fold_report_reads_back_to_the_same_json_and_table(llama_unfolded, tmp_path, cli):
    from taperfold.ui import print_fold_report

    report_path, dst = tmp_path / "r.json", tmp_path / "f.onnx"
    r = cli("fold", llama_unfolded, "-o", dst, "--fuse-projections", "--report", report_path)
    assert r.exit_code == 0, r.stderr
    text = report_path.read_text()
    data = json.loads(text)
    assert (data["format"], data["format_version"], data["summary"]["folded"]) == ("taperfold-fold-report", 1, 4)
    report = FoldReport.from_json(data, str(report_path))
    assert report.projections is not None and len(report.projections.groups) == 4 and report.projections.left
    assert json.dumps(report.to_json(), indent=2) + "\n" == text  # to_json -> from_json -> to_json: the same bytes
    assert FoldReport.from_json(report.to_json()).to_json() == data
    from taperfold import ui

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_fold_report(str(llama_unfolded), str(dst), report, ui.out)
    assert out.getvalue() == r.stdout  # the table (and the projections' lines) from the report read back
    printed = cli("fold", llama_unfolded, "-o", dst, "--fuse-projections", "--json")
    assert json.loads(printed.stdout) == data  # --json prints the same report


@pytest.mark.slow
def test_the_manifests_fold_report_reads_back(tiny_export):
    from taperfold.manifest import read_manifest

    manifest = read_manifest(tiny_export)
    for key in ("folded", "folded.decoder"):
        data = manifest.report(key, "fold")
        assert (data["format"], data["format_version"]) == ("taperfold-fold-report", 1)
        report = FoldReport.from_json(data, f"manifest.json: artifacts.{key}.reports.fold")
        assert report.to_json() == data and report.count(NormStatus.FOLDED) == data["summary"]["folded"] > 0


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d.update(format_version=2),
            "key 'format_version' is 2; this taperfold reads taperfold-fold-report version 1",
        ),
        (
            lambda d: d.update(format="taperfold-bench"),
            "not a taperfold-fold-report report (key 'format' is 'taperfold-bench')",
        ),
        (
            lambda d: d["norms"][0].update(status="gone"),
            "key 'norms[0].status' must be one of folded, kept, not_foldable, real_norm, weights_merged, got 'gone'",
        ),
        (lambda d: d["summary"].pop("nodes_after"), "missing key 'summary.nodes_after'"),
        (
            lambda d: d["projections"]["groups"][0].update(widths=[8, "4"]),
            "key 'projections.groups[0].widths' must be a list of integers, got a list",
        ),
    ],
)
def test_a_bad_or_newer_fold_report_is_refused_in_one_line(edit, message):
    report = FoldReport(nodes_before=3, nodes_after=2)
    report.entry("norm", "rms", NormStatus.FOLDED)
    report.projections = ProjectionReport(groups=[FusedGroup("h", ["q", "k"], ["", ""], "qk", [8, 4], bias=False)])
    data = report.to_json()
    edit(data)
    with pytest.raises(TaperfoldError) as refused:
        FoldReport.from_json(data, "r.json")
    assert str(refused.value) == f"r.json: {message}"


def test_a_report_from_before_the_format_keys_is_read_as_version_1():
    report = FoldReport(nodes_before=3, nodes_after=2)
    report.entry("norm", "ln", NormStatus.KEPT).reason = "read by Add"
    old = {k: v for k, v in report.to_json().items() if k not in ("format", "format_version")}
    assert FoldReport.from_json(old).to_json() == report.to_json()
