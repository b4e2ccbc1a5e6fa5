"""Numbers the fold writes: a graph whose folded weight or bias would pass its dtype's range (float16's 65504, float32's
and bfloat16's ~3.4e38, float64's) keeps its norm, with the reason, wherever the fold would go (the readers, the
producer, the embedding table, a bias); the graph that comes out computes what the input did and holds no Inf. One
table of inputs for the class; export's own check (a checkpoint weight past the export dtype's range) is in
tests/test_dyt.py."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from _graphs import F16, I64, D, V, build, n, run
from onnx import TensorProto

from taperfold.passes import FoldReport, NormStatus, fold_model

BIG, SMALL = 300.0, 0.5  # 300 · 300 = 90000 > 65504; 300 · 0.5 fits


def _f16(shape, value):
    return np.full(shape, value, np.float16)


def into_readers(scale):
    """x -> Mul(s) -> MatMul(W) -> y: the fold writes diag(s)·W."""
    return build(
        [n("Mul", ["x", "s"], ["h"], "norm"), n("MatMul", ["h", "W"], ["y"], "mm")],
        [("x", F16, [2, D])],
        [("y", F16, [2, 4])],
        {"s": _f16(D, scale), "W": _f16((D, 4), BIG)},
    )


def into_producer(scale):
    """x -> MatMul(W) -> Mul(s) -> Relu -> y: no linear reader, so the fold writes W·diag(s) into the producer."""
    return build(
        [n("MatMul", ["x", "W"], ["z"], "mm"), n("Mul", ["z", "s"], ["h"], "norm"), n("Relu", ["h"], ["y"])],
        [("x", F16, [2, 4])],
        [("y", F16, [2, D])],
        {"s": _f16(D, scale), "W": _f16((4, D), BIG)},
    )


def into_embedding(scale):
    """Gather(E, ids) -> Mul(s) -> Relu -> y: the fold writes E·diag(s) into the table."""
    return build(
        [n("Gather", ["E", "ids"], ["e"], "lookup"), n("Mul", ["e", "s"], ["h"], "norm"), n("Relu", ["h"], ["y"])],
        [("ids", I64, [1, 3])],
        [("y", F16, [1, 3, D])],
        {"s": _f16(D, scale), "E": _f16((V, D), BIG)},
    )


FEEDS = {
    into_readers: lambda: {"x": np.full((2, D), 1e-3, np.float16)},
    into_producer: lambda: {"x": np.full((2, 4), 1e-3, np.float16)},
    into_embedding: lambda: {"ids": np.array([[0, 3, 7]], np.int64)},
}


def _fold(model: ir.Model) -> FoldReport:
    return fold_model(model)


@pytest.mark.parametrize("make", list(FEEDS), ids=lambda f: f.__name__)
def test_a_fold_past_float16s_range_keeps_the_norm_and_says_why(make):
    model, feeds = make(BIG), FEEDS[make]()
    before = run(model, feeds)
    report = _fold(model)
    (entry,) = report.norms
    assert entry.status == NormStatus.KEPT
    assert "the folded weight would reach 9e+04, past float16's range (±65504)" in entry.reason
    assert any(node.op_type == "Mul" for node in model.graph)
    for tensor in (v.const_value for v in model.graph.initializers.values()):
        assert np.isfinite(tensor.numpy().astype(np.float32)).all()
    np.testing.assert_array_equal(run(model, feeds)[0], before[0])


@pytest.mark.parametrize("make", list(FEEDS), ids=lambda f: f.__name__)
def test_a_float16_fold_within_range_still_folds(make):
    model, feeds = make(SMALL), FEEDS[make]()
    before = run(model, feeds)
    report = _fold(model)
    assert [e.status for e in report.norms] == [NormStatus.FOLDED]
    assert not any(node.op_type == "Mul" for node in model.graph)
    np.testing.assert_allclose(run(model, feeds)[0].astype(np.float32), before[0].astype(np.float32), rtol=2e-3)


# ---- every float dtype: the same check, each dtype's own range, the weight and the bias alike --------------------


@dataclasses.dataclass(frozen=True)
class Dtype:
    """A float dtype the graph's weights have, a value that fits it and whose square does not, and its range."""

    name: str
    numpy: type
    elem: int
    big: float
    limit: str  # how the reason writes the range
    runs: bool = True  # ONNX Runtime's CPU kernels take it (no bfloat16 MatMul)


DTYPES = [
    Dtype("float16", np.float16, TensorProto.FLOAT16, 300.0, "65504"),
    Dtype("float32", np.float32, TensorProto.FLOAT, 1e20, "3.40282e+38"),
    Dtype("bfloat16", ml_dtypes.bfloat16, TensorProto.BFLOAT16, 1e20, "3.38953e+38", runs=False),
    Dtype("float64", np.float64, TensorProto.DOUBLE, 1e200, "1.79769e+308"),  # the float64 product itself is Inf
]


def _full(dtype, shape, value):
    return np.full(shape, value, dtype.numpy)


def weight_into_readers(t: Dtype, scale):
    """x -> Mul(s) -> MatMul(W): diag(s)·W past the range."""
    return build(
        [n("Mul", ["x", "s"], ["h"], "norm"), n("MatMul", ["h", "W"], ["y"], "mm")],
        [("x", t.elem, [2, D])],
        [("y", t.elem, [2, 4])],
        {"s": _full(t, D, scale), "W": _full(t, (D, 4), t.big)},
    )


def weight_into_producer(t: Dtype, scale):
    """x -> MatMul(W) -> Mul(s) -> Relu: W·diag(s) past the range."""
    return build(
        [n("MatMul", ["x", "W"], ["z"], "mm"), n("Mul", ["z", "s"], ["h"], "norm"), n("Relu", ["h"], ["y"])],
        [("x", t.elem, [2, 4])],
        [("y", t.elem, [2, D])],
        {"s": _full(t, D, scale), "W": _full(t, (4, D), t.big)},
    )


def table_into_embedding(t: Dtype, scale):
    """Gather(E, ids) -> Mul(s) -> Relu: E·diag(s) past the range."""
    return build(
        [n("Gather", ["E", "ids"], ["e"], "lookup"), n("Mul", ["e", "s"], ["h"], "norm"), n("Relu", ["h"], ["y"])],
        [("ids", I64, [1, 3])],
        [("y", t.elem, [1, 3, D])],
        {"s": _full(t, D, scale), "E": _full(t, (V, D), t.big)},
    )


def shift_into_readers_bias(t: Dtype, shift):
    """A centered norm with a shift β: x -> x - mean -> Mul(s) -> Add(β) -> MatMul(W): diag(s)·W fits (s is small),
    β·W, the bias the fold writes, passes the range."""
    return build(
        [
            n("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
            n("Sub", ["x", "m"], ["xc"]),
            n("Mul", ["xc", "s"], ["hs"], "norm"),
            n("Add", ["hs", "beta"], ["h"]),
            n("MatMul", ["h", "W"], ["y"], "mm"),
        ],
        [("x", t.elem, [2, D])],
        [("y", t.elem, [2, 4])],
        {"axes": np.array([-1]), "s": _full(t, D, 1e-3), "beta": _full(t, D, shift), "W": _full(t, (D, 4), t.big)},
    )


def bias_into_producer(t: Dtype, scale):
    """x -> MatMul(W) -> Add(b) -> Mul(s) -> Relu: W·diag(s) fits (W is small), the bias b·s passes the range."""
    return build(
        [
            n("MatMul", ["x", "W"], ["z0"], "mm"),
            n("Add", ["z0", "b"], ["z"], "bias"),
            n("Mul", ["z", "s"], ["h"], "norm"),
            n("Relu", ["h"], ["y"]),
        ],
        [("x", t.elem, [2, 4])],
        [("y", t.elem, [2, D])],
        {"s": _full(t, D, scale), "b": _full(t, D, t.big), "W": _full(t, (4, D), 1e-3)},
    )


def _feeds(make, t: Dtype):
    if make is table_into_embedding:
        return {"ids": np.array([[0, 3, 7]], np.int64)}
    return {"x": np.full((2, 4 if "producer" in make.__name__ else D), 1e-3, t.numpy)}


PLACES = {  # what the fold would write there, and the input whose values pass the range
    weight_into_readers: "weight",
    weight_into_producer: "weight",
    table_into_embedding: "weight",
    shift_into_readers_bias: "bias",
    bias_into_producer: "bias",
}


@pytest.mark.parametrize("make", list(PLACES), ids=lambda f: f.__name__)
@pytest.mark.parametrize("t", DTYPES, ids=lambda t: t.name)
def test_a_fold_past_its_dtypes_range_keeps_the_norm_and_says_why_in_every_dtype(t, make):
    model = make(t, t.big)
    before = run(model, _feeds(make, t)) if t.runs else None
    report = _fold(model)
    (entry,) = report.norms
    assert entry.status == NormStatus.KEPT
    assert f"the folded {PLACES[make]} would reach " in entry.reason
    assert f", past {t.name}'s range (±{t.limit})" in entry.reason
    assert any(node.name == "norm" for node in model.graph)
    for tensor in (v.const_value for v in model.graph.initializers.values()):
        assert np.isfinite(tensor.numpy().astype(np.float64)).all()
    if before is not None:
        np.testing.assert_array_equal(run(model, _feeds(make, t))[0], before[0])


@pytest.mark.parametrize("make", list(PLACES), ids=lambda f: f.__name__)
@pytest.mark.parametrize("t", DTYPES, ids=lambda t: t.name)
def test_a_fold_within_its_dtypes_range_still_folds_in_every_dtype(t, make):
    model = make(t, 0.5)
    report = _fold(model)
    assert [e.status for e in report.norms] == [NormStatus.FOLDED], report.norms[0].reason
    assert not any(node.name == "norm" for node in model.graph)
