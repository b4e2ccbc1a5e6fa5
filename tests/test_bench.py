"""`taperfold bench`: statistics, round alternation, KV-cached decoding, report schema, CLI errors.
These check logic, never speed: shapes are tiny and iteration counts minimal."""

import csv
import json
from pathlib import Path
import math
import sys

import numpy as np
import pytest
import torch

from taperfold.bench.decode import generate
from taperfold.bench.harness import Schedule, rotated, run_rounds, split
from taperfold.bench.report import CSV_COLUMNS
from taperfold.bench.stats import summarize
from taperfold.checkpoint import load_checkpoint
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
    with pytest.raises(ValueError):
        Schedule(warmup=1, iters=2, rounds=3)


def test_rounds_alternate_variants_in_rotated_order():
    calls = []

    def job(name):
        def call():
            calls.append(name)
            return len(calls)  # the sample: the call's position, to check which calls were kept
        return call

    samples = run_rounds({v: job(v) for v in "ABC"}, Schedule(warmup=3, iters=6, rounds=3))
    expected = list("ABC")  # first runs
    for r in range(3):
        for v in rotated(list("ABC"), r):
            expected += [v] * (1 + 2)  # one warm-up call, two timed calls per slice
    assert calls == expected
    assert rotated(list("ABC"), 1) == list("BCA") and rotated(list("ABC"), 2) == list("CAB")
    assert samples.first == {"A": 1, "B": 2, "C": 3}
    assert samples.timed["A"] == [5, 6, 20, 21, 26, 27]  # call 4, 19, 25: warm-up, not recorded
    assert all(len(t) == 6 for t in samples.timed.values())


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
    with TorchRunner(model, decoder=True) as runner:
        gen = generate(runner, prompt, steps=5, cfg=model.cfg, dtype="fp32")
    assert gen.tokens.shape == (2, 6) and len(gen.step_s) == 5
    np.testing.assert_allclose(gen.last_logits, _full_forward_logits(model, prompt, gen), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["unfolded.decoder.onnx", "model.decoder.onnx"])
def test_ort_decoder_graph_matches_the_torch_full_forward(bench_export, tiny_model, graph):
    from taperfold.runners.ort import OrtRunner

    prompt = np.random.default_rng(1).integers(0, tiny_model.cfg.vocab_size, (2, 9), dtype=np.int64)
    with OrtRunner(bench_export / graph, threads=1) as runner:
        gen = generate(runner, prompt, steps=4, cfg=tiny_model.cfg, dtype="fp32")
    np.testing.assert_allclose(gen.last_logits, _full_forward_logits(tiny_model, prompt, gen), rtol=1e-4, atol=1e-5)


# ---- CLI: reports and errors ---------------------------------------------------------------------


@pytest.mark.slow
def test_bench_end_to_end_json_csv_and_bench_json(bench_export, tmp_path, cli):
    out_json, out_csv = tmp_path / "b.json", tmp_path / "b.csv"
    r = cli("bench", bench_export, "--engine", "ort", "--batch", "1,2", "--seq", "8,16", "--iters", "2",
                "--warmup", "1", "--threads", "1", "--json", out_json, "--csv", out_csv)
    assert r.exit_code == 0, r.stderr
    assert "prefill throughput" in r.stdout
    report = json.loads(out_json.read_text())
    assert json.loads((bench_export / "bench.json").read_text()) == report
    for key in ("format", "format_version", "created", "mode", "engine", "device", "dtype", "threads", "source",
                "config", "settings", "environment", "results", "warnings"):
        assert key in report, key
    assert report["threads"] == 1 and report["settings"]["rounds"] == 2 and report["settings"]["cv_warn_pct"] == 5.0
    assert {"cpu", "versions", "torch_threads"} <= set(report["environment"])
    assert len(report["results"]) == 3 * 4  # variants x cells
    for row in report["results"]:
        assert row["phase"] == "prefill" and len(row["times_ms"]) == 2
        assert set(row["stats_ms"]) == {"n", "median", "mean", "p90", "p99", "min", "max", "std", "cv_pct"}
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / (row["stats_ms"]["median"] / 1e3))
        assert row["first_run_ms"] > 0
        if row["variant"] == "baseline":
            assert row["speedup_vs_baseline"] == 1.0
    rows = list(csv.DictReader(out_csv.open()))
    assert list(rows[0]) == CSV_COLUMNS and len(rows) == 12
    assert {r["variant"] for r in rows} == {"baseline", "unfolded", "folded"}


@pytest.mark.slow
def test_bench_decode_mode_reports_per_token_times(bench_export, tmp_path, cli):
    out_json = tmp_path / "d.json"
    r = cli("bench", bench_export, "--mode", "decode", "--batch", "1", "--prompt", "8", "--new-tokens", "3",
                "--iters", "2", "--warmup", "1", "--variants", "unfused,folded", "--json", out_json)
    assert r.exit_code == 0, r.stderr
    rows = json.loads(out_json.read_text())["results"]
    assert [(row["variant"], row["phase"]) for row in rows] == [
        ("unfolded", "prefill"), ("unfolded", "decode"), ("folded", "prefill"), ("folded", "decode")]
    decode = rows[1]
    assert len(decode["times_ms"]) == 2 and all(len(t) == 3 for t in decode["times_ms"])
    assert decode["stats_ms"]["n"] == 6 and len(decode["generation_ms"]) == 2
    assert rows[0]["speedup_vs_baseline"] is None  # no baseline asked for


def test_bench_torch_engine_from_a_checkpoint(tiny_checkpoint, tmp_path, cli):
    r = cli("bench", "--checkpoint", tiny_checkpoint, "--batch", "1", "--seq", "8", "--iters", "2", "--warmup", "0",
                "--csv", tmp_path / "t.csv")
    assert r.exit_code == 0, r.stderr
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [row["engine"] for row in rows] == ["torch"] * 3


def test_decode_without_decoder_graphs_says_re_export(bench_export, tmp_path, cli):
    manifest = json.loads((Path(bench_export) / "manifest.json").read_text())
    manifest["artifacts"] = {v: manifest["artifacts"][v] for v in ("baseline", "unfolded", "folded")}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    r = cli("bench", tmp_path, "--mode", "decode", "--prompt", "8", "--new-tokens", "2")
    assert r.exit_code == 2
    assert r.stderr.startswith("taperfold: error: ") and "re-export with --kv-cache" in r.stderr


@pytest.mark.slow
def test_missing_tensorrt_is_one_line_and_exit_2(bench_export, monkeypatch, cli):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` now raises ImportError
    r = cli("bench", bench_export, "--engine", "trt", "--seq", "8", "--iters", "1")
    assert (r.exit_code, r.stderr) == (2, TRT_LINE)


@pytest.mark.parametrize("args, message", [
    (["--preset", "tiny", "--variants", "baseline,fast"], "--variants: unknown ['fast']"),
    (["--preset", "tiny", "--iters", "2", "--rounds", "3"], "--rounds 3 exceeds --iters 2"),
    (["--preset", "tiny", "--batch", "1,x"], "--batch: '1,x' is not a comma-separated list"),
    (["--preset", "tiny", "--seq", "4096"], "--seq 4096 exceeds the model's context (max_seq_len 128)"),
    (["--preset", "tiny", "--seq", "8", "--engine", "ort"], "--engine ort runs exported graphs"),
    (["--preset", "tiny", "--seq", "8", "--ort-optimization", "basic"], "--ort-optimization applies to --engine ort"),
    ([], "give exactly one of DIR"),
])
def test_bad_input_is_one_error_line(args, message, cli):
    r = cli("bench", *args)
    assert r.exit_code == 2
    assert r.stderr.startswith("taperfold: error: ") and message in r.stderr and r.stderr.count("\n") == 1
