"""Tiny transformers models of every family, exported by torch.onnx, folded (issue 10).

Tapered: every norm replaced by its g = 0 constant map (`tests/fold_models.py`: `constant_norms`).
Negative control: the same model with its real norms comes out bit-identical, nothing reported as folded.
"""

from __future__ import annotations

import numpy as np
import pytest
from fold_models import FAMILIES, LAYERS, constant_norms, export, tiny_model

from taperfold.passes import NormStatus, fold_onnx_file
from taperfold.passes.check_fold import check_fold

pytest.importorskip("transformers")

# Norms on a head's q/k (Qwen3, Qwen3-MoE, Gemma 3, EXAONE 4; StableLM's qk_layernorm, one LayerNorm per head: 4 q
# and 2 k heads) are read by attention's RoPE, and produced by a reshape into heads, not by a linear layer: kept by
# design.
PER_HEAD = {"qwen3": 2 * 2, "qwen3_moe": 2 * 2, "gemma3_text": 2 * 2, "exaone4": 2 * 2, "stablelm_parallel": 2 * 6}
# StableLM's per-head wrapper (StableLmLayerNormPerHead: split into heads, a LayerNorm each, concat) is named like a
# LayerNorm class; the dynamo export's metadata shows its split and concat, which the report lists as a real norm.
WRAPPERS = {"stablelm_parallel": 2 * 2}
# Families added with their MoE experts (a norm read by the router and every expert, through reshapes and
# unsqueezes), both Falcon architectures and StableLM's two layouts: exported by dynamo as well.
NEW_DYNAMO = ["mixtral", "qwen2_moe", "qwen3_moe", "falcon", "falcon_new", "stablelm", "stablelm_parallel"]
# Norms that read a projection's output fold backwards into it: post-norms (Gemma 2/3, OLMo 2, GLM-4, EXAONE 4) and
# OLMo 2's q/k norms, which span every head, each with the projection it reads.
PRODUCED_BY = {
    "gemma2": {"post_attention_layernorm": "self_attn.o_proj", "post_feedforward_layernorm": "mlp.down_proj"},
    "olmo2": {
        "post_attention_layernorm": "self_attn.o_proj",
        "post_feedforward_layernorm": "mlp.down_proj",
        "self_attn.q_norm": "self_attn.q_proj",
        "self_attn.k_norm": "self_attn.k_proj",
    },
    "glm4": {"post_self_attn_layernorm": "self_attn.o_proj", "post_mlp_layernorm": "mlp.down_proj"},
}
PRODUCED_BY["gemma3_text"] = PRODUCED_BY["exaone4"] = PRODUCED_BY["gemma2"]
# torch.onnx's legacy exporter fails on GLM-4's partial rotary embedding ("All tensors must have the same rank").
LEGACY = [family for family in FAMILIES if family != "glm4"]


def statuses(report) -> dict[str, int]:
    return {status.value: report.count(status) for status in NormStatus if report.count(status)}


def fold_and_check(tmp_path, model, exporter, opset=18, optimize=True):
    src = export(model, tmp_path / "m.onnx", exporter, opset, optimize=optimize)
    report = fold_onnx_file(src, tmp_path / "folded.onnx")
    return report, check_fold(src, tmp_path / "folded.onnx", {"input_ids": [2, 7], "attention_mask": [2, 7]})


def assert_folds_all(report, check, norms, family, wrappers=0):
    kept = PER_HEAD.get(family, 0)
    assert statuses(report) == {
        "folded": norms - kept,
        **({"kept": kept} if kept else {}),
        **({"real_norm": wrappers} if wrappers else {}),
    }, [e.message for e in report.norms if e.status != NormStatus.FOLDED]
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


@pytest.mark.parametrize("family", LEGACY)
def test_legacy_export_folds_every_tapered_norm(tmp_path, models, family):
    _, tapered, norms = models[family]
    assert_folds_all(*fold_and_check(tmp_path, tapered, "legacy"), norms, family)


@pytest.mark.parametrize("family", LEGACY)
def test_legacy_export_of_real_norms_is_untouched(tmp_path, models, family):
    original, _, norms = models[family]
    assert_untouched(*fold_and_check(tmp_path, original, "legacy"), norms)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_dynamo_export_folds_conv1d_readers_and_parallel_residuals(tmp_path, models, family):
    _, tapered, norms = models[family]
    assert_folds_all(*fold_and_check(tmp_path, tapered, "dynamo", opset=20), norms, family)


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW_DYNAMO)
def test_dynamo_export_folds_moe_experts_and_parallel_layouts(tmp_path, models, family):
    original, tapered, norms = models[family]
    (tmp_path / "tapered").mkdir()
    (tmp_path / "original").mkdir()
    assert_folds_all(
        *fold_and_check(tmp_path / "tapered", tapered, "dynamo", opset=20), norms, family, WRAPPERS.get(family, 0)
    )
    assert_untouched(
        *fold_and_check(tmp_path / "original", original, "dynamo", opset=20), norms + WRAPPERS.get(family, 0)
    )


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_moe_norm_folds_into_the_router_and_every_experts_matrix(tmp_path, models, exporter):
    # The norm before the experts reaches the router through a Reshape and each token's selected experts through
    # repeat_interleave and a column per token (dynamo: Unsqueeze, Expand, Reshape, Unsqueeze; legacy: a Reshape to
    # a run-time shape, Unsqueeze, Tile, Flatten, Unsqueeze) into MatMul(Gather(experts' weights), x).
    import onnx_ir as ir

    _, tapered, norms = models["mixtral"]
    report, check = fold_and_check(tmp_path, tapered, exporter, opset=20 if exporter == "dynamo" else 18)
    assert_folds_all(report, check, norms, "mixtral")

    def stacks(path):  # the experts' gate/up matrices of each layer, [experts, 2·intermediate, hidden]
        return [
            v.const_value.numpy()
            for v in ir.load(path).graph.initializers.values()
            if v.const_value is not None and len(v.const_value.shape) == 3 and v.const_value.shape[-1] == 32
        ]

    before, after = stacks(tmp_path / "m.onnx"), stacks(tmp_path / "folded.onnx")
    assert len(before) == len(after) == LAYERS  # rewritten in place, not copied
    assert not any(np.array_equal(a, b) for a in after for b in before)


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_moe_layernorm_shift_folds_as_a_bias_per_expert(tmp_path, exporter):
    # PhiMoE: a LayerNorm's β reaches experts' matrices that have no bias; each selected expert's β·W_e is added
    # after the batched MatMul, gathered by the same expert ids.
    tapered, names = constant_norms(tiny_model("phimoe"))
    report, check = fold_and_check(tmp_path, tapered, exporter, opset=20 if exporter == "dynamo" else 18)
    assert_folds_all(report, check, len(names), "phimoe")


def assert_folded_into_producers(report, family):
    """Each norm reading a projection went into that projection, named in the report by its module."""
    backwards = {e.name: e.reason for e in report.norms if e.into == "producer"}
    assert len(backwards) == LAYERS * len(PRODUCED_BY[family]), backwards
    for i in range(LAYERS):
        for norm, producer in PRODUCED_BY[family].items():
            (reason,) = [r for name, r in backwards.items() if f"layers.{i}.{norm}" in name.replace("/", ".")]
            assert reason.endswith(f"layers.{i}.{producer})") or f"layers.{i}/{producer.replace('.', '/')}/" in reason


@pytest.mark.parametrize("family", sorted(PRODUCED_BY))
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_post_norms_fold_backwards_into_the_projection_they_read(tmp_path, models, family, exporter):
    if exporter == "legacy" and family not in LEGACY:
        pytest.skip("torch.onnx's legacy exporter cannot export GLM-4")
    _, tapered, norms = models[family]
    report, check = fold_and_check(tmp_path, tapered, exporter, opset=20 if exporter == "dynamo" else 18)
    assert_folds_all(report, check, norms, family)
    assert_folded_into_producers(report, family)


@pytest.mark.slow
def test_dynamo_export_of_real_norms_is_untouched(tmp_path, models):
    original, _, norms = models["llama"]
    assert_untouched(*fold_and_check(tmp_path, original, "dynamo", opset=20), norms)


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_unoptimized_exports_fold_after_constant_folding(tmp_path, models, exporter):
    # Gemma's (1 + w) · c is computed at run time when the exporter does not fold constants.
    _, tapered, norms = models["gemma"]
    report, check = fold_and_check(
        tmp_path, tapered, exporter, opset=20 if exporter == "dynamo" else 18, optimize=False
    )
    assert report.constants_folded > 0
    assert_folds_all(report, check, norms, "gemma")


def test_merge_norm_weights_is_opt_in_and_reported_under_its_own_name(tmp_path, models):
    original, _, norms = models["llama"]
    src = export(original, tmp_path / "m.onnx", "legacy", 18)
    report = fold_onnx_file(src, tmp_path / "merged.onnx", merge_norm_weights=True)
    assert report.count(NormStatus.FOLDED) == 0 and report.count(NormStatus.WEIGHTS_MERGED) == norms
    check = check_fold(src, tmp_path / "merged.onnx", {"input_ids": [2, 7], "attention_mask": [2, 7]})
    assert check.passed and np.isfinite(check.outputs[0].metrics.max_rel)


@pytest.mark.parametrize(
    "family, norm_names",
    [("gpt_neox", ("input_layernorm", "post_attention_layernorm")), ("falcon_new", ("ln_attn", "ln_mlp"))],
)
@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_parallel_norms_with_equal_c_fold_and_keep_their_own_names(tmp_path, models, exporter, family, norm_names):
    # Calibration gives two norms that read one input the same c; the dynamo exporter then computes (h - mean)·c
    # once for both. Each norm is still folded, and named after its own module, not the first one's.
    import copy

    import torch

    tapered, norms = copy.deepcopy(models[family][1]), models[family][2]  # the fixture's stays as it is
    with torch.no_grad():
        for module in tapered.modules():
            if isinstance(getattr(module, "c", None), torch.nn.Parameter):
                module.c.fill_(0.8)
    report, check = fold_and_check(tmp_path, tapered, exporter, opset=20 if exporter == "dynamo" else 18)
    assert_folds_all(report, check, norms, family)
    names = [e.name.replace("/", ".") for e in report.norms]
    for i in range(LAYERS):
        for norm in norm_names:
            assert sum(f".{i}.{norm}" in name for name in names) == 1, names
    assert not any("#" in name for name in names)


def test_bloom_embedding_norm_folds_into_the_table_past_the_legacy_shape_reader(tmp_path, models):
    # The legacy exporter reads the looked-up rows' Shape before a view; that read does not block the fold.
    _, tapered, norms = models["bloom"]
    report, check = fold_and_check(tmp_path, tapered, "legacy")
    assert_folds_all(report, check, norms, "bloom")
    (entry,) = [e for e in report.norms if "word_embeddings_layernorm" in e.name]
    assert entry.into == "embedding"
