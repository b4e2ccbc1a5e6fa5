"""FoldIntoProducerPass alone: a post-norm (it reads a linear layer's output before the residual Add) goes into
that layer's output columns and bias."""

from __future__ import annotations

import numpy as np
import pytest
from _graphs import F32, D, X, build, n, ops, rand, rel_err, run, x3

from taperfold.passes import FoldIntoProducerPass, FoldReport, NormStatus

K = 5  # the producer's input width


def post_norm(kind="rms", layer="matmul", bias=True, extra=(), extra_outputs=(), inits=None):
    """x -> a linear layer [K -> D] -> the g = 0 norm -> Add(residual r) -> y."""
    ln = kind == "ln"
    if layer == "matmul":
        linear = [n("MatMul", ["x", "W"], ["z0" if bias else "z"]), *([n("Add", ["z0", "b"], ["z"])] if bias else [])]
    else:  # Gemm(x2d, W[D, K], C) with transB=1, alpha and beta not 1
        linear = [n("Gemm", ["x", "Wt", *(["b"] if bias else [])], ["z"], transB=1, alpha=0.5, beta=2.0)]
    head = [n("ReduceMean", ["z", "axes"], ["m"], keepdims=1), n("Sub", ["z", "m"], ["zc"])] if ln else []
    nodes = [
        *linear,
        *head,
        n("Mul", ["zc" if ln else "z", "c"], ["hc"]),
        n("Mul", ["hc", "w"], ["hw"]),
        *([n("Add", ["hw", "beta"], ["h"])] if ln else [n("Identity", ["hw"], ["h"])]),
        n("Add", ["h", "r"], ["y"]),
        *extra,
    ]
    shape = [2, 3] if layer == "matmul" else [6]
    W = rand(K, D)
    values = {
        "W": W,
        "Wt": np.ascontiguousarray(W.T),
        "b": rand(D),
        "axes": np.array([-1]),
        "c": np.array(1.7, np.float32),
        "w": rand(D),
        "beta": rand(D),
        **(inits or {}),
    }
    used = {v for *_, ins, _, _, _ in nodes for v in ins}
    return build(
        nodes,
        [("x", F32, [*shape, K]), ("r", F32, [*shape, D])],
        [("y", F32, [*shape, D]), *extra_outputs],
        {k: v for k, v in values.items() if k in used},
    )


def fold_checked(model, shape=(2, 3)):
    feeds = {"x": rand(*shape, K), "r": rand(*shape, D)}
    before = run(model, feeds)
    report = FoldReport()
    FoldIntoProducerPass(report)(model)
    after = run(model, feeds)
    for b, a in zip(before, after):
        assert rel_err(b, a) <= 1e-5
    return report, before, after


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_post_norm_folds_into_the_matmul_that_produces_its_input(kind, bias):
    model = post_norm(kind, bias=bias)
    report, *_ = fold_checked(model)
    (entry,) = report.norms
    assert (entry.status, entry.into) == (NormStatus.FOLDED, "producer")
    assert entry.reason == "folded into its producer MatMul 'z0'" if bias else "folded into its producer MatMul 'z'"
    left = ops(model)
    assert not {"Mul", "ReduceMean", "Sub"} & set(left)
    # LN's centering and beta need a bias: the layer's own, or a new Add
    assert left["Add"] == 1 + (bias or kind == "ln")


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_gemm_producer_with_trans_b_alpha_and_beta(kind, bias):
    model = post_norm(kind, layer="gemm", bias=bias)
    report, *_ = fold_checked(model, shape=(6,))
    (entry,) = report.norms
    assert entry.status == NormStatus.FOLDED and "Gemm 'z'" in entry.reason
    gemm = next(node for node in model.graph if node.op_type == "Gemm")
    assert gemm.attributes.get_int("transB") == 1 and set(ops(model)) == {"Gemm", "Add"}


def test_the_fold_is_the_norms_arithmetic_not_just_any_rescaling():
    # A fold that forgot the centering would still remove the nodes: the outputs tell.
    gain = rand(D) + 2.0
    model = post_norm("ln", bias=True, inits={"b": rand(D) + 3.0, "w": gain})
    feeds = {"x": rand(2, 3, K), "r": rand(2, 3, D)}
    before = run(model, feeds)
    FoldIntoProducerPass()(model)
    matmul = next(node for node in model.graph if node.op_type == "MatMul")
    w = matmul.inputs[1].const_value.numpy().astype(np.float64) / (1.7 * gain)
    assert np.abs(w.sum(axis=1)).max() <= 1e-5  # W·(I - 11ᵀ/n)·diag(s): every row centred over the output channels
    assert rel_err(before[0], run(model, feeds)[0]) <= 1e-5


def test_a_producer_output_with_another_reader_keeps_the_norm_and_says_who():
    model = post_norm(extra=[n("Relu", ["z"], ["side"])], extra_outputs=[("side", F32, [2, 3, D])])
    report, before, after = fold_checked(model)
    (entry,) = report.norms
    assert entry.status == NormStatus.KEPT
    assert entry.reason == (
        "read by Add 'y' (residual); not into its producer: MatMul 'z0''s output is also read by Relu 'side'"
    )
    for b, a in zip(before, after):
        np.testing.assert_array_equal(b, a)


def test_a_weight_shared_with_another_layer_is_copied_and_the_other_keeps_it():
    model = post_norm(extra=[n("MatMul", ["x", "W"], ["side"])], extra_outputs=[("side", F32, [2, 3, D])])
    report, before, after = fold_checked(model)
    (entry,) = report.norms
    assert entry.status == NormStatus.FOLDED and entry.copied == ["W -> W.folded (also read by MatMul 'side')"]
    np.testing.assert_array_equal(before[1], after[1])  # the other layer's output, bit for bit


def test_a_shared_centering_keeps_the_norm():
    # Another chain reads z - mean(z): rewriting the layer would change what it sees.
    model = post_norm("ln", extra=[n("Mul", ["zc", "w"], ["other"])], extra_outputs=[("other", F32, [2, 3, D])])
    report, before, after = fold_checked(model)
    kept = [e for e in report.norms if e.status == NormStatus.KEPT]
    assert kept and all("its centering is shared with Mul" in e.reason for e in kept)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(b, a)


def test_a_norm_whose_input_no_linear_layer_produces_is_left_to_the_other_passes():
    model = build(
        [n("Mul", ["x", "s"], ["h"]), n("Add", ["h", "x"], ["y"])], [X], [("y", F32, [2, 3, D])], {"s": rand(D)}
    )
    report, feeds = FoldReport(), x3()
    before = run(model, feeds)
    assert not FoldIntoProducerPass(report)(model).modified
    assert report.norms == [] and ops(model) == {"Mul": 1, "Add": 1}
    np.testing.assert_array_equal(before[0], run(model, feeds)[0])
