"""CleanupPass alone: dead nodes and initializers go, order is restored, the checker's verdict is kept."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from _graphs import D, F32, N, X, build, n, ops, rand

from taperfold.passes import CleanupPass, FoldReport, fold_model


def test_dead_nodes_and_initializers_are_removed_and_the_checker_runs():
    model = build([n("Mul", ["x", "w"], ["dead"]), n("MatMul", ["x", "W"], ["y"])], [X], [("y", F32, [2, 3, N])],
                  {"w": rand(D), "W": rand(D, N)})
    report = FoldReport(check_input="passed")
    assert CleanupPass(report)(model).modified
    assert ops(model) == {"MatMul": 1} and set(model.graph.initializers) == {"W"}
    assert report.initializers_removed == 1 and report.check_output == "passed"


def test_a_model_the_checker_already_rejects_is_still_folded():
    model = build([n("Mul", ["x", "s"], ["h"]), n("MatMul", ["h", "W"], ["y"])], [X], [("y", F32, [2, 3, N])],
                  {"s": rand(D), "W": rand(D, N)})
    model.graph.name = ""  # onnx.checker requires a graph name; ONNX Runtime does not
    report = fold_model(model)
    assert report.norms[0].status == "folded"
    assert report.check_input.startswith("failed: ") and report.check_output == report.check_input


def test_a_model_that_passed_the_checker_must_still_pass():
    model = build([n("MatMul", ["x", "W"], ["y"])], [X], [("y", F32, [2, 3, N])], {"W": rand(D, N)})
    model.graph.name = ""
    with pytest.raises(ir.passes.PostconditionError, match="fails onnx.checker"):
        CleanupPass(FoldReport(check_input="passed"))(model)
