"""A graph's pipeline (passes/pipeline.py): its steps run in the one order, in parts where export writes between them,
the cleanup after the fused projections; export's folded graph is the one `taperfold fold` makes of its unfolded
graph."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from _graphs import F32, D, N, X, build, n, ops, rand, rel_err, run, x3

from taperfold.export import ExportOptions, export_checkpoint
from taperfold.models import random_gate0_model
from taperfold.passes import FuseProjectionsPass, NormStatus, Pipeline, Step, fold_model, load_model, save_model


def norm_read_by_three_projections():
    """A norm at g = 0 (x·c·γ̃) read by q, k and v, their outputs summed."""
    return build(
        [
            n("Mul", ["x", "c"], ["hc"]),
            n("Mul", ["hc", "w"], ["h"]),
            n("MatMul", ["h", "Wq"], ["q"]),
            n("MatMul", ["h", "Wk"], ["k"]),
            n("MatMul", ["h", "Wv"], ["v"]),
            n("Add", ["q", "k"], ["qk"]),
            n("Add", ["qk", "v"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N])],
        {"c": np.array(0.5, np.float32), "w": rand(D), "Wq": rand(D, N), "Wk": rand(D, N), "Wv": rand(D, N)},
    )


def test_a_pipeline_runs_in_parts_up_to_a_step_and_its_cleanup_counts_the_fused_projections():
    model, feeds = norm_read_by_three_projections(), x3()
    before = run(model, feeds)
    pipeline = Pipeline(model, fold=True, fuse_projections=True)
    assert list(pipeline.steps) == sorted(pipeline.steps)
    pipeline.run(until=Step.FOLD_INTO_PRODUCER)
    assert pipeline.fold is not None and pipeline.fold.norms[0].status == NormStatus.FOLDED
    assert ops(model)["MatMul"] == 3 and pipeline.fold.check_output == ""  # neither fused nor cleaned up yet
    pipeline.run()
    assert ops(model)["MatMul"] == 1 and ops(model)["Split"] == 1
    assert pipeline.fold.nodes_after == len(model.graph) and pipeline.fold.check_output == "passed"
    assert rel_err(before[0], run(model, feeds)[0]) <= 1e-5


def test_a_pipeline_run_again_runs_no_step_twice(monkeypatch):
    # export runs a baseline's pipeline in parts, writing a file between them
    calls = []
    fuse = FuseProjectionsPass.call
    monkeypatch.setattr(FuseProjectionsPass, "call", lambda self, model: calls.append(model) or fuse(self, model))
    model = norm_read_by_three_projections()
    pipeline = Pipeline(model, fuse_projections=True, fuse_norms=True)
    pipeline.run(until=Step.FUSE_PROJECTIONS)
    pipeline.run(until=Step.FUSE_PROJECTIONS)
    pipeline.run()
    assert calls == [model] and ops(model)["MatMul"] == 1


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint

    model = random_gate0_model("tiny", "llama", n_layers=2, max_seq_len=32)
    return save_checkpoint(checkpoint_from_model(model, 0), tmp_path_factory.mktemp("llama") / "llama.safetensors")


def test_exports_folded_graph_is_what_fold_makes_of_its_unfolded_graph(tiny_llama, tmp_path):
    # TensorRT's target and no fused projections: the unfolded graph is the trace as it is, and the folded one that
    # trace through the fold, as `taperfold fold` runs it
    out = export_checkpoint(
        tiny_llama, tmp_path / "out", ExportOptions(target="trt", fuse_projections=False, baseline=False)
    ).out_dir
    model = load_model(out / "unfolded.onnx")
    report = fold_model(model)
    save_model(model, tmp_path / "folded.onnx")
    ours, exported = (
        onnx.load(str(path), load_external_data=False).graph for path in (tmp_path / "folded.onnx", out / "model.onnx")
    )
    assert [(node.op_type, node.name, list(node.input), list(node.output)) for node in ours.node] == [
        (node.op_type, node.name, list(node.input), list(node.output)) for node in exported.node
    ]
    assert report.count(NormStatus.FOLDED) == 2 * 2


def test_exports_fold_report_counts_the_folded_graph_it_wrote_with_its_fused_projections(tiny_llama, tmp_path):
    # TensorRT's target: nothing runs after the cleanup, so the graph written is the one the fold report counts
    out = export_checkpoint(tiny_llama, tmp_path / "out", ExportOptions(target="trt", baseline=False)).out_dir
    folded = json.loads((out / "manifest.json").read_text())["artifacts"]["folded"]
    assert folded["projections"]["summary"]["groups"] == 2 * 2  # q/k/v and gate/up in each layer
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert folded["reports"]["fold"]["summary"]["nodes_after"] == len(graph.node)
