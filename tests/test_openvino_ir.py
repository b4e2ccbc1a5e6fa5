"""The `openvino` artifact kind (`export --openvino`) and `--engine openvino-ir`: a stateful OpenVINO IR converted from
each variant's torch model, its KV cache in the model's state and its attention one ScaledDotProductAttention op per
layer; verify holds it to the checkpoint, bench times it. Skipped where openvino is not installed."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import one_line, run_cli

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.manifest import read_manifest
from taperfold.models import random_gate0_model

pytest.importorskip("openvino", reason="openvino is not installed (pip install 'taperfold[openvino]')")
pytestmark = pytest.mark.slow


def _torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids), logits="all").float().numpy()


def _decodes_as(runner, model, prompt: int = 6, steps: int = 3) -> None:
    """The IR's logits of a prompt and each step after it are the torch model's, batch 2 (each row its own cache),
    and its greedy tokens are the model's."""
    ids = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (2, prompt + steps), dtype=np.int64)
    expected = _torch_logits(model, ids)
    for k, logits in enumerate(runner.decode_logits(ids, steps, model.cfg, "fp32")):
        np.testing.assert_allclose(logits, expected[:, prompt - 1 + k], rtol=1e-4, atol=2e-5)
    generation = runner.generate(ids[:, :prompt], steps, model.cfg, "fp32")
    greedy = ids[:, :prompt]
    for _ in range(steps + 1):
        greedy = np.concatenate([greedy, _torch_logits(model, greedy)[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(generation.tokens, greedy[:, prompt:])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "phi3", "gpt_neox", "mixtral"])
def test_stateful_ir_of_each_variant_decodes_as_its_torch_model(family, tmp_path):
    """Families of every kind the export reaches (a sliding window, biases, a fused QKV, partial rotary, MoE):
    the folded and the baseline IR each give their torch model's logits, with every attention layer one
    ScaledDotProductAttention and the cache in the model's state."""
    import openvino
    from hf_models import tapered_tiny_model

    from taperfold.artifacts.openvino_ir import _torch_variants, stateful_ir
    from taperfold.hf import save_hf_directory
    from taperfold.runners.openvino_ir import StatefulOpenVinoRunner
    from taperfold.sources import open_source

    source = open_source(save_hf_directory(tapered_tiny_model(family), tmp_path / "hf"))
    models = _torch_variants(source, ["folded", "baseline"], "test")
    for variant, model in models.items():
        path = tmp_path / variant / "openvino_model.xml"
        with source.export_context():
            converted, attention = stateful_ir(model, "test", lambda stage: None)
        openvino.save_model(converted, str(path), compress_to_fp16=False)
        assert attention == model.cfg.n_layers
        with StatefulOpenVinoRunner(path, threads=1) as runner:
            _decodes_as(runner, model)


@pytest.fixture(scope="module")
def builtin_export(tmp_path_factory):
    """taperfold's own tiny Llama at g = 0, exported with its growing decoders and the stateful IR of the folded
    model and the baseline."""
    root = tmp_path_factory.mktemp("openvino-ir")
    model = random_gate0_model("tiny", arch="llama")
    ckpt = save_checkpoint(checkpoint_from_model(model, step=0), root / "tiny.pt")
    result = run_cli("export", ckpt, "-o", root / "out", "--kv-cache", "growing", "--openvino")
    assert result.exit_code == 0, result.stderr
    return root / "out", model


def test_export_openvino_records_a_stateful_ir_per_variant(builtin_export):
    out, model = builtin_export
    manifest = read_manifest(out)
    records = {r.key: r for r in manifest.records("openvino")}
    assert set(records) == {"folded.decoder.openvino", "baseline.decoder.openvino"}
    for record in records.values():
        assert record.path == f"openvino/{record.variant}/openvino_model.xml"
        assert record.external_data == f"openvino/{record.variant}/openvino_model.bin"
        assert (out / record.external_data).stat().st_size == record.external_data_bytes > 0
        assert record.details.attention == model.cfg.n_layers
        assert record.graph == "growing" and record.precision == "fp32"


def test_export_openvino_no_onnx_converts_the_folded_model_and_the_baseline_without_a_graph(tmp_path):
    ckpt = save_checkpoint(checkpoint_from_model(random_gate0_model("tiny", arch="llama"), step=0), tmp_path / "t.pt")
    result = run_cli("export", ckpt, "-o", tmp_path / "out", "--openvino", "--no-onnx")
    assert result.exit_code == 0, result.stderr
    manifest = read_manifest(tmp_path / "out")
    assert {r.kind for r in manifest.records()} == {"openvino"}
    assert {r.key for r in manifest.records()} == {"folded.decoder.openvino", "baseline.decoder.openvino"}
    assert not list((tmp_path / "out").glob("*.onnx"))
    verified = run_cli("verify", tmp_path / "out", "--threads", "1", "--json")
    assert verified.exit_code == 0, verified.stderr
    pairs = {p["candidate"]: p["status"] for p in json.loads(verified.stdout)["pairs"]}
    assert pairs == {"folded.decoder.openvino": "pass", "baseline.decoder.openvino": "pass"}


def test_verify_holds_the_stateful_ir_to_the_checkpoint(builtin_export, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(builtin_export[0], copy)
    result = run_cli("verify", copy, "--threads", "1", "--json")
    assert result.exit_code == 0, result.stderr
    pairs = {p["candidate"]: p for p in json.loads(result.stdout)["pairs"]}
    for candidate in ("folded.decoder.openvino", "baseline.decoder.openvino"):
        assert pairs[candidate]["status"] == "pass"


def test_bench_engine_openvino_ir_builds_what_it_times(builtin_export, tmp_path):
    """The unfolded model has no IR in the export: bench converts it first, then times the three in rounds."""
    copy = tmp_path / "out"
    shutil.copytree(builtin_export[0], copy)
    result = run_cli(
        "bench", copy, "--engine", "openvino-ir", "--mode", "decode", "--batch", "1,2", "--prompt", "8",
        "--new-tokens", "3", "--warmup", "1", "--iters", "2", "--rounds", "1", "--threads", "1", "--json", "-",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["engine"] == "openvino-ir"
    assert {row["variant"] for row in report["results"]} == {"baseline", "unfolded", "folded"}
    assert read_manifest(copy).find("unfolded", "growing", "openvino") is not None


@pytest.mark.parametrize(
    "args, words",
    [
        (["--mode", "prefill"], ["decode"]),
        (["--mode", "decode", "--kv-cache", "static"], ["static"]),
        (["--mode", "decode", "--device", "cuda"], ["openvino-ir", "CPU"]),
    ],
)
def test_bench_engine_openvino_ir_refusals_are_one_line(builtin_export, args, words):
    one_line(run_cli("bench", builtin_export[0], "--engine", "openvino-ir", *args), *words)


def test_export_openvino_refuses_a_half_precision_export_before_the_work(tmp_path):
    model = random_gate0_model("tiny", arch="llama")
    ckpt = save_checkpoint(checkpoint_from_model(model, step=0), tmp_path / "tiny.pt")
    one_line(run_cli("export", ckpt, "-o", tmp_path / "out", "--openvino", "--dtype", "fp16"), "--openvino", "fp32")
    assert not (tmp_path / "out").exists()


def test_compressed_ir_is_built_on_demand_and_judged_as_quantized(builtin_export, tmp_path):
    """`bench --precision int4` makes the int4 IR it times (NNCF, optimum-intel's settings, recorded); verify then
    holds it to the checkpoint with the int4 bounds (top-1 agreement, KL), beside the exact fp32 pairs."""
    pytest.importorskip("nncf", reason="nncf is not installed (pip install 'taperfold[openvino]')")
    copy = tmp_path / "out"
    shutil.copytree(builtin_export[0], copy)
    result = run_cli(
        "bench", copy, "--engine", "openvino-ir", "--mode", "decode", "--precision", "int4", "--variants", "folded",
        "--batch", "1", "--prompt", "8", "--new-tokens", "3", "--warmup", "1", "--iters", "2", "--rounds", "1",
        "--threads", "1", "--json", "-",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    record = read_manifest(copy).record("folded.decoder.int4.openvino")
    assert record.path == "openvino/folded-int4/openvino_model.xml" and record.precision == "int4"
    assert record.reports["quantize"]["mode"] == "int4_asym" and record.reports["quantize"]["ratio"] == 1.0
    fp32 = read_manifest(copy).record("folded.decoder.openvino")
    assert record.external_data_bytes < fp32.external_data_bytes / 2
    result = run_cli("verify", copy, "--threads", "1", "--json")
    assert result.exit_code == 0, result.stderr
    pair = next(p for p in json.loads(result.stdout)["pairs"] if p["candidate"] == "folded.decoder.int4.openvino")
    assert pair["status"] == "pass" and pair["tolerance"].get("rtol") is None


def test_openvino_kind_refuses_int4_groups_that_are_no_positive_number():
    from taperfold.artifacts import artifact_kind
    from taperfold.artifacts.openvino_ir import OpenvinoRequest
    from taperfold.errors import TaperfoldError

    with pytest.raises(TaperfoldError, match="int4 groups of 0"):
        artifact_kind("openvino").check_request(OpenvinoRequest(("fp32", "int4"), group_size=0), _Fp32())


class _Fp32:
    dtype, logits = "fp32", "last"


def test_a_damaged_ir_is_one_line_saying_what_openvino_read(builtin_export, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(builtin_export[0], copy)
    model = copy / "openvino" / "folded" / "openvino_model.xml"
    model.write_text(model.read_text()[:300])
    args = ("--mode", "decode", "--batch", "1", "--prompt", "8", "--new-tokens", "2", "--iters", "1", "--rounds", "1")
    result = run_cli("bench", copy, "--engine", "openvino-ir", *args)
    one_line(result, "folded", "OpenVINO cannot compile it")
    assert "Exception from src" not in result.stderr  # OpenVINO's reason, not the source file it was raised in
