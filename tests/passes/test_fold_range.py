"""Numbers the fold writes: a float16 graph whose folded weight would pass float16's range (65504) keeps its norm, with
the reason, wherever the fold would go (the readers, the producer, the embedding table); the graph that comes out
computes what the input did and holds no Inf. One table of inputs for the class; export's own check (a checkpoint
weight past the export dtype's range) is in tests/test_dyt.py."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from _graphs import D, F16, I64, V, build, n, run

from taperfold.passes import FoldReport, NormStatus, fold_passes

BIG, SMALL = 300.0, 0.5  # 300 · 300 = 90000 > 65504; 300 · 0.5 fits


def _f16(shape, value):
    return np.full(shape, value, np.float16)


def into_readers(scale):
    """x -> Mul(s) -> MatMul(W) -> y: the fold writes diag(s)·W."""
    return build([n("Mul", ["x", "s"], ["h"], "norm"), n("MatMul", ["h", "W"], ["y"], "mm")],
                 [("x", F16, [2, D])], [("y", F16, [2, 4])], {"s": _f16(D, scale), "W": _f16((D, 4), BIG)})


def into_producer(scale):
    """x -> MatMul(W) -> Mul(s) -> Relu -> y: no linear reader, so the fold writes W·diag(s) into the producer."""
    return build([n("MatMul", ["x", "W"], ["z"], "mm"), n("Mul", ["z", "s"], ["h"], "norm"), n("Relu", ["h"], ["y"])],
                 [("x", F16, [2, 4])], [("y", F16, [2, D])], {"s": _f16(D, scale), "W": _f16((4, D), BIG)})


def into_embedding(scale):
    """Gather(E, ids) -> Mul(s) -> Relu -> y: the fold writes E·diag(s) into the table."""
    return build([n("Gather", ["E", "ids"], ["e"], "lookup"), n("Mul", ["e", "s"], ["h"], "norm"),
                  n("Relu", ["h"], ["y"])],
                 [("ids", I64, [1, 3])], [("y", F16, [1, 3, D])], {"s": _f16(D, scale), "E": _f16((V, D), BIG)})


FEEDS = {
    into_readers: lambda: {"x": np.full((2, D), 1e-3, np.float16)},
    into_producer: lambda: {"x": np.full((2, 4), 1e-3, np.float16)},
    into_embedding: lambda: {"ids": np.array([[0, 3, 7]], np.int64)},
}


def _fold(model: ir.Model) -> FoldReport:
    report = FoldReport()
    ir.passes.PassManager(fold_passes(report))(model)
    return report


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
