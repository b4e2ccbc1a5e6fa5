"""FoldConstantsPass alone: scales an unoptimized export computes at run time become constants."""

from __future__ import annotations

import numpy as np
from _graphs import F32, D, N, X, build, n, rand, rel_err, run, serialized, x3

from taperfold.passes import FoldConstantsPass, FoldReport, detect_norms


def unoptimized(big: bool = False):
    # torch.onnx optimize=False: c * weight (and Gemma's 1 + weight) are computed on every call.
    big_nodes = (
        [n("Mul", ["B", "B"], ["BB"]), n("MatMul", ["y0", "BB"], ["y"])] if big else [n("Identity", ["y0"], ["y"])]
    )
    return build(
        [
            n("Add", ["one", "w0"], ["w1"]),
            n("Mul", ["c", "w1"], ["cw"]),
            n("Mul", ["x", "cw"], ["h"]),
            n("MatMul", ["h", "W"], ["y0"]),
            *big_nodes,
        ],
        [X],
        [("y", F32, [2, 3, 100 if big else N])],
        {
            "one": np.array(1.0, np.float32),
            "w0": rand(D),
            "c": np.array(0.7, np.float32),
            "W": rand(D, 100 if big else N),
            **({"B": rand(100, 100)} if big else {}),
        },
    )


def test_run_time_scale_is_folded_and_then_the_norm_is_found():
    model, feeds = unoptimized(), x3()
    before = run(model, feeds)
    assert not detect_norms(model)
    report = FoldReport()
    assert FoldConstantsPass(report)(model).modified
    assert report.constants_folded == 2 and report.constants_left == []
    (candidate,) = detect_norms(model).candidates  # the folded pass's precondition now holds
    assert candidate.match.scale.shape == (D,)
    assert rel_err(before[0], run(model, feeds)[0]) <= 1e-6


def test_large_constant_computations_are_left_and_reported():
    model = unoptimized(big=True)
    report = FoldReport()
    FoldConstantsPass(report)(model)
    assert report.constants_left == ["Mul 'BB'"]


def test_a_graph_without_constant_computations_is_not_touched():
    model = build(
        [n("Mul", ["x", "w"], ["h"]), n("MatMul", ["h", "W"], ["y"])],
        [X],
        [("y", F32, [2, 3, N])],
        {"w": rand(D), "W": rand(D, N)},
    )
    before = serialized(model)
    assert not FoldConstantsPass()(model).modified
    assert serialized(model) == before
