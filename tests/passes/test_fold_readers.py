"""FoldIntoReadersPass alone, on hand-built graphs, checked numerically in ONNX Runtime."""

from __future__ import annotations

from collections import Counter

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from _graphs import F16, F32, I64, D, N, V, X, build, mul_matmul, n, ops, rand, real_rms_model, rel_err, rng, run, x3

from taperfold.passes import FoldIntoReadersPass, FoldReport, NormStatus


def fold_checked(model: ir.Model, feeds: dict, tol: float = 1e-5):
    """Run the pass alone; the outputs in ORT must match the unfolded model's."""
    before = run(model, feeds)
    report = FoldReport()
    FoldIntoReadersPass(report)(model)
    after = run(model, feeds)
    for a, b in zip(before, after, strict=True):
        assert rel_err(a, b) <= tol
    return report, before, after


def test_rms_fan_out_to_q_k_v_folds_every_reader():
    # HF operand order for the vector (weight * h), the scalar on the right.
    model = build(
        [
            n("Mul", ["x", "c"], ["hc"]),
            n("Mul", ["w", "hc"], ["h"]),
            n("MatMul", ["h", "Wq"], ["q"]),
            n("MatMul", ["h", "Wk"], ["k"]),
            n("MatMul", ["h", "Wv"], ["v"]),
            n("Add", ["q", "k"], ["qk"]),
            n("Add", ["qk", "v"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N])],
        {"c": np.array(0.7, np.float32), "w": rand(D), "Wq": rand(D, N), "Wk": rand(D, N), "Wv": rand(D, N)},
    )
    report, *_ = fold_checked(model, x3())
    (entry,) = report.norms
    assert (entry.kind, entry.status, entry.into) == ("rms", NormStatus.FOLDED, "consumers")
    assert sorted(entry.consumers) == ["k", "q", "v"]
    assert entry.bytes_rewritten == 3 * D * N * 4 and entry.copied == []
    assert ops(model) == Counter({"MatMul": 3, "Add": 2})  # the pass removes the norm's own nodes
    assert not {"c", "w"} & set(model.graph.initializers)


def test_tied_transposed_weight_is_copied_and_the_gather_table_kept_bit_identical():
    table = rand(V, D)
    model = build(
        [
            n("Gather", ["E", "ids"], ["emb"]),
            n("Add", ["emb", "r"], ["x"]),
            n("Mul", ["x", "c"], ["hc"]),
            n("Mul", ["hc", "w"], ["h"]),
            n("Transpose", ["E"], ["Et"], perm=[1, 0]),
            n("MatMul", ["h", "Et"], ["logits"]),
        ],
        [("ids", I64, [2, 3]), ("r", F32, [2, 3, D])],
        [("logits", F32, [2, 3, V]), ("emb", F32, [2, 3, D])],
        {"E": table, "c": np.array(1.3, np.float32), "w": rand(D)},
    )
    report, *_ = fold_checked(model, {"ids": rng.integers(0, V, (2, 3)), "r": rand(2, 3, D)})
    (entry,) = report.norms
    assert entry.status == NormStatus.FOLDED and entry.copied[0].startswith("E -> E.folded")
    assert model.graph.initializers["E"].const_value.tobytes() == table.tobytes()


def test_weight_shared_with_a_reader_outside_the_norm_is_copied():
    W = rand(D, N)
    model = build(
        [n("Mul", ["x", "w"], ["h"]), n("MatMul", ["h", "W"], ["a"]), n("MatMul", ["x", "W"], ["b"])],
        [X],
        [("a", F32, [2, 3, N]), ("b", F32, [2, 3, N])],
        {"w": rand(D), "W": W},
    )
    report, before, after = fold_checked(model, x3())
    assert report.norms[0].status == NormStatus.FOLDED and report.norms[0].copied
    np.testing.assert_array_equal(before[1], after[1])
    assert model.graph.initializers["W"].const_value.tobytes() == W.tobytes()


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("with_c", [True, False])
def test_gemm_trans_b(kind, with_c):
    ln = kind == "ln"
    head = [n("ReduceMean", ["x", "axes"], ["m"], keepdims=1), n("Sub", ["x", "m"], ["xc"])] if ln else []
    model = build(
        [
            *head,
            n("Mul", ["xc" if ln else "x", "c"], ["hc"]),
            n("Mul", ["hc", "w"], ["hw"]),
            *([n("Add", ["beta", "hw"], ["h"])] if ln else [n("Identity", ["hw"], ["h"])]),
            n("Gemm", ["h", "B", *(["C"] if with_c else [])], ["y"], transB=1, alpha=0.5, beta=2.0),
        ],
        [("x", F32, [4, D])],
        [("y", F32, [4, N])],
        {
            "axes": np.array([-1]),
            "c": np.array(0.9, np.float32),
            "w": rand(D),
            "beta": rand(D),
            "B": rand(N, D),
            "C": rand(N),
        },
    )
    report, *_ = fold_checked(model, {"x": rand(4, D)})
    assert report.norms[0].kind == kind and report.norms[0].status == NormStatus.FOLDED
    assert ops(model) == Counter({"Gemm": 1})


def ln_block(bias_on_q: bool, opset=18, dtype=np.float32):
    """TaperLN at g = 0 feeding q (optionally with an Add bias, operands swapped) and a graph-output head."""
    from onnx import helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    mean = (
        n("ReduceMean", ["x", "axes"], ["m"], keepdims=1)
        if opset >= 18
        else n("ReduceMean", ["x"], ["m"], axes=[-1], keepdims=1)
    )
    return build(
        [
            mean,
            n("Sub", ["x", "m"], ["xc"]),
            n("Mul", ["xc", "c"], ["hc"]),
            n("Mul", ["hc", "w"], ["hw"]),
            n("Add", ["hw", "beta"], ["h"]),
            n("MatMul", ["h", "Wq"], ["q0"]),
            *([n("Add", ["bq", "q0"], ["q"])] if bias_on_q else [n("Relu", ["q0"], ["q"])]),
            n("MatMul", ["h", "Wo"], ["logits"]),
        ],
        [("x", elem, [2, 3, D])],
        [("q", elem, [2, 3, N]), ("logits", elem, [2, 3, V])],
        {
            "axes": np.array([-1]),
            **{
                k: rand(*shape, dtype=dtype)
                for k, shape in {"c": (), "w": (D,), "beta": (D,), "Wq": (D, N), "bq": (N,), "Wo": (D, V)}.items()
            },
        },
        opset=opset,
    )


@pytest.mark.parametrize("bias_on_q", [True, False])
@pytest.mark.parametrize("opset", [17, 18])
def test_ln_folds_mean_scale_and_beta_with_and_without_a_reader_bias(bias_on_q, opset):
    model = ln_block(bias_on_q, opset)
    report, *_ = fold_checked(model, x3())
    (entry,) = report.norms
    assert (entry.kind, entry.status) == ("ln", NormStatus.FOLDED)
    counts = ops(model)
    assert counts["ReduceMean"] == counts["Sub"] == counts["Mul"] == 0
    assert counts["Add"] == 2  # q's bias (kept or created) and the head's created bias
    assert [v.name for v in model.graph.outputs] == ["q", "logits"]


def test_ln_fold_is_exact_in_float64():
    fold_checked(ln_block(True, dtype=np.float64), {"x": rand(2, 3, D, dtype=np.float64)}, tol=1e-13)


def test_parallel_residual_both_norms_fold_and_the_shared_centering_goes():
    model = build(
        [
            n("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
            n("Sub", ["x", "m"], ["xc"]),
            n("Mul", ["xc", "w1"], ["h1w"]),
            n("Add", ["h1w", "b1"], ["h1"]),
            n("Mul", ["xc", "w2"], ["h2w"]),
            n("Add", ["h2w", "b2"], ["h2"]),
            n("MatMul", ["h1", "W1"], ["a"]),
            n("MatMul", ["h2", "W2"], ["b"]),
            n("Add", ["a", "b"], ["ab"]),
            n("Add", ["x", "ab"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, D])],
        {
            "axes": np.array([-1]),
            "w1": rand(D),
            "w2": rand(D),
            "b1": rand(D),
            "b2": rand(D),
            "W1": rand(D, D),
            "W2": rand(D, D),
        },
    )
    report, *_ = fold_checked(model, x3())
    assert [(e.kind, e.status) for e in report.norms] == [("ln", NormStatus.FOLDED)] * 2
    assert not {"ReduceMean", "Sub", "Mul"} & set(ops(model))


def test_shape_readers_never_block_a_fold():
    # Legacy exports read a norm's output with Shape (for a view) and Size; neither cares about values.
    model = build(
        [
            n("Mul", ["x", "w"], ["h"]),
            n("Shape", ["h"], ["s"]),
            n("Size", ["h"], ["z"]),
            n("MatMul", ["h", "W"], ["y0"]),
            n("Reshape", ["y0", "s6"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N]), ("s", I64, [3]), ("z", I64, [])],
        {"w": rand(D), "W": rand(D, N), "s6": np.array([2, 3, N])},
    )
    report, before, after = fold_checked(model, x3())
    assert report.norms[0].status == NormStatus.FOLDED
    np.testing.assert_array_equal(before[1], after[1])


@pytest.mark.parametrize("computed", [False, True])
def test_conv1d_reads_through_a_reshape_that_keeps_the_last_dim(computed):
    # GPT-2's Conv1D: view(-1, d) -> addmm (Gemm with C) -> view back. Legacy computes [-1, d] from Shape(h).
    shape = (
        [
            n("Shape", ["h"], ["hs"]),
            n("Slice", ["hs", "m1", "big", "zero"], ["last"]),
            n("Concat", ["m1", "last"], ["target"], axis=0),
        ]
        if computed
        else []
    )
    model = build(
        [
            n("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
            n("Sub", ["x", "m"], ["xc"]),
            n("Mul", ["xc", "w"], ["hw"]),
            n("Add", ["hw", "b"], ["h"]),
            *shape,
            n("Reshape", ["h", "target" if computed else "flat"], ["h2"]),
            n("Gemm", ["h2", "W", "C"], ["y2"]),
            n("Reshape", ["y2", "out_shape"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N])],
        {
            "axes": np.array([-1]),
            "w": rand(D),
            "b": rand(D),
            "W": rand(D, N),
            "C": rand(N),
            "flat": np.array([-1, D]),
            "m1": np.array([-1]),
            "big": np.array([2**63 - 1]),
            "zero": np.array([0]),
            "out_shape": np.array([2, 3, N]),
        },
    )
    report, *_ = fold_checked(model, x3())
    assert report.norms[0].status == NormStatus.FOLDED, report.norms[0].reason
    assert not {"ReduceMean", "Sub", "Mul"} & set(ops(model))


def test_reshape_that_splits_the_channels_blocks():
    model = build(
        [n("Mul", ["x", "w"], ["h"]), n("Reshape", ["h", "heads"], ["h4"]), n("MatMul", ["h4", "W"], ["y"])],
        [X],
        [("y", F32, [2, 3, 2, 2])],
        {"w": rand(D), "heads": np.array([2, 3, 2, 4]), "W": rand(4, 2)},
    )
    report, before, after = fold_checked(model, x3())
    assert report.norms[0].status == NormStatus.KEPT
    assert "does not keep the last dimension (8)" in report.norms[0].reason
    np.testing.assert_array_equal(before[0], after[0])


REFUSALS = {
    "residual": ([n("MatMul", ["h", "W"], ["a"]), n("Add", ["h", "a"], ["y"])], "read by Add 'y' (residual)"),
    "activation": ([n("Relu", ["h"], ["y"])], "read by Relu 'y' (an activation, not linear)"),
    "graph output": ([n("MatMul", ["h", "W"], ["y"])], "its output is the graph output 'h'"),
    "dynamic weight": ([n("MatMul", ["h", "x2"], ["y"])], "read by MatMul 'y' whose weight is not a constant"),
    "weight side": ([n("MatMul", ["Wt", "h"], ["y"])], "read by MatMul 'y' as its weight"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_norm_is_kept_unchanged_with_a_reason_to_act_on(case):
    readers, reason = REFUSALS[case]
    outputs = [("y", F32, None)] + ([("h", F32, [2, 3, D])] if case == "graph output" else [])
    model = build(
        [n("Mul", ["x", "c"], ["hc"]), n("Mul", ["hc", "w"], ["h"]), *readers],
        [X, ("x2", F32, [D, D])],
        outputs,
        {"c": np.array(0.5, np.float32), "w": rand(D), "W": rand(D, D), "Wt": rand(3, 3)},
    )
    report, before, after = fold_checked(model, {**x3(), "x2": rand(D, D)})
    (entry,) = report.norms
    assert entry.status == NormStatus.KEPT and entry.reason == reason and entry.message == f"kept: {reason}"
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert ops(model)["Mul"] == 2


def test_a_scale_computed_at_run_time_is_a_precondition_failure():
    model = build(
        [n("Mul", ["c", "w0"], ["w"]), n("Mul", ["x", "w"], ["h"]), n("MatMul", ["h", "W"], ["y"])],
        [X],
        [("y", F32, [2, 3, N])],
        {"c": np.array(0.5, np.float32), "w0": rand(D), "W": rand(D, N)},
    )
    with pytest.raises(ir.passes.PreconditionError, match="run FoldConstantsPass first"):
        FoldIntoReadersPass()(model)


def test_round_trip_casts_in_the_chain_collapse():
    # fp16 in, widened to fp32 for the scalar, narrowed back, then the fp16 weight (HF: weight * h.to(dtype)).
    model = build(
        [
            n("Cast", ["x"], ["x32"], to=F32),
            n("Mul", ["x32", "c"], ["hc"]),
            n("Cast", ["hc"], ["hc16"], to=F16),
            n("Mul", ["w", "hc16"], ["h"]),
            n("MatMul", ["h", "W"], ["y"]),
        ],
        [("x", F16, [2, 3, D])],
        [("y", F16, [2, 3, N])],
        {"c": np.array(0.8, np.float32), "w": rand(D, dtype=np.float16), "W": rand(D, N, dtype=np.float16)},
    )
    report, *_ = fold_checked(model, {"x": rand(2, 3, D, dtype=np.float16)}, tol=5e-3)
    assert report.norms[0].status == NormStatus.FOLDED
    assert ops(model) == Counter({"MatMul": 1})


def test_narrowing_cast_is_kept_and_a_cast_constant_is_resolved():
    model = build(
        [
            n("Mul", ["x", "c"], ["hc"]),
            n("Cast", ["hc"], ["hc16"], to=F16),
            n("Cast", ["w32"], ["w"], to=F16),
            n("Mul", ["hc16", "w"], ["h"]),
            n("MatMul", ["h", "W"], ["y"]),
        ],
        [X],
        [("y", F16, [2, 3, N])],
        {"c": np.array(0.8, np.float32), "w32": rand(D), "W": rand(D, N, dtype=np.float16)},
    )
    report, *_ = fold_checked(model, x3(), tol=5e-3)
    assert report.norms[0].status == NormStatus.FOLDED
    assert ops(model) == Counter({"Cast": 1, "MatMul": 1})


def test_bf16_weight_is_scaled_in_float64_and_cast_once():
    w, W = rand(D).astype(ml_dtypes.bfloat16), rand(D, N).astype(ml_dtypes.bfloat16)
    model = mul_matmul(rand(D))
    for name, array in (("s", w), ("W", W)):
        model.graph.initializers[name].const_value = ir.tensor(array, name=name)
    FoldIntoReadersPass()(model)
    folded = model.graph.initializers["W"].const_value.numpy()
    assert folded.dtype == ml_dtypes.bfloat16
    expected = w.astype(np.float64)[:, None] * W.astype(np.float64)
    np.testing.assert_array_equal(folded, expected.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("axis", [1, -1])
def test_slice_of_positions_keeps_rows_but_a_slice_of_channels_blocks(axis):
    # transformers keeps the last position's logits: hidden[:, -1:, :] before lm_head.
    model = build(
        [
            n("Mul", ["x", "w"], ["h"]),
            n("Slice", ["h", "start", "end", "axes"], ["hs"]),
            n("MatMul", ["hs", "W"], ["y"]),
        ],
        [X],
        [("y", F32, None)],
        {
            "w": rand(D),
            "W": rand(D if axis == 1 else 1, N),
            "start": np.array([-1]),
            "end": np.array([2**63 - 1]),
            "axes": np.array([axis]),
        },
    )
    report, *_ = fold_checked(model, x3())
    expected = NormStatus.FOLDED if axis == 1 else NormStatus.KEPT
    assert report.norms[0].status == expected, report.norms[0].reason


def test_a_graph_that_records_no_shapes_takes_the_norms_rank_from_onnx_shape_inference():
    # a legacy export records no shapes: the Slice of positions needs the norm's rank, which onnx's shape inference
    # carries through any op it knows (here a Clip in front of the norm)
    model = build(
        [
            n("Clip", ["x", "low", "high"], ["clipped"]),
            n("Mul", ["clipped", "w"], ["h"]),
            n("Slice", ["h", "start", "end", "axes"], ["hs"]),
            n("MatMul", ["hs", "W"], ["y"]),
        ],
        [X],
        [("y", F32, None)],
        {
            "low": np.array(-1.0, np.float32),
            "high": np.array(1.0, np.float32),
            "w": rand(D),
            "W": rand(D, N),
            "start": np.array([-1]),
            "end": np.array([2**63 - 1]),
            "axes": np.array([1]),
        },
    )
    report, *_ = fold_checked(model, x3())
    assert report.norms[0].status == NormStatus.FOLDED, report.norms[0].reason
    assert all(value.shape is None for node in model.graph for value in node.outputs if not value.is_graph_output())


def test_fold_passes_leave_a_real_norm_bit_identical():
    model = real_rms_model()
    before = run(model, x3_fixed := x3())
    report = FoldReport()
    FoldIntoReadersPass(report)(model)
    assert report.norms == []
    np.testing.assert_array_equal(before[0], run(model, x3_fixed)[0])


# ---- rows scaled by one number each (Llama 4's router score on each token's copy) -------------------------------


def _scaled_rows(kind="rms", factor_shape=(6, 1)):
    """x [2, 3, D] -> norm -> Reshape [6, D] -> Tile x2 -> Mul(r, a run-time input) -> MatMul(W) -> y."""
    ln = kind == "ln"
    head = [n("ReduceMean", ["x", "axes"], ["m"], keepdims=1), n("Sub", ["x", "m"], ["xc"])] if ln else []
    tail = [n("Add", ["hw", "beta"], ["h"])] if ln else [n("Identity", ["hw"], ["h"])]
    nodes = [
        *head,
        n("Mul", ["xc" if ln else "x", "c"], ["hc"]),
        n("Mul", ["hc", "w"], ["hw"]),
        *tail,
        n("Reshape", ["h", "rows"], ["h2"]),
        n("Tile", ["h2", "reps"], ["t"]),
        n("Mul", ["t", "r"], ["scaled"]),
        n("MatMul", ["scaled", "W"], ["y"]),
    ]
    inits = {
        "c": np.array(0.8, np.float32),
        "w": rand(D),
        "rows": np.array([6, D]),
        "reps": np.array([2, 1]),
        "W": rand(D, N),
        "axes": np.array([-1]),
        "beta": rand(D),
    }
    used = {v for *_, ins, _, _, _ in nodes for v in ins}
    return build(
        nodes,
        [X, ("r", F32, [12, *factor_shape[1:]])],
        [("y", F32, [12, N])],
        {k: v for k, v in inits.items() if k in used},
    )


def test_a_norm_read_through_rows_scaled_by_a_run_time_number_folds():
    report, *_ = fold_checked(_scaled_rows(), {**x3(), "r": rand(12, 1)})
    (entry,) = report.norms
    assert entry.status == NormStatus.FOLDED


def test_a_shifted_norm_read_through_scaled_rows_is_kept_with_the_reason():
    model = _scaled_rows("ln")
    report, *_ = fold_checked(model, {**x3(), "r": rand(12, 1)})
    (entry,) = report.norms
    assert entry.status == NormStatus.KEPT and "the norm's shift (β) would be scaled too" in entry.reason


def test_a_product_with_a_run_time_vector_per_channel_folds_as_a_gate():
    # (x·diag(s))⊙g = (x⊙g)·diag(s): a gated norm's gate after the norm; a shift would be gated too
    model = _scaled_rows(factor_shape=(12, D))
    report, *_ = fold_checked(model, {**x3(), "r": rand(12, D)})
    assert report.norms[0].status == NormStatus.FOLDED, report.norms[0].reason
    model = _scaled_rows("ln", factor_shape=(12, D))
    report, *_ = fold_checked(model, {**x3(), "r": rand(12, D)})
    assert report.norms[0].status == NormStatus.KEPT and "shift or centering does not pass" in report.norms[0].reason


def test_a_norm_read_through_constant_multipliers_on_two_branches_folds():
    # Falcon-H1's µP multipliers: the norm's output fans out, so neither scalar joins its chain
    model = build(
        [
            n("Mul", ["x", "c"], ["hc"]),
            n("Mul", ["hc", "w"], ["h"]),
            n("Mul", ["h", "half"], ["a"]),
            n("MatMul", ["a", "W"], ["y"]),
            n("Mul", ["third", "h"], ["b"]),
            n("MatMul", ["b", "W2"], ["y2"]),
        ],
        [X],
        [("y", F32, [2, 3, N]), ("y2", F32, [2, 3, N])],
        {
            "c": np.array(0.7, np.float32),
            "w": rand(D),
            "half": np.array(0.5, np.float32),
            "third": np.array([0.3], np.float32),
            "W": rand(D, N),
            "W2": rand(D, N),
        },
    )
    report, *_ = fold_checked(model, x3())
    assert report.norms[0].status == NormStatus.FOLDED, report.norms[0].reason


def test_a_gate_computed_from_the_norms_own_output_is_kept():
    model = build(
        [
            n("Mul", ["x", "w"], ["h"]),
            n("Reshape", ["h", "same"], ["h2"]),
            n("Mul", ["h", "h2"], ["hh"]),
            n("MatMul", ["hh", "W"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N])],
        {"w": rand(D), "same": np.array([2, 3, D]), "W": rand(D, N)},
    )
    report, before, after = fold_checked(model, x3())
    assert report.norms[0].status == NormStatus.KEPT and "computed from the norm's output" in report.norms[0].reason
    np.testing.assert_array_equal(before[0], after[0])


H = 3  # heads a per-head norm's rows are joined from


def _per_head(centered=False, gate=True, joined_shape=(2, 3, H * D)):
    """x [2, 3, H, D] -> a norm per head (scale c·w over D) -> Mul(gate z) -> Reshape to joined_shape -> MatMul(W
    [H·D, N]): Qwen3-Next's gated norm, its heads joined again for out_proj."""
    head = [n("ReduceMean", ["x", "axes"], ["m"], keepdims=1), n("Sub", ["x", "m"], ["xc"])] if centered else []
    nodes = [
        *head,
        n("Mul", ["xc" if centered else "x", "c"], ["hc"]),
        n("Mul", ["hc", "w"], ["h"]),
        n("Mul", ["h", "z"], ["gated"]) if gate else n("Identity", ["h"], ["gated"]),
        n("Reshape", ["gated", "joined"], ["j"]),
        n("MatMul", ["j", "W"], ["y"]),
    ]
    inits = {
        "c": np.array(0.8, np.float32),
        "w": rand(D),
        "joined": np.array(joined_shape),
        "W": rand(H * D, N),
        "axes": np.array([-1]),
    }
    used = {v for *_, ins, _, _, _ in nodes for v in ins}
    inputs = [("x", F32, [2, 3, H, D]), *([("z", F32, [2, 3, H, D])] if gate else [])]
    return build(nodes, inputs, [("y", F32, [2, 3, N])], {k: v for k, v in inits.items() if k in used})


@pytest.mark.parametrize("joined_shape", [(2, 3, H * D), (2, 3, -1)])
def test_a_per_head_norm_read_with_its_heads_joined_folds_its_scale_once_per_head(joined_shape):
    # fold_checked compares the outputs in ONNX Runtime: a scale not repeated per head gives other numbers
    report, *_ = fold_checked(_per_head(joined_shape=joined_shape), {"x": rand(2, 3, H, D), "z": rand(2, 3, H, D)})
    (entry,) = report.norms
    assert entry.status == NormStatus.FOLDED and entry.bytes_rewritten == H * D * N * 4, entry.reason


def test_a_centered_per_head_norm_read_with_its_heads_joined_is_kept():
    model = _per_head(centered=True, gate=False)
    report, *_ = fold_checked(model, {"x": rand(2, 3, H, D)})
    assert report.norms[0].status == NormStatus.KEPT and "each centered on its own" in report.norms[0].reason


# ---- a shift (β) into a stack of matrices: a bias per matrix (PhiMoE's experts) ---------------------------------

E = 4  # matrices in a stack


def _ln_into_stacks(x_shape=(2, 3, D)):
    """x [2, 3, D] -> TaperLN (β) read by (a) every matrix of a stack, MatMul(h [2, 1, 3, D], W [E, D, N]);
    (b) the matrices one expert id per token selects, as columns: MatMul(Gather(S [E, N, D], ids), h [6, D, 1]) (a
    Reshape to rows, then Unsqueeze: transformers' `batched_mm`);
    (c) one matrix read as a column: MatMul(Wc [N, D], h [2, 3, D, 1])."""
    nodes = [
        n("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
        n("Sub", ["x", "m"], ["xc"]),
        n("Mul", ["xc", "c"], ["hc"]),
        n("Mul", ["hc", "w"], ["hw"]),
        n("Add", ["hw", "beta"], ["h"]),
        n("Unsqueeze", ["h", "one"], ["h4"]),
        n("MatMul", ["h4", "W"], ["all"]),
        n("Reshape", ["h", "rows"], ["hrows"]),
        n("Unsqueeze", ["hrows", "last"], ["hcol"]),
        n("Gather", ["S", "ids"], ["picked"], axis=0),
        n("MatMul", ["picked", "hcol"], ["chosen"]),
        n("Unsqueeze", ["h", "last"], ["h1"]),
        n("MatMul", ["Wc", "h1"], ["column"]),
    ]
    inits = {
        "axes": np.array([-1]),
        "c": np.array(0.8, np.float32),
        "w": rand(D),
        "beta": rand(D),
        "one": np.array([-3]),
        "W": rand(E, D, N),
        "rows": np.array([6, D]),
        "S": rand(E, N, D),
        "last": np.array([-1]),
        "Wc": rand(N, D),
    }
    model = build(
        nodes,
        [("x", F32, x_shape), ("ids", I64, [6])],
        [("all", F32, None), ("chosen", F32, None), ("column", F32, None)],
        inits,
    )
    return ir.passes.common.ShapeInferencePass()(model).model  # ranks known, as in an exporter's graph


def test_a_shift_into_a_stack_of_matrices_becomes_a_bias_per_matrix():
    model = _ln_into_stacks()
    report, before, _after = fold_checked(model, {**x3(), "ids": np.array([3, 0, 2, 2, 1, 3])})
    (entry,) = report.norms
    assert entry.status == NormStatus.FOLDED, entry.reason
    counts = ops(model)
    assert counts["ReduceMean"] == counts["Sub"] == counts["Mul"] == 0
    assert counts["Add"] == 3 and counts["Gather"] == 2  # each layer's bias; the selected one by the same ids
    assert all(np.abs(b).max() > 0.1 for b in before)  # the shift is no rounding error in any output


def test_a_shift_into_a_stack_read_by_an_input_of_unknown_rank_is_kept():
    model = _ln_into_stacks(x_shape=None)  # x [D] would make each output a vector per matrix, no row for β·W
    report = FoldReport()
    FoldIntoReadersPass(report)(model)
    (entry,) = report.norms
    assert entry.status == NormStatus.KEPT and "a shift (β) needs a bias per matrix" in entry.reason
