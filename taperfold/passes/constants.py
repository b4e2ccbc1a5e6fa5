"""Fold what a graph computes from constants at run time, so the norms' scales become visible.

Unoptimized exports (torch.onnx `optimize=False`, legacy `do_constant_folding=False`) compute `c·γ`
(or Gemma's `1 + w`) from two initializers on every call; the detector only sees constants. This pass
runs onnxscript's constant folder (`onnxscript.optimizer.fold_constants`, the one the dynamo exporter
itself uses) on small tensors only: weight-sized transposes stay, the readers' fold sees through them.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from taperfold.passes._graph import describe, is_const
from taperfold.passes.report import FoldReport

# Inputs larger than this are not folded (onnxscript's own default): norm scales and shapes are far
# smaller; weights are not copied.
SIZE_LIMIT = 8192
_ARITHMETIC = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Sqrt",
    "Reciprocal",
    "Neg",
    "Abs",
    "Exp",
    "Log",
    "Sin",
    "Cos",
    "Tanh",
    "Sigmoid",
    "MatMul",
    "Concat",
    "Expand",
    "Unsqueeze",
    "Squeeze",
}


def constant_computations(model: ir.Model, size_limit: int | None = None) -> list[ir.Node]:
    """Arithmetic nodes whose inputs are all constants (they compute a constant on every run), optionally
    only those whose inputs are all at most `size_limit` elements."""
    out = []
    for node in model.graph:
        if node.domain != "" or node.op_type not in _ARITHMETIC:
            continue
        inputs = [v for v in node.inputs if v is not None]
        if not inputs or not all(is_const(v) for v in inputs):
            continue
        if size_limit is not None and any(_size(v) > size_limit for v in inputs):
            continue
        out.append(node)
    return out


def _size(value: ir.Value) -> int:
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return 0
    return math.prod(shape.numpy())


def require_constants_folded(model: ir.Model) -> None:
    """Precondition of the fold passes: no small constant computation is left (run FoldConstantsPass)."""
    if left := constant_computations(model, SIZE_LIMIT):
        raise ir.passes.PreconditionError(
            f"{describe(left[0])} computes a constant at run time: run FoldConstantsPass first"
        )


class AfterConstantsPass(ir.passes.InPlacePass):
    """What the passes that rewrite norms share: the report they write into, their precondition (constants
    folded, else a norm whose scale is computed at run time is missed), and their postcondition: every
    norm a pass rewrote (`self.rewritten`, the outputs it replaced) is read by nothing any more."""

    def __init__(self, report: FoldReport | None = None):
        super().__init__()
        self.report = report if report is not None else FoldReport()
        self.rewritten: list[tuple[str, ir.Value]] = []  # (norm name, the output its readers no longer read)

    def requires(self, model: ir.Model) -> None:
        require_constants_folded(model)
        self.rewritten = []  # a run starts here: requires, call, ensures

    def ensures(self, model: ir.Model) -> None:
        for name, output in self.rewritten:
            if output.is_graph_output() or output.uses():
                raise ir.passes.PostconditionError(f"{name}: its output is still read after the pass rewrote it")


class FoldConstantsPass(ir.passes.InPlacePass):
    """Replace small constant computations by their values; the report counts them and lists what is left."""

    def __init__(self, report: FoldReport | None = None):
        super().__init__()
        self.report = report if report is not None else FoldReport()

    def ensures(self, model: ir.Model) -> None:
        require_constants_folded(model)  # what the passes after this one require

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.optimizer import fold_constants

        if not constant_computations(model):  # nothing to do: leave the graph exactly as it is
            self.report.constants_left = []
            return ir.passes.PassResult(model, modified=False)

        def should_fold(node: ir.Node) -> bool | None:
            # onnxscript folds a Transpose of any size; a weight's transpose is the readers' fold's business.
            if node.op_type == "Transpose" and any(_size(v) > SIZE_LIMIT for v in node.inputs if v is not None):
                return False
            return None

        nodes = len(model.graph)
        modified = fold_constants(model, input_size_limit=SIZE_LIMIT, should_fold=should_fold).modified
        left = constant_computations(model)
        self.report.constants_folded += nodes - len(model.graph)
        self.report.constants_left = [describe(node) for node in left]
        return ir.passes.PassResult(model, modified)
