"""Hugging Face exports in half precision: fp16 verified end to end on CPU for an RMS and a LayerNorm
family; bf16 graphs, which ONNX Runtime's CPU provider cannot load, refused by verify in one line."""

import json

import pytest

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # exports a model

from hf_models import tapered_tiny_model  # noqa: E402

from taperfold.compare import default_tolerance  # noqa: E402
from taperfold.export import ExportOptions, export_checkpoint  # noqa: E402
from taperfold.hf import save_hf_directory  # noqa: E402
from taperfold.verify import verify_export  # noqa: E402

FAMILIES = ("llama", "opt")  # RMS norms, LayerNorms


def tapered_directory(family, folder):
    return save_hf_directory(tapered_tiny_model(family), folder, step=1)


@pytest.fixture(scope="module", params=FAMILIES)
def fp16_export(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"{request.param}-fp16")
    source = tapered_directory(request.param, root / "tapered")
    return export_checkpoint(source, root / "export", ExportOptions(dtype="fp16", baseline=False)).out_dir


def test_fp16_export_verifies_within_the_fp16_tolerances(fp16_export):
    manifest = json.loads((fp16_export / "manifest.json").read_text())
    assert manifest["export"]["dtype"] == "fp16"
    assert manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"] == 2 * manifest["config"]["n_layers"]
    report = verify_export(fp16_export, threads=1)
    assert report.dtype == "fp16" and report.passed, report.failure_message()
    pairs = {p.name: p for p in report.pairs}
    assert sorted(pairs) == ["checkpoint -> folded", "checkpoint -> unfolded", "unfolded -> folded"]
    for pair in pairs.values():
        assert pair.status == "pass" and pair.tolerance == default_tolerance("fp16", pair.kind)
        assert pair.metrics.max_rel <= pair.tolerance.rtol and pair.metrics.top1_decisive >= 0.99
    for name in ("checkpoint -> unfolded", "checkpoint -> folded"):  # the fp32 reference against fp16 graphs
        assert pairs[name].metrics.max_rel > 1e-5, name


def test_bf16_export_verify_says_ort_cpu_cannot_run_it(cli, tmp_path):
    source = tapered_directory("llama", tmp_path / "tapered")
    out = tmp_path / "export"
    export_checkpoint(source, out, ExportOptions(dtype="bf16", baseline=False))
    result = cli("verify", out, "--threads", "1")
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taperfold: error: "), result.stderr
    assert "a bf16 graph" in lines[0] and "CPU provider" in lines[0] and "--device cuda" in lines[0], lines[0]
    assert not (out / "verify.json").exists()
