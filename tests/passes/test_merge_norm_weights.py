"""MergeNormWeightsPass alone (opt-in): a real norm's gain moves into its readers; the norm stays."""

from __future__ import annotations

import numpy as np
from _graphs import F32, RMS_CONSTS, D, N, X, build, n, ops, rand, real_rms_model, rel_err, rms_real, run, x3

from taperfold.passes import FoldReport, MergeNormWeightsPass, NormStatus


def test_decomposed_real_norm_gain_merges_and_the_normalization_stays():
    model = real_rms_model()
    feeds = x3()
    before = run(model, feeds)
    report = FoldReport()
    MergeNormWeightsPass(report)(model)
    (entry,) = report.norms
    assert entry.status == NormStatus.WEIGHTS_MERGED and "kept" in entry.reason
    assert rel_err(before[0], run(model, feeds)[0]) <= 1e-5
    counts = ops(model)
    assert counts["ReduceMean"] == 1 and counts["Sqrt"] == 1 and counts["Mul"] == 1  # x·(1/rms) stays, γ is gone


def test_fused_layer_norm_gain_and_bias_merge_into_the_readers():
    model = build(
        [n("LayerNormalization", ["x", "g", "b"], ["h"], axis=-1), n("MatMul", ["h", "W"], ["y"])],
        [X],
        [("y", F32, [2, 3, N])],
        {"g": rand(D), "b": rand(D), "W": rand(D, N)},
    )
    feeds = x3()
    before = run(model, feeds)
    report = FoldReport()
    MergeNormWeightsPass(report)(model)
    assert report.norms[0].status == NormStatus.WEIGHTS_MERGED
    assert rel_err(before[0], run(model, feeds)[0]) <= 1e-5
    node = next(node for node in model.graph if node.op_type == "LayerNormalization")
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy(), np.ones(D, np.float32))
    np.testing.assert_array_equal(node.inputs[2].const_value.numpy(), np.zeros(D, np.float32))


def test_a_real_norm_read_by_a_residual_is_reported_with_the_reason():
    model = build(
        [*rms_real(), n("MatMul", ["h", "W"], ["a"]), n("Add", ["h", "a"], ["y"])],
        [X],
        [("y", F32, [2, 3, D])],
        {**RMS_CONSTS, "g": rand(D), "W": rand(D, D)},
    )
    report = FoldReport()
    MergeNormWeightsPass(report)(model)
    (entry,) = report.norms
    assert entry.status == NormStatus.REAL_NORM and "read by Add 'y' (residual)" in entry.reason


def test_a_skip_norm_merges_its_scale_not_its_residual_input():
    """ONNX Runtime's SkipLayerNormalization(x, skip, gamma, beta): the scale and bias are inputs 2 and 3 (input 1
    is the residual); the output the residual path reads on (x + skip) keeps flowing unchanged."""
    model = build(
        [
            n(
                "SkipLayerNormalization",
                ["x", "r", "g", "b"],
                ["h", "", "", "sum"],
                domain="com.microsoft",
                epsilon=1e-5,
            ),
            n("MatMul", ["h", "W"], ["q"]),
            n("Add", ["q", "sum"], ["y"]),
        ],
        [X, ("r", F32, [2, 3, D])],
        [("y", F32, [2, 3, D])],
        {"g": rand(D), "b": rand(D), "W": rand(D, D)},
    )
    feeds = {"x": rand(2, 3, D), "r": rand(2, 3, D)}
    before = run(model, feeds)
    report = FoldReport()
    MergeNormWeightsPass(report)(model)
    (entry,) = report.norms
    assert entry.status == NormStatus.WEIGHTS_MERGED
    assert rel_err(before[0], run(model, feeds)[0]) <= 1e-5
    node = next(node for node in model.graph if node.op_type == "SkipLayerNormalization")
    assert node.inputs[1].name == "r"  # the residual input untouched
    np.testing.assert_array_equal(node.inputs[2].const_value.numpy(), np.ones(D, np.float32))
    np.testing.assert_array_equal(node.inputs[3].const_value.numpy(), np.zeros(D, np.float32))
