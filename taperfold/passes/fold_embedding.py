"""Fold a norm that reads an embedding lookup into the table's rows, when its readers cannot take it.

Gather(table, ids) then a norm is the same as Gather(table', ids) with every row normed:
  RMS form  table' = table·diag(s)
  LN form   table' = (table - rowmean(table))·diag(s) + beta
Runs after FoldScaleIntoConsumersPass, so folding into the readers is preferred.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from taperfold.passes._graph import FLOAT_TYPES, NormMatch, derived_tensor, folded_source, is_fixed
from taperfold.passes.fold import Blocked, describe
from taperfold.passes.report import FoldReport


def _lookup(match: NormMatch) -> ir.Node | None:
    node = match.input.producer()
    if node is None or node.op_type != "Gather" or node.domain != "" or node.attributes.get_int("axis", 0) != 0:
        return None
    return node


def _table(gather: ir.Node, match: NormMatch) -> ir.Value:
    """The table to rewrite, or Blocked when the table or the looked-up rows are read elsewhere."""
    table = gather.inputs[0]
    if not is_fixed(table) or len(table.const_value.shape) != 2 or table.const_value.dtype not in FLOAT_TYPES:
        raise Blocked(f"the table of {describe(gather)} is not a constant 2-D float initializer")
    if table.const_value.shape[1] != match.scale.size:
        raise Blocked(f"the table of {describe(gather)} has rows of {table.const_value.shape[1]} channels")
    if match.output.is_graph_output():
        raise Blocked("the norm's output is a graph output")
    if rows_readers := [u.node for u in match.input.uses() if u.node not in match.nodes]:
        raise Blocked(f"the looked-up rows are also read by {describe(rows_readers[0])}")
    if table_readers := [u.node for u in table.uses() if u.node is not gather]:
        raise Blocked(f"table '{table.name}' is shared with {describe(table_readers[0])}")
    if table.is_graph_output():
        raise Blocked(f"table '{table.name}' is a graph output")
    return table


class FoldScaleIntoEmbeddingPass(ir.passes.InPlacePass):
    """For norms kept after the consumer fold whose input is an embedding lookup, rewrite the table."""

    def __init__(self, report: FoldReport):
        super().__init__()
        self.report = report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for entry in self.report.norms:
            if entry.status != "kept" or (gather := _lookup(entry.match)) is None:
                continue
            match = entry.match
            try:
                table = _table(gather, match)
            except Blocked as why:
                entry.reason += f"; embedding fold blocked: {why}"
                continue
            original = table.const_value

            def compute(original=original, match=match) -> np.ndarray:  # bound now: the loop moves on
                rows = original.numpy().astype(np.float64)
                if match.kind == "ln":
                    rows -= rows.mean(axis=1, keepdims=True)
                rows *= match.scale
                if match.bias is not None:
                    rows += match.bias
                return rows

            tensor = derived_tensor(compute, original.dtype, original.shape)
            tensor.name = table.name
            table.const_value = tensor
            match.output.replace_all_uses_with(folded_source(match))
            entry.status, entry.into = "folded", "embedding"
            entry.reason = f"folded into embedding table '{table.name}' ({entry.reason})"
            entry.bytes_rewritten += tensor.nbytes
            modified = True
        return ir.passes.PassResult(model, modified)
