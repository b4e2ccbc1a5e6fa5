"""Tiny transformers models of every family, exported by torch.onnx, folded (issue 10).

Tapered: every norm replaced by its g = 0 constant map (`taperfold.passes.testing.constant_norms`).
Negative control: the same model with its real norms comes out bit-identical, nothing reported as folded.
"""

from __future__ import annotations

import numpy as np
import pytest

from taperfold.passes import NormStatus, fold_onnx_file
from taperfold.passes.check_fold import check_fold
from taperfold.passes.testing import FAMILIES, constant_norms, export, tiny_model

pytest.importorskip("transformers")

# Norms on a head's q/k (Qwen3) are read by attention's Transpose, not a linear layer: kept by design.
PER_HEAD = {"qwen3": 2 * 2}


def statuses(report) -> dict[str, int]:
    return {status.value: report.count(status) for status in NormStatus if report.count(status)}


def fold_and_check(tmp_path, model, exporter, opset=18, optimize=True):
    src = export(model, tmp_path / "m.onnx", exporter, opset, optimize=optimize)
    report = fold_onnx_file(src, tmp_path / "folded.onnx")
    return report, check_fold(src, tmp_path / "folded.onnx", {"input_ids": [2, 7], "attention_mask": [2, 7]})


def assert_folds_all(report, check, norms, family):
    kept = PER_HEAD.get(family, 0)
    assert statuses(report) == {"folded": norms - kept, **({"kept": kept} if kept else {})}, \
        [e.message for e in report.norms if e.status != NormStatus.FOLDED]
    (logits,) = check.outputs
    assert check.passed and logits.metrics.max_rel <= 1e-5


def assert_untouched(report, check, norms):
    assert statuses(report) == {"real_norm": norms}, [e.message for e in report.norms]
    assert not report.changed_weights
    (logits,) = check.outputs
    assert logits.metrics.max_abs == 0  # bit-identical


@pytest.fixture(scope="module")
def models():
    """family -> (original, tapered, number of norms), built once."""
    out = {}
    for family in FAMILIES:
        original = tiny_model(family)
        tapered, names = constant_norms(original)
        out[family] = (original, tapered, len(names))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_legacy_export_folds_every_tapered_norm(tmp_path, models, family):
    _, tapered, norms = models[family]
    assert_folds_all(*fold_and_check(tmp_path, tapered, "legacy"), norms, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_legacy_export_of_real_norms_is_untouched(tmp_path, models, family):
    original, _, norms = models[family]
    assert_untouched(*fold_and_check(tmp_path, original, "legacy"), norms)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_dynamo_export_folds_conv1d_readers_and_parallel_residuals(tmp_path, models, family):
    _, tapered, norms = models[family]
    assert_folds_all(*fold_and_check(tmp_path, tapered, "dynamo", opset=20), norms, family)


@pytest.mark.slow
def test_dynamo_export_of_real_norms_is_untouched(tmp_path, models):
    original, _, norms = models["llama"]
    assert_untouched(*fold_and_check(tmp_path, original, "dynamo", opset=20), norms)


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_unoptimized_exports_fold_after_constant_folding(tmp_path, models, exporter):
    # Gemma's (1 + w) · c is computed at run time when the exporter does not fold constants.
    _, tapered, norms = models["gemma"]
    report, check = fold_and_check(tmp_path, tapered, exporter, opset=20 if exporter == "dynamo" else 18,
                                   optimize=False)
    assert report.constants_folded > 0
    assert_folds_all(report, check, norms, "gemma")


def test_merge_norm_weights_is_opt_in_and_reported_under_its_own_name(tmp_path, models):
    original, _, norms = models["llama"]
    src = export(original, tmp_path / "m.onnx", "legacy", 18)
    report = fold_onnx_file(src, tmp_path / "merged.onnx", merge_norm_weights=True)
    assert report.count(NormStatus.FOLDED) == 0 and report.count(NormStatus.WEIGHTS_MERGED) == norms
    check = check_fold(src, tmp_path / "merged.onnx", {"input_ids": [2, 7], "attention_mask": [2, 7]})
    assert check.passed and np.isfinite(check.outputs[0].metrics.max_rel)
