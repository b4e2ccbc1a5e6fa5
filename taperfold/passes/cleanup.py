"""Remove what the folds left dead, restore topological order, and check the result."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import CheckerPass, RemoveUnusedNodesPass, TopologicalSortPass

from taperfold.errors import first_line
from taperfold.passes.report import FoldReport

# CheckerPass leaves tensors over 1 KB out of the proto it checks: models over 2 GB pass through it
# and no large weight is read. Smaller ones go in, and if stored externally the checker would look for
# their data file relative to the working directory, so they are handed over by value.
_SMALL = 64 * 1024


@contextlib.contextmanager
def _small_external_tensors_in_memory(model: ir.Model) -> Iterator[None]:
    swapped = {
        value: value.const_value
        for value in model.graph.initializers.values()
        if isinstance(value.const_value, ir.ExternalTensor) and value.const_value.nbytes <= _SMALL
    }
    try:
        for value, tensor in swapped.items():
            value.const_value = ir.Tensor(tensor.numpy(), name=tensor.name)
        yield
    finally:
        for value, tensor in swapped.items():
            value.const_value = tensor


def check(model: ir.Model) -> str:
    """onnx.checker's verdict on the model: "passed" or "failed: <first line of the error>"."""
    try:
        with _small_external_tensors_in_memory(model):
            CheckerPass()(model)
    except onnx.checker.ValidationError as e:
        return f"failed: {first_line(e)}"
    return "passed"


class CleanupPass(ir.passes.InPlacePass):
    """Drop dead nodes and initializers (folded norm chains, weights replaced by copies), sort, check.

    `input_check`: onnx.checker's verdict on the model before any pass changed it (`check(model)`). A model that
    passed then must still pass (PostconditionError otherwise); one it rejected already (ONNX Runtime is more
    lenient), or None, is cleaned up anyway and the report says what the checker says now.
    """

    def __init__(self, report: FoldReport | None = None, input_check: str | None = None):
        super().__init__()
        self.report = report if report is not None else FoldReport()
        self.input_check = input_check

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        initializers = len(model.graph.initializers)
        modified = RemoveUnusedNodesPass()(model).modified
        modified |= TopologicalSortPass()(model).modified
        self.report.nodes_after = len(model.graph)
        self.report.initializers_removed = initializers - len(model.graph.initializers)
        self.report.check_output = check(model)
        return ir.passes.PassResult(model, modified)

    def ensures(self, model: ir.Model) -> None:
        if self.input_check == "passed" and self.report.check_output != "passed":
            raise ir.passes.PostconditionError(f"the folded model fails onnx.checker: {self.report.check_output}")
