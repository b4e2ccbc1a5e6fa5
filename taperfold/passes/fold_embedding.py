"""Fold a norm that reads an embedding lookup into the table's rows.

Gather(table, ids) then a norm is the same as Gather(table', ids) with every row normed:
  RMS form  table' = table·diag(s)
  LN form   table' = (table - rowmean(table))·diag(s) + beta
Only when the looked-up rows are read by nothing else but their shape; a table that something else reads too (a
tied head) is copied for the lookup, and the copy is reported. In the pipeline it runs after
FoldIntoReadersPass, so folding into the readers is preferred and this pass sees what was kept.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from taperfold.passes._graph import (
    FLOAT_TYPES,
    NormMatch,
    derived_tensor,
    describe,
    fixed_tensor,
    folded_source,
    node_label,
    past_range,
    remove_if_dead,
    write_const,
)
from taperfold.passes.constants import AfterConstantsPass
from taperfold.passes.detect import detect_norms
from taperfold.passes.readers import SHAPE_OPS, Blocked, why_readers_cannot
from taperfold.passes.report import NormStatus


def _lookup(match: NormMatch) -> ir.Node | None:
    node = match.input.producer()
    if node is None or node.op_type != "Gather" or node.domain != "" or node.attributes.get_int("axis", 0) != 0:
        return None
    return node


def _table(gather: ir.Node, match: NormMatch) -> tuple[ir.Value, ir.TensorProtocol]:
    """The table to rewrite and its contents, or Blocked when the looked-up rows or the norm's centering are read
    elsewhere."""
    table = gather.inputs[0]
    rows = fixed_tensor(table)
    if table is None or rows is None or len(rows.shape) != 2 or rows.dtype not in FLOAT_TYPES:
        raise Blocked(f"the table of {describe(gather)} is not a constant 2-D float initializer")
    if rows.shape[1] != match.width:
        raise Blocked(f"the table of {describe(gather)} has rows of {rows.shape[1]} channels")
    if match.output.is_graph_output():
        raise Blocked("its output is a graph output")
    inner = [v for node in match.nodes for v in node.outputs if v is not match.output]
    if shared := [u.node for v in inner for u in v.uses() if u.node not in match.nodes]:
        raise Blocked(f"its centering is shared with {describe(shared[0])}")
    # A Shape or Size reads what the fold keeps (legacy exports put one before each view); any other reader would see
    # the rows change.
    if rows_readers := [
        u.node
        for u in match.input.uses()
        if u.node not in match.nodes and not (u.node.domain == "" and u.node.op_type in SHAPE_OPS)
    ]:
        raise Blocked(f"the looked-up rows are also read by {describe(rows_readers[0])}")
    return table, rows


class FoldIntoEmbeddingPass(AfterConstantsPass):
    """For every candidate norm whose input is an embedding lookup, rewrite the table's rows.

    Requires: constants folded (FoldConstantsPass). Ensures: nothing reads a folded norm's output.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for candidate in detect_norms(model).candidates:
            match = candidate.match
            if (gather := _lookup(match)) is None:
                continue
            entry = self.report.entry(candidate.name, candidate.kind)
            readers_blocked = why_readers_cannot(match)
            try:
                table, original = _table(gather, match)
            except Blocked as why:
                entry.status = NormStatus.KEPT
                entry.reason = f"{readers_blocked}; not into the embedding: {why}" if readers_blocked else str(why)
                continue

            def compute(original: ir.TensorProtocol = original, match: NormMatch = match) -> np.ndarray:
                # arguments bound now: the loop moves on
                rows = original.numpy().astype(np.float64)
                if match.centered:
                    rows -= rows.mean(axis=1, keepdims=True)
                rows *= match.scale
                if match.bias is not None:
                    rows += match.bias
                return rows

            too_large = past_range(compute, original.dtype)
            if too_large:
                entry.status = NormStatus.KEPT
                entry.reason = (
                    f"{readers_blocked}; not into the embedding: {too_large}" if readers_blocked else too_large
                )
                continue
            tensor = derived_tensor(compute, original.dtype, original.shape.numpy())
            # a table the head reads too (tied) is copied for the lookup: the head keeps the original
            others = [u.node for u in table.uses() if u.node is not gather]
            written = write_const(model.graph, gather, 0, tensor, base=table.name or node_label(gather))
            if others:
                entry.copied.append(f"{table.name} -> {written.name} (also read by {describe(others[0])})")
            match.output.replace_all_uses_with(folded_source(match))
            remove_if_dead(model.graph, match.nodes)
            self.rewritten.append((candidate.name, match.output))
            entry.status, entry.into = NormStatus.FOLDED, "embedding"
            entry.reason = f"folded into embedding table '{written.name}'" + (
                f" (its readers could not: {readers_blocked})" if readers_blocked else ""
            )
            entry.bytes_rewritten += tensor.nbytes
            modified = True
        return ir.passes.PassResult(model, modified)
