"""`--engine openvino`: OpenVINO reads the exported ONNX graphs (prefill, growing and static decoders, and the
quantized ones), bench times them and verify holds them to the checkpoint. Skipped where openvino is not installed."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import one_line, run_cli

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.exportdir import GROWING, STATIC
from taperfold.manifest import read_manifest
from taperfold.models import random_gate0_model

pytest.importorskip("openvino", reason="openvino is not installed (pip install 'taperfold[openvino]')")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cached_export(tmp_path_factory):
    """A tiny llama at g = 0 exported with both KV caches and its int8 graphs; no baseline (the folded and unfolded
    graphs are what OpenVINO is checked on)."""
    root = tmp_path_factory.mktemp("openvino")
    model = random_gate0_model("tiny", arch="llama")
    ckpt = save_checkpoint(checkpoint_from_model(model, step=0), root / "tiny.pt")
    result = run_cli(
        "export", ckpt, "-o", root / "out", "--kv-cache", "growing,static", "--max-cache", "64", "--no-baseline",
        "--quantize", "int8",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return root / "out", model


def test_openvino_runs_the_graphs_as_onnxruntime_does(cached_export):
    """Prefill logits and a greedy generation from each decoder: OpenVINO (fp32 pinned) agrees with ONNX Runtime."""
    from taperfold.runners.openvino import OpenVinoRunner
    from taperfold.runners.ort import OrtRunner

    out, model = cached_export
    manifest = read_manifest(out)
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 9), dtype=np.int64)
    with OpenVinoRunner(manifest.artifact("folded"), threads=1) as ov, OrtRunner(manifest.artifact("folded")) as ort:
        np.testing.assert_allclose(ov.infer({"input_ids": ids})["logits"], ort.infer({"input_ids": ids})["logits"],
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
    for graph, cache_len in ((GROWING, None), (STATIC, 64)):
        path = manifest.artifact("folded", graph)
        with OpenVinoRunner(path, threads=1) as ov, OrtRunner(path) as ort:
            ours = ov.generate(ids, 6, model.cfg, "fp32", cache_len)
            theirs = ort.generate(ids, 6, model.cfg, "fp32", cache_len)
        np.testing.assert_array_equal(ours.tokens, theirs.tokens)
        np.testing.assert_allclose(ours.last_logits, theirs.last_logits, rtol=1e-4, atol=1e-5)


def test_verify_engine_openvino_holds_every_graph_to_the_checkpoint(cached_export, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(cached_export[0], copy)
    result = run_cli("verify", copy, "--engine", "openvino", "--threads", "1", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["engine"] == "openvino" and report["passed"]
    candidates = {p["candidate"] for p in report["pairs"] if p["status"] == "pass"}
    for graph in ("", ".decoder", ".static"):
        assert {f"unfolded{graph}", f"folded{graph}", f"folded{graph}.int8"} <= candidates


@pytest.mark.parametrize("args", [["--mode", "decode", "--kv-cache", "static"], ["--precision", "int8", "--seq", "8"]])
def test_bench_engine_openvino(cached_export, tmp_path, args):
    copy = tmp_path / "out"
    shutil.copytree(cached_export[0], copy)
    result = run_cli(
        "bench", copy, "--engine", "openvino", "--batch", "1", "--prompt", "8", "--new-tokens", "3", "--warmup", "1",
        "--iters", "2", "--rounds", "1", "--threads", "1", "--variants", "unfolded,folded", "--json", "-", *args,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["engine"] == "openvino" and {row["variant"] for row in report["results"]} == {"unfolded", "folded"}


def test_openvino_refuses_a_gpu_in_one_line(cached_export):
    result = run_cli("verify", cached_export[0], "--engine", "openvino", "--device", "cuda")
    one_line(result, "--engine openvino runs on the CPU")


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory):
    """A tiny tapered Hugging Face Llama exported with its growing decoders (optimum-intel reads its plain weights)."""
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    root = tmp_path_factory.mktemp("optimum-intel")
    source = save_hf_directory(tapered_tiny_model("llama"), root / "tapered")
    result = run_cli("export", source, "-o", root / "out", "--kv-cache", "growing")
    assert result.exit_code == 0, result.stderr
    return root / "out", source


def test_bench_against_optimum_intel_refusals_are_one_line(cached_export, tmp_path, monkeypatch):
    """optimum-cli missing from PATH, then (an optimum-cli on PATH) a source that is no Hugging Face directory."""
    args = ("bench", cached_export[0], "--engine", "openvino", "--mode", "decode", "--against", "optimum-intel")
    monkeypatch.setenv("PATH", str(tmp_path))
    one_line(run_cli(*args), "optimum-cli is not on PATH", "scripts/setup-optimum-intel")
    cli = tmp_path / "optimum-cli"
    cli.write_text("#!/bin/sh\nexit 1\n")
    cli.chmod(0o755)
    one_line(run_cli(*args), "builds from a Hugging Face directory")
    assert not (cached_export[0] / "against").exists()


@pytest.mark.skipif(
    shutil.which("optimum-cli") is None,
    reason="optimum-cli is not on PATH (optimum-intel pins transformers < 5.6: scripts/setup-optimum-intel)",
)
def test_bench_against_optimum_intel_times_its_stateful_export_of_the_untapered_model(hf_export, tmp_path):
    """`--against optimum-intel`: optimum-cli's OpenVINO export of the source's plain model, built once into
    DIR/against/ and timed in the same rounds; its stateful runner gives the plain model's logits."""
    import torch
    import transformers

    from taperfold.runners.openvino_ir import StatefulOpenVinoRunner
    from taperfold.sources import open_source

    out, source = hf_export
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    args = (
        "bench", copy, "--engine", "openvino", "--mode", "decode", "--against", "optimum-intel", "--variants",
        "baseline,folded", "--batch", "1", "--prompt", "8", "--new-tokens", "3", "--warmup", "1", "--iters", "2",
        "--rounds", "1", "--threads", "1", "--json", "-",
    )  # fmt: skip
    result = run_cli(*args)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert {row["variant"] for row in report["results"]} == {"baseline", "folded", "optimum-intel"}
    (made,) = report["against"]
    assert made["tool"] == "optimum-intel OpenVINO export" and made["precision"] == "fp32"
    assert "export openvino" in made["command"] and "--weight-format fp32" in made["command"]
    folder = copy / "against" / "optimum-intel-fp32"
    stamp = (folder / "openvino_model.xml").stat().st_mtime_ns
    assert run_cli(*args).exit_code == 0 and (folder / "openvino_model.xml").stat().st_mtime_ns == stamp  # built once

    plain = tmp_path / "plain"
    open_source(source).write_plain_directory(plain)
    model = transformers.AutoModelForCausalLM.from_pretrained(plain).eval()
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9), dtype=np.int64)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)).logits.numpy()
    with StatefulOpenVinoRunner(folder, threads=1) as runner:
        steps = runner.decode_logits(ids, 3, None, "fp32")
        generation = runner.generate(ids[:, :6], 3, None, "fp32")
    for k, logits in enumerate(steps):
        np.testing.assert_allclose(logits, expected[:, 5 + k], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(generation.tokens[:, 0], expected[:, 5].argmax(-1))
