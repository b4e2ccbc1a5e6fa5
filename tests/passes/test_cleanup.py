"""CleanupPass alone: dead nodes and initializers go, order is restored, the checker's verdict is kept."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from _graphs import F32, D, N, X, build, n, ops, rand

from taperfold.passes import CleanupPass, FoldReport
from taperfold.passes.cleanup import check


def test_dead_nodes_and_initializers_are_removed_and_the_checker_runs():
    model = build(
        [n("Mul", ["x", "w"], ["dead"]), n("MatMul", ["x", "W"], ["y"])],
        [X],
        [("y", F32, [2, 3, N])],
        {"w": rand(D), "W": rand(D, N)},
    )
    report = FoldReport()
    assert CleanupPass(report, input_check="passed")(model).modified
    assert ops(model) == {"MatMul": 1} and set(model.graph.initializers) == {"W"}
    assert report.initializers_removed == 1 and report.check_output == "passed"


def test_a_model_the_checker_already_rejects_is_still_cleaned_up():
    model = build(
        [n("Mul", ["x", "s"], ["dead"]), n("MatMul", ["x", "W"], ["y"])],
        [X],
        [("y", F32, [2, 3, N])],
        {"s": rand(D), "W": rand(D, N)},
    )
    model.graph.name = ""  # onnx.checker requires a graph name; ONNX Runtime does not
    input_check = check(model)
    report = FoldReport()
    assert CleanupPass(report, input_check=input_check)(model).modified
    assert ops(model) == {"MatMul": 1}
    assert input_check.startswith("failed: ") and report.check_output == input_check


def test_a_model_that_passed_the_checker_must_still_pass():
    model = build([n("MatMul", ["x", "W"], ["y"])], [X], [("y", F32, [2, 3, N])], {"W": rand(D, N)})
    model.graph.name = ""
    with pytest.raises(ir.passes.PostconditionError, match=r"fails onnx\.checker"):
        CleanupPass(FoldReport(), input_check="passed")(model)


def test_without_a_verdict_on_the_input_nothing_is_promised():
    model = build([n("MatMul", ["x", "W"], ["y"])], [X], [("y", F32, [2, 3, N])], {"W": rand(D, N)})
    model.graph.name = ""
    report = FoldReport()
    CleanupPass(report)(model)
    assert report.check_output.startswith("failed: ")
