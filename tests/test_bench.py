"""`taperfold bench`: statistics, round alternation, KV-cached decoding, report schema, CLI errors.
These check logic, never speed: shapes are tiny and iteration counts minimal."""

import csv
import io
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import one_line

from taperfold.bench.harness import Job, Schedule, rotated, run_rounds, split
from taperfold.bench.report import CSV_COLUMNS, BenchReport, check_report, csv_rows, throughput_stats, write_csv
from taperfold.bench.stats import summarize
from taperfold.checkpoint import load_checkpoint
from taperfold.engines import ENGINES, MODELS, Engine
from taperfold.errors import TaperfoldError
from taperfold.exportdir import GROWING
from taperfold.runners.base import InputSpec, Runner
from taperfold.runners.torch_runner import TorchRunner

TRT_LINE = "taperfold: error: tensorrt is not installed: pip install 'taperfold[trt]' on a machine with an NVIDIA GPU\n"


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    """The session's trained tiny checkpoint at g = 0 (the 'unfolded' variant)."""
    return load_checkpoint(tiny_checkpoint).build(gate=0.0)


@pytest.fixture(scope="module")
def bench_export(tiny_export):
    """The session's shared export (it includes the KV-cached decoders)."""
    return tiny_export


# ---- statistics and schedule ---------------------------------------------------------------------


def test_stats_of_known_samples():
    s = summarize([10, 1, 9, 2, 8, 3, 7, 4, 6, 5])  # 1..10, unordered
    assert (s.n, s.median, s.mean, s.min, s.max) == (10, 5.5, 5.5, 1.0, 10.0)
    assert s.p90 == pytest.approx(9.1) and s.p99 == pytest.approx(9.91)  # linear interpolation
    assert s.std == pytest.approx(math.sqrt(8.25))  # population std
    assert s.cv_pct == pytest.approx(100 * math.sqrt(8.25) / 5.5)
    ms = s.scaled(1e3)
    assert ms.median == 5500.0 and ms.cv_pct == s.cv_pct and ms.n == 10


def test_stats_of_constant_samples_have_zero_spread():
    s = summarize([2.0, 2.0, 2.0])
    assert (s.median, s.p99, s.std, s.cv_pct) == (2.0, 2.0, 0.0, 0.0)


def test_schedule_spreads_iterations_and_warmup_over_rounds():
    assert split(10, 4) == [3, 3, 2, 2]
    sched = Schedule(warmup=2, iters=7, rounds=3)
    assert sched.iter_slices == [3, 2, 2]
    assert sched.warmup_slices == [1, 1, 1]  # at least one warm-up call before every slice
    assert Schedule(warmup=0, iters=3, rounds=3).warmup_slices == [0, 0, 0]
    assert sched.calls_per_variant() == 1 + 3 + 7
    assert Schedule(warmup=2, iters=7, rounds=3, pipelined=True).calls_per_variant() == 1 + 3 + 7 + 7
    with pytest.raises(ValueError):
        Schedule(warmup=1, iters=2, rounds=3)


def _recording_job(name, calls):
    """A job whose sample is the position of its call in `calls` (to check which calls were kept)."""

    def synced():
        calls.append(name)
        return len(calls)

    def pipelined(n):
        calls.append(f"{name}x{n}")
        return len(calls)

    return Job(synced, pipelined)


def test_rounds_alternate_variants_in_rotated_order():
    calls = []
    samples = run_rounds({v: _recording_job(v, calls) for v in "ABC"}, Schedule(warmup=3, iters=6, rounds=3))
    expected = list("ABC")  # first runs
    for r in range(3):
        for v in rotated(list("ABC"), r):
            expected += [v] * (1 + 2)  # one warm-up call, two timed calls per slice
    assert calls == expected
    assert rotated(list("ABC"), 1) == list("BCA") and rotated(list("ABC"), 2) == list("CAB")
    assert samples.first == {"A": 1, "B": 2, "C": 3}
    assert samples.synced["A"] == [5, 6, 20, 21, 26, 27]  # call 4, 19, 25: warm-up, not recorded
    assert all(len(t) == 6 for t in samples.synced.values()) and samples.pipelined == {}


def test_a_pipelined_schedule_adds_one_sample_of_each_slice_s_calls():
    calls, ticks = [], []
    samples = run_rounds(
        {v: _recording_job(v, calls) for v in "AB"},
        Schedule(warmup=2, iters=5, rounds=2, pipelined=True),
        on_call=lambda: ticks.append(1),
    )
    # first runs; then per slice: a warm-up call, the synced calls, their count again as one pipelined sample
    assert calls == [
        "A",
        "B",
        "A",
        "A",
        "A",
        "A",
        "Ax3",
        "B",
        "B",
        "B",
        "B",
        "Bx3",
        "B",
        "B",
        "B",
        "Bx2",
        "A",
        "A",
        "A",
        "Ax2",
    ]
    assert samples.synced == {"A": [4, 5, 6, 18, 19], "B": [9, 10, 11, 14, 15]}
    assert samples.pipelined == {"A": [7, 20], "B": [12, 16]}
    assert len(ticks) == 2 * Schedule(warmup=2, iters=5, rounds=2, pipelined=True).calls_per_variant()
    with pytest.raises(ValueError, match="pipelined"):
        run_rounds({"A": Job(lambda: 0)}, Schedule(warmup=0, iters=1, rounds=1, pipelined=True))


# ---- KV-cached decoding --------------------------------------------------------------------------


def _full_forward_logits(model, prompt, gen):
    """Logits of the last position of prompt + every fed token, without a cache."""
    steps = gen.tokens.shape[1] - 1
    ids = np.concatenate([prompt, gen.tokens[:, :steps]], axis=1)
    with torch.inference_mode():
        return model(torch.from_numpy(ids), logits="last").numpy()


@pytest.mark.parametrize("variant", ["unfolded", "baseline"])
def test_torch_kv_decoding_matches_the_full_forward_pass(tiny_model, variant):
    from taperfold.models import baseline_of

    model = tiny_model if variant == "unfolded" else baseline_of(tiny_model)
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 7), dtype=np.int64)
    with TorchRunner(model, graph=GROWING) as runner:
        gen = runner.generate(prompt, steps=5, cfg=model.cfg, dtype="fp32")
    assert gen.tokens.shape == (2, 6) and len(gen.step_s) == 5
    np.testing.assert_allclose(gen.last_logits, _full_forward_logits(model, prompt, gen), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["unfolded.decoder.onnx", "model.decoder.onnx"])
def test_ort_decoder_graph_matches_the_torch_full_forward(bench_export, tiny_model, graph):
    from taperfold.runners.ort import OrtRunner

    prompt = np.random.default_rng(1).integers(0, tiny_model.cfg.vocab_size, (2, 9), dtype=np.int64)
    with OrtRunner(bench_export / graph, threads=1) as runner:
        gen = runner.generate(prompt, steps=4, cfg=tiny_model.cfg, dtype="fp32")
    np.testing.assert_allclose(gen.last_logits, _full_forward_logits(tiny_model, prompt, gen), rtol=1e-4, atol=1e-5)


# ---- synced and pipelined timings in the report and the tables --------------------------------------------


class DeviceClock:
    """The device time of the calls launched since start, plus `wait_s` for the one wait that ends a measurement."""

    def __init__(self, runner, wait_s: float):
        self.runner, self.wait_s = runner, wait_s

    def start(self):
        self.first = self.runner.launched

    def stop(self, wait):
        wait()
        return (self.runner.launched - self.first) * self.runner.call_s + self.wait_s


class LaunchBoundRunner(Runner):
    """A GPU-like engine without a GPU: each call costs `call_s` of device time (baseline 2 ms, others 1 ms) and each
    wait for the device 1 ms, so synced calls cost call_s + 1 ms and n pipelined calls call_s + 1 ms / n each.
    Launch number `fail_at` fails in the engine."""

    def __init__(self, name: str, fail_at: int | None = None):
        super().__init__(name)
        self._inputs, self._outputs = ["input_ids"], ["logits"]
        self._specs = {"input_ids": InputSpec(rank=2, floating=False)}
        self.call_s = 2e-3 if name.startswith("baseline") else 1e-3
        self.launched, self.fail_at = 0, fail_at

    def _load(self):
        pass

    def _prepare(self, feeds):
        return feeds["input_ids"]

    def _launcher(self, prepared):
        def launch():
            self.launched += 1
            if self.launched == self.fail_at:
                raise self.error("the engine failed")
            return {"logits": np.zeros((prepared.shape[0], 4), np.float32)}

        return launch

    def _clock(self):
        return DeviceClock(self, 1e-3)

    def to_numpy(self, value):
        return value


def launch_bound_engine(fail_at: int | None = None) -> Engine:
    """Stands in for the torch engine (its name and options, so that the CLI's flags still map to an engine)."""

    def open_runner(model, *, device, threads, graph, logits, name, shapes=None, **options):
        return LaunchBoundRunner(name, fail_at)

    return Engine(
        "torch",
        "Launch-bound",
        MODELS,
        default_device="cpu",
        devices=("cpu",),
        decodes=False,
        options=ENGINES["torch"].options,
        module=SimpleNamespace(open_runner=open_runner, unavailable=lambda device: None),
    )


@pytest.fixture
def launch_bound_report(monkeypatch):
    """Baseline and folded through LaunchBoundRunner, B2 T8, 4 timed calls in 2 rounds: pipelined samples of 2 calls."""
    from taperfold.bench.measure import BenchOptions, load_bench, run_bench
    from taperfold.bench.source import resolve_source

    monkeypatch.setitem(ENGINES, "torch", launch_bound_engine())
    opts = BenchOptions(
        engine="torch", variants=["baseline", "folded"], batches=[2], seqs=[8], warmup=1, iters=4, rounds=2
    )
    with load_bench(resolve_source(None, None, "tiny"), opts) as loaded:
        return run_bench(loaded)


def test_report_carries_both_timings_and_takes_throughput_from_pipelined(launch_bound_report):
    report = launch_bound_report
    assert report.to_json()["format_version"] == 2 and list(report.timing) == ["synced", "pipelined"]
    rows = {r.variant: r for r in report.results}
    for variant, call_ms in (("baseline", 2.0), ("folded", 1.0)):
        row = rows[variant]
        assert row.throughput_from == "pipelined" and row.pipelined.calls == [2, 2]
        assert len(row.synced.times_ms) == 4 and len(row.pipelined.times_ms) == 2
        assert row.synced.stats_ms.median == pytest.approx(call_ms + 1.0)  # each call waited for
        assert row.pipelined.stats_ms.median == pytest.approx(call_ms + 0.5)  # one wait per 2 calls
        assert row.tokens_per_s == pytest.approx(16 / ((call_ms + 0.5) / 1e3))
        assert row.throughput_stats == row.pipelined.stats_ms
        assert throughput_stats(row.to_json()) == row.pipelined.stats_ms.to_dict()  # the JSON's own reader agrees
    assert rows["folded"].speedup_vs_baseline == pytest.approx(2.5 / 1.5)  # pipelined; synced would give 3 / 2
    csv_row = {r["variant"]: r for r in csv_rows(report)}["folded"]
    assert (csv_row["synced_median_ms"], csv_row["pipelined_median_ms"]) == pytest.approx((2.0, 1.5))
    assert (csv_row["synced_n"], csv_row["pipelined_n"], csv_row["pipelined_calls"]) == (4, 2, 4)
    assert csv_row["throughput_from"] == "pipelined" and list(csv_row) == CSV_COLUMNS


def _rows(table) -> list[list[str]]:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=240, color_system=None)
    console.print(table)
    return [
        [c.strip() for c in line.split("│")[1:-1]]
        for line in console.file.getvalue().splitlines()
        if line.startswith("│")
    ]


def test_throughput_table_shows_pipelined_and_latency_table_synced(launch_bound_report):
    from taperfold.ui import detail_table, throughput_table

    table = throughput_table(launch_bound_report, "prefill")
    assert table.title == (
        "prefill throughput (k tokens/s, median, pipelined calls) — torch cpu fp32, "
        f"{launch_bound_report.threads} threads"
    )
    # k tokens/s = 16 tokens / ms per call: baseline 2.5 ms, folded 1.5 ms pipelined (3 and 2 ms synced)
    assert _rows(table) == [["2", "8", f"{16 / 2.5:.1f}", f"{16 / 1.5:.1f}", f"{2.5 / 1.5:.3f}"]]
    table = detail_table(launch_bound_report)
    assert table.title == "latency per call (ms, synced calls)"
    assert [(r[1], r[5]) for r in _rows(table)] == [("baseline", "3.000"), ("folded", "2.000")]  # the medians


@pytest.mark.parametrize("fail_at, what", [(2, "a synced call"), (5, "a pipelined run of 2 calls")])
def test_a_failure_in_either_timing_is_one_line(fail_at, what, monkeypatch, cli):
    # launches: the first run (1), two synced calls (2, 3), then the two pipelined calls (4, 5)
    monkeypatch.setitem(ENGINES, "torch", launch_bound_engine(fail_at))
    r = cli(
        "bench",
        "--preset",
        "tiny",
        "--variants",
        "folded",
        "--batch",
        "1",
        "--seq",
        "8",
        "--warmup",
        "0",
        "--iters",
        "2",
        "--rounds",
        "1",
    )
    assert (r.exit_code, r.stderr) == (
        2,
        f"taperfold: error: folded (--preset tiny): the engine failed (during {what})\n",
    )


def as_version_1(data: dict) -> dict:
    """A version-2 report as version 1 wrote it: one set of synced timings per row (decode: and `generation_ms`)."""
    rows = []
    for row in data["results"]:
        old = {k: v for k, v in row.items() if k not in ("synced", "pipelined", "generation", "throughput_from")}
        old.update(times_ms=row["synced"]["times_ms"], stats_ms=row["synced"]["stats_ms"])
        if "generation" in row:
            old["generation_ms"] = row["generation"]["times_ms"]
        rows.append(old)
    return {**{k: v for k, v in data.items() if k != "timing"}, "format_version": 1, "results": rows}


def test_reports_of_both_versions_are_read_and_others_refused(launch_bound_report):
    data = launch_bound_report.to_json()
    v1_row = {"stats_ms": {"cv_pct": 3.0}, "tokens_per_s": 1.0}  # version 1: one set of synced timings
    assert throughput_stats(v1_row) == {"cv_pct": 3.0}
    assert check_report({**data, "format_version": 1}, "old.json")["format_version"] == 1
    with pytest.raises(
        TaperfoldError,
        match=r"^new\.json: key 'format_version' is 3; this taperfold reads "
        r"taperfold-bench versions 1, 2$",
    ):
        check_report({**data, "format_version": 3}, "new.json")
    with pytest.raises(TaperfoldError, match=r"^x\.json: not a taperfold-bench report \(key 'format'\)$"):
        check_report({"format": "taperfold-export"}, "x.json")
    # typed: version 1 is upgraded (throughput from the synced calls, the only timing it had), then written as 2
    old = BenchReport.from_json(as_version_1(data), "old.json")
    assert [(r.throughput_from, r.pipelined) for r in old.results] == [("synced", None)] * 2
    assert [r.synced for r in old.results] == [r.synced for r in launch_bound_report.results]
    assert old.to_json()["format_version"] == 2 and list(old.timing) == ["synced"]
    assert BenchReport.from_json(old.to_json(), "old.json").to_json() == old.to_json()


# ---- the report read back: its JSON, CSV and tables are views of one BenchReport ----------------------------


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_real_run_reads_back_to_the_same_json_csv_and_tables(mode, tmp_path, cli):
    import contextlib

    from taperfold.ui import print_bench

    report_path, csv_path = tmp_path / "b.json", tmp_path / "b.csv"
    lengths = ("--seq", "8,16") if mode == "prefill" else ("--prompt", "4", "--new-tokens", "2")
    r = cli(
        "bench",
        "--preset",
        "tiny",
        "--engine",
        "torch",
        "--mode",
        mode,
        "--batch",
        "1,2",
        *lengths,
        "--warmup",
        "0",
        "--iters",
        "2",
        "--threads",
        "1",
        "--variants",
        "baseline,folded",
        "--report",
        report_path,
        "--csv",
        csv_path,
    )
    assert r.exit_code == 0, r.stderr
    report = BenchReport.read(report_path)
    assert json.dumps(report.to_json(), indent=2) + "\n" == report_path.read_text()  # the bytes bench wrote
    assert BenchReport.from_json(report.to_json()).to_json() == report.to_json()
    assert len(report.results) == 8 and report.phases() == (  # 2 batches x 2 variants x 2 lengths or phases
        ["prefill"] if mode == "prefill" else ["prefill", "decode"]
    )
    write_csv(tmp_path / "again.csv", report)
    assert (tmp_path / "again.csv").read_text() == csv_path.read_text()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        print_bench(report)
    assert (out.getvalue(), err.getvalue()) == (r.stdout, r.stderr)  # the tables, notes and CV warnings


def test_a_bad_or_newer_report_is_refused_in_one_line(launch_bound_report, tmp_path):
    import copy

    data = launch_bound_report.to_json()

    def changed(edit) -> dict:
        bad = copy.deepcopy(data)
        edit(bad)
        return bad

    cases = [
        (
            {**data, "format_version": 3},
            "key 'format_version' is 3; this taperfold reads taperfold-bench versions 1, 2",
        ),
        ({**data, "format": "taperfold-verify"}, "not a taperfold-bench report (key 'format')"),
        (
            changed(lambda d: d["results"][1]["synced"]["stats_ms"].update(median="fast")),
            "key 'results[1].synced.stats_ms.median' must be a number, got 'fast'",
        ),
        (changed(lambda d: d["results"][0].pop("tokens_per_s")), "missing key 'results[0].tokens_per_s'"),
        (
            changed(lambda d: d["results"][0].update(throughput_from="generation")),
            "key 'results[0].throughput_from' names 'generation', which the row has no timing of",
        ),
        (
            changed(lambda d: d["results"][0].update(phase="warmup")),
            "key 'results[0].phase' must be one of prefill, decode, got 'warmup'",
        ),
        (changed(lambda d: d["settings"].update(iters=None)), "key 'settings.iters' must be an integer, got None"),
        (changed(lambda d: d.update(results={})), "key 'results' must be a list of objects, got an object"),
    ]
    path = tmp_path / "b.json"
    for bad, message in cases:
        path.write_text(json.dumps(bad))
        with pytest.raises(TaperfoldError) as refused:
            BenchReport.read(path)
        assert str(refused.value) == f"{path}: {message}"
    path.write_text("{")
    with pytest.raises(TaperfoldError, match=r"^[^\n]*b\.json: not valid JSON [^\n]*$"):
        BenchReport.read(path)


# ---- CLI: reports and errors ---------------------------------------------------------------------


@pytest.mark.slow
def test_bench_end_to_end_json_csv_and_bench_json(bench_export, tmp_path, cli):
    out_json, out_csv = tmp_path / "b.json", tmp_path / "b.csv"
    r = cli(
        "bench",
        bench_export,
        "--engine",
        "ort",
        "--batch",
        "1,2",
        "--seq",
        "8,16",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--json",
        out_json,
        "--csv",
        out_csv,
    )
    assert r.exit_code == 0, r.stderr
    assert "prefill throughput (k tokens/s, median, pipelined calls)" in r.stdout
    assert "latency per call (ms, synced calls)" in r.stdout
    report = json.loads(out_json.read_text())
    assert json.loads((bench_export / "bench.json").read_text()) == report
    for key in (
        "format",
        "format_version",
        "created",
        "mode",
        "engine",
        "device",
        "dtype",
        "threads",
        "timing",
        "source",
        "config",
        "settings",
        "environment",
        "results",
        "warnings",
    ):
        assert key in report, key
    assert report["threads"] == 1 and report["settings"]["rounds"] == 2 and report["settings"]["cv_warn_pct"] == 5.0
    assert {"cpu", "versions", "torch_threads"} <= set(report["environment"])
    assert list(report["timing"]) == ["synced", "pipelined"]
    assert len(report["results"]) == 3 * 4  # variants x cells
    for row in report["results"]:
        assert row["phase"] == "prefill" and len(row["synced"]["times_ms"]) == 2
        assert row["pipelined"]["calls"] == [1, 1] and len(row["pipelined"]["times_ms"]) == 2
        for mode in ("synced", "pipelined"):
            assert set(row[mode]["stats_ms"]) == {"n", "median", "mean", "p90", "p99", "min", "max", "std", "cv_pct"}
        assert row["throughput_from"] == "pipelined"
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / (row["pipelined"]["stats_ms"]["median"] / 1e3))
        assert row["first_run_ms"] > 0
        if row["variant"] == "baseline":
            assert row["speedup_vs_baseline"] == 1.0
    rows = list(csv.DictReader(out_csv.open()))
    assert list(rows[0]) == CSV_COLUMNS and len(rows) == 12
    assert {r["variant"] for r in rows} == {"baseline", "unfolded", "folded"}
    assert all(float(r["synced_median_ms"]) > 0 and float(r["pipelined_median_ms"]) > 0 for r in rows)


@pytest.mark.slow
def test_bench_decode_mode_reports_per_token_times(bench_export, tmp_path, cli):
    out_json = tmp_path / "d.json"
    r = cli(
        "bench",
        bench_export,
        "--mode",
        "decode",
        "--batch",
        "1",
        "--prompt",
        "8",
        "--new-tokens",
        "3",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--variants",
        "unfused,folded",
        "--json",
        out_json,
    )
    assert r.exit_code == 0, r.stderr
    assert "decode throughput (tokens/s, median, whole generations)" in r.stdout
    assert "prefill throughput (k tokens/s, median, synced calls)" in r.stdout  # the prompts
    report = json.loads(out_json.read_text())
    rows = report["results"]
    assert [(row["variant"], row["phase"]) for row in rows] == [
        ("unfolded", "prefill"),
        ("unfolded", "decode"),
        ("folded", "prefill"),
        ("folded", "decode"),
    ]
    assert list(report["timing"]) == ["synced", "generation"]
    prompt, decode = rows[0], rows[1]
    assert prompt["throughput_from"] == "synced" and "pipelined" not in prompt
    assert decode["throughput_from"] == "generation" and "pipelined" not in decode
    assert len(decode["synced"]["times_ms"]) == 2 and all(len(t) == 3 for t in decode["synced"]["times_ms"])
    assert decode["synced"]["stats_ms"]["n"] == 6 and len(decode["generation"]["times_ms"]) == 2
    assert decode["tokens_per_s"] == pytest.approx(3 / (decode["generation"]["stats_ms"]["median"] / 1e3))
    assert rows[0]["speedup_vs_baseline"] is None  # no baseline asked for


def test_bench_torch_engine_from_a_checkpoint(tiny_checkpoint, tmp_path, cli):
    r = cli(
        "bench",
        "--checkpoint",
        tiny_checkpoint,
        "--batch",
        "1",
        "--seq",
        "8",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--csv",
        tmp_path / "t.csv",
    )
    assert r.exit_code == 0, r.stderr
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [row["engine"] for row in rows] == ["torch"] * 3


def test_a_bench_request_made_in_python_runs_as_the_command_does(tiny_checkpoint, tmp_path, capsys):
    from taperfold.bench.command import run_request
    from taperfold.bench.request import BenchRequest

    request = BenchRequest(
        checkpoint=str(tiny_checkpoint), variants=("folded",), batches="1", seqs="8", iters=2, warmup=0,
        csv_path=str(tmp_path / "t.csv"),
    )  # fmt: skip
    report = run_request(request)
    assert report.engine == "torch" and [r.variant for r in report.results] == ["folded"]
    assert "folded" in capsys.readouterr().out  # the command's tables
    assert [row["variant"] for row in csv.DictReader((tmp_path / "t.csv").open())] == ["folded"]


def test_a_bench_request_from_the_command_line_is_normalised_once():
    from taperfold.bench.request import BenchRequest
    from taperfold.cli import cli as taperfold_cli

    argv = ["--preset", "tiny", "--variants", "unfused, folded", "--against", "genai-builder,", "--cuda-graph"]
    with taperfold_cli.commands["bench"].make_context("bench", argv) as ctx:
        request = BenchRequest.from_cli(ctx.params)
    assert request.variants == ("unfolded", "folded") and request.against == ("genai-builder",)
    assert request.engine_options == {"cuda_graph": True}  # only the engine options the user set
    assert request.engine_name == "torch" and request.batches == "1,4"  # lists parsed by the mode that reads them
    # an engine option registered after the command line was built (engines.register) has no flag: not asked for
    unoffered = {name: value for name, value in ctx.params.items() if name != "cuda_graph"}
    assert BenchRequest.from_cli(unoffered).engine_options == {}


def test_decode_without_decoder_graphs_says_re_export(bench_export, tmp_path, cli):
    manifest = json.loads((Path(bench_export) / "manifest.json").read_text())
    manifest["artifacts"] = {v: manifest["artifacts"][v] for v in ("baseline", "unfolded", "folded")}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    r = cli("bench", tmp_path, "--mode", "decode", "--prompt", "8", "--new-tokens", "2")
    assert r.exit_code == 2
    assert r.stderr.startswith("taperfold: error: ") and "re-export with --kv-cache" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--mode", "decode", "--kv-cache", "static"],
            "missing key 'artifacts.baseline.static': re-export with --kv-cache",
        ),
        (["--cuda-graph"], "--cuda-graph needs --device cuda"),
        (["--engine", "trt"], "tensorrt is not installed"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: this onnxruntime build has no CUDA execution provider",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA"),
        ),
    ],
)
def test_refusals_after_a_default_length_note_are_one_line(tiny_export, cli, args, message):
    # the default lengths pass the tiny model's context, which is a note: a refusal still prints only its own line
    r = cli("bench", tiny_export, "--iters", "1", "--warmup", "0", *args)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


@pytest.mark.slow
def test_missing_tensorrt_is_one_line_and_exit_2(bench_export, monkeypatch, cli):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` now raises ImportError
    r = cli("bench", bench_export, "--engine", "trt", "--seq", "8", "--iters", "1")
    assert (r.exit_code, r.stderr) == (2, TRT_LINE)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "tiny", "--variants", "baseline,fast"], "--variants: unknown ['fast']"),
        (["--preset", "tiny", "--iters", "2", "--rounds", "3"], "--rounds 3 exceeds --iters 2"),
        (["--preset", "tiny", "--batch", "1,x"], "--batch: '1,x' is not a comma-separated list"),
        (["--preset", "tiny", "--seq", "4096"], "--seq 4096 exceeds the model's context (max_seq_len 128)"),
        (["--preset", "tiny", "--seq", "8", "--engine", "ort"], "--engine ort runs exported graphs"),
        (
            ["--preset", "tiny", "--seq", "8", "--ort-optimization", "basic"],
            "--ort-optimization applies to --engine ort",
        ),
        ([], "give exactly one of DIR"),
    ],
)
def test_bad_input_is_one_error_line(args, message, cli):
    r = cli("bench", *args)
    assert r.exit_code == 2
    assert r.stderr.startswith("taperfold: error: ") and message in r.stderr and r.stderr.count("\n") == 1


# ---- fused projections on the torch engine -------------------------------------------------------------------


def test_torch_engine_fuses_projections_as_the_export_did_unless_told(bench_export, tiny_checkpoint, tmp_path, cli):
    groups = 2 * json.loads((Path(bench_export) / "manifest.json").read_text())["config"]["n_layers"]  # q/k/v, gate/up

    def bench(*args):
        report = tmp_path / "report.json"
        r = cli(
            "bench",
            *args,
            "--batch",
            "1",
            "--seq",
            "8",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--variants",
            "baseline,folded",
            "--report",
            report,
            "--csv",
            tmp_path / "r.csv",
        )
        assert r.exit_code == 0, r.stderr
        rows = list(csv.DictReader((tmp_path / "r.csv").open()))
        return json.loads(report.read_text()), r.stdout, {row["fused_projections"] for row in rows}

    # the export fused its graphs (export's default): torch runs the same layers, one per group
    ort, _, _ = bench(bench_export, "--engine", "ort")
    report, stdout, column = bench(bench_export, "--engine", "torch")
    assert report["fused_projections"] is True and column == {"True"}
    assert report["projection_groups"] == ort["projection_groups"] == {"baseline": groups, "folded": groups}
    assert (
        f"projections fused: each group of siblings (q/k/v, gate/up) runs as one layer; groups: baseline "
        f"{groups}, folded {groups}" in stdout
    )
    report, stdout, column = bench(bench_export, "--engine", "torch", "--no-fuse-projections")
    assert (report["fused_projections"], report["projection_groups"], column) == (
        False,
        {"baseline": 0, "folded": 0},
        {"False"},
    )
    assert "projections unfused: each linear layer runs on its own" in stdout
    # a checkpoint has no export to match: unfused unless asked
    report, _, _ = bench("--checkpoint", tiny_checkpoint)
    assert (report["fused_projections"], report["projection_groups"]["folded"]) == (False, 0)
    report, _, _ = bench("--checkpoint", tiny_checkpoint, "--fuse-projections")
    assert (report["fused_projections"], report["projection_groups"]["folded"]) == (True, groups)


def test_graph_engines_refuse_a_fusion_their_graphs_lack_in_one_line(bench_export, cli):
    args = ("bench", bench_export, "--engine", "ort", "--seq", "8", "--iters", "1", "--warmup", "0")
    r = cli(*args, "--no-fuse-projections")
    manifest = Path(bench_export) / "manifest.json"
    assert (r.exit_code, r.stderr) == (
        2,
        f"taperfold: error: --no-fuse-projections: --engine ort times the graphs as "
        f"exported, fused ({manifest}: key 'export.fuse_projections'); re-export "
        "with --no-fuse-projections, or time --engine torch\n",
    )
    assert cli(*args, "--fuse-projections").exit_code == 0  # what the graphs are: nothing to refuse


def test_a_manifest_with_a_bad_projection_count_is_one_line(bench_export, tmp_path, cli):
    import shutil

    out = shutil.copytree(bench_export, tmp_path / "out")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["artifacts"]["folded"]["projections"]["summary"] = {"groups": "eight"}
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = cli("bench", out, "--engine", "ort", "--seq", "8", "--iters", "1", "--warmup", "0")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "key 'artifacts.folded.projections.summary.groups' must be a count, got 'eight'" in r.stderr


def test_fuse_projections_with_a_graph_engine_and_no_export_is_the_engines_own_line(cli):
    r = cli("bench", "--preset", "tiny", "--engine", "ort", "--fuse-projections")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1  # the refusal alone: the --seq note is not printed
    assert "taperfold: error: --engine ort runs exported graphs: give an export directory (DIR)" in r.stderr


# ---- defaults that fit the model, refusals ------------------------------------------------------------------


def test_bench_default_lengths_are_capped_at_the_context_and_say_so(tiny_export, tmp_path, cli):
    report = tmp_path / "b.json"
    r = cli(
        "bench",
        tiny_export,
        "--engine",
        "ort",
        "--variants",
        "folded",
        "--batch",
        "1",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--report",
        report,
    )
    assert r.exit_code == 0, r.stderr
    assert "note: --seq: the defaults 128,256,512 are capped at the model's context (128): timing 128" in r.stderr
    assert {row["seq"] for row in json.loads(report.read_text())["results"]} == {128}
    r = cli(
        "bench",
        tiny_export,
        "--engine",
        "ort",
        "--mode",
        "decode",
        "--variants",
        "folded",
        "--batch",
        "1",
        "--new-tokens",
        "4",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--report",
        report,
    )
    assert r.exit_code == 0, r.stderr
    assert (
        "note: --prompt: the default 128 + --new-tokens 4 would pass the model's context (128): prompt 124" in r.stderr
    )
    one_line(cli("bench", tiny_export, "--engine", "ort", "--seq", "512"), "--seq 512 exceeds the model's context")


def test_bench_refuses_a_batch_no_graph_takes(tiny_export, cli):
    one_line(cli("bench", tiny_export, "--batch", str(10**12)), "--batch", "largest allowed, 4096")
    r = cli("bench", tiny_export, "--threads", str(10**12))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "'--threads'" in r.stderr


def test_bench_names_a_variant_the_export_left_out_in_one_line(tmp_path, cli):
    """An export --no-baseline has no baseline of any graph: bench's default variants say so in one line, naming what
    it can time, rather than asking for a re-export with a KV cache."""
    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
    from taperfold.export import ExportOptions, export_checkpoint
    from taperfold.models import random_gate0_model

    ckpt = save_checkpoint(checkpoint_from_model(random_gate0_model("tiny"), step=0), tmp_path / "tiny.pt")
    out = export_checkpoint(ckpt, tmp_path / "out", ExportOptions(baseline=False)).out_dir
    for args in ([], ["--mode", "decode", "--kv-cache", "static"]):
        result = cli("bench", out, "--seq", "8", "--prompt", "4", "--new-tokens", "2", "--iters", "1", *args)
        one_line(result, "baseline was not exported", "--no-baseline", "--variants unfolded,folded")
    assert not (out / "bench.json").exists() and not (out / "bench-decode.json").exists()
