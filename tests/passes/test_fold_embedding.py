"""FoldIntoEmbeddingPass alone: a norm right after an embedding lookup goes into the table's rows."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from _graphs import F32, I64, D, V, build, n, ops, rand, rel_err, rng, run

from taperfold.passes import FoldIntoEmbeddingPass, FoldReport, NormStatus


def embed_model(tied: bool, kind: str = "rms", shared_centering: bool = False):
    ln = kind == "ln"
    head = [n("ReduceMean", ["emb", "axes"], ["m"], keepdims=1), n("Sub", ["emb", "m"], ["ec"])] if ln else []
    return build(
        [
            n("Gather", ["E", "ids"], ["emb"]),
            *head,
            n("Mul", ["c", "ec" if ln else "emb"], ["hc"]),
            n("Mul", ["hc", "w"], ["hw"]),
            *([n("Add", ["hw", "beta"], ["h"])] if ln else [n("Identity", ["hw"], ["h"])]),
            *(
                [n("Mul", ["ec", "w"], ["h2"]), n("Add", ["h", "h2"], ["h3"])]
                if shared_centering
                else [n("Identity", ["h"], ["h3"])]
            ),
            n("Add", ["h3", "r"], ["y"]),  # a residual: the readers cannot take the fold
            *([n("Transpose", ["E"], ["Et"]), n("MatMul", ["y", "Et"], ["logits"])] if tied else []),
        ],
        [("ids", I64, [2, 3]), ("r", F32, [2, 3, D])],
        [("logits", F32, [2, 3, V])] if tied else [("y", F32, [2, 3, D])],
        {"E": rand(V, D), "axes": np.array([-1]), "c": np.array(1.7, np.float32), "w": rand(D), "beta": rand(D)},
    )


def fold_checked(model):
    feeds = {"ids": rng.integers(0, V, (2, 3)), "r": rand(2, 3, D)}
    before = run(model, feeds)
    report = FoldReport()
    FoldIntoEmbeddingPass(report)(model)
    after = run(model, feeds)
    assert rel_err(before[0], after[0]) <= 1e-5
    return report, before, after


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_norm_after_an_embedding_folds_into_the_table(kind):
    model = embed_model(tied=False, kind=kind)
    report, *_ = fold_checked(model)
    (entry,) = report.norms
    assert (entry.status, entry.into) == (NormStatus.FOLDED, "embedding") and "'E'" in entry.reason
    assert not {"Mul", "ReduceMean", "Sub"} & set(ops(model)) and ops(model)["Add"] == 1


def test_a_tied_table_is_copied_for_the_lookup_and_the_head_keeps_the_original():
    model = embed_model(tied=True)
    original = model.graph.initializers["E"].const_value.numpy().copy()
    report, *_ = fold_checked(model)  # the logits, which the head computes from the table, are unchanged
    (entry,) = report.norms
    assert (entry.status, entry.into) == (NormStatus.FOLDED, "embedding")
    assert entry.copied == ["E -> E.folded (also read by Transpose 'Et')"] and "'E.folded'" in entry.reason
    gather = next(node for node in model.graph if node.op_type == "Gather")
    assert gather.inputs[0].name == "E.folded"
    np.testing.assert_array_equal(model.graph.initializers["E"].const_value.numpy(), original)


def test_a_shape_read_of_the_looked_up_rows_does_not_block_the_fold():
    # The legacy exporter reads the rows' shape before a view: the fold keeps the shape.
    model = embed_model(tied=False)
    gather = next(node for node in model.graph if node.op_type == "Gather")
    shape = ir.node("Shape", [gather.outputs[0]], name="rows_shape")
    model.graph.insert_after(gather, shape)
    shape.outputs[0].name = "rows_shape"
    model.graph.outputs.append(shape.outputs[0])
    report, before, after = fold_checked(model)
    (entry,) = report.norms
    assert entry.status == NormStatus.FOLDED
    np.testing.assert_array_equal(before[1], after[1])


def test_embedding_fold_is_blocked_when_the_centering_is_shared():
    # Rewriting the table would change what the other reader of x - mean sees.
    model = embed_model(tied=False, kind="ln", shared_centering=True)
    report, before, after = fold_checked(model)
    assert len(report.norms) == 2  # the norm after the lookup, and the chain sharing its centering
    assert all(e.status == NormStatus.KEPT and "centering is shared" in e.reason for e in report.norms)
    np.testing.assert_array_equal(before[0], after[0])
