"""Graphs with subgraphs (If branches, nested at any depth) are valid input to `taperfold fold --verify`: a norm in the
main graph folds, a norm inside a subgraph stays in place with the reason, and a weight a subgraph also reads is
copied, never rewritten under it. One table of graphs for the class; each runs through the command line, exits 0,
computes what its input did, and leaves nothing but its output."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from _graphs import run
from onnx import TensorProto, helper, numpy_helper

F32 = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _init(name, *shape):
    return numpy_helper.from_array((RNG.standard_normal(shape) + 2).astype(np.float32), name)


def _branch(name, nodes, output):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, F32, [2, 8])])


def _model(nodes, inits, outputs=("y",)):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F32, [2, 8])],
        [helper.make_tensor_value_info(o, F32, [2, 8]) for o in outputs],
        [*inits, numpy_helper.from_array(np.array(True), "cond")],
    )
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])


def norm_in_a_branch():
    then = _branch(
        "then",
        [helper.make_node("Mul", ["x", "s"], ["h"], "mul"), helper.make_node("MatMul", ["h", "W"], ["t"], "mm")],
        "t",
    )
    other = _branch("else", [helper.make_node("MatMul", ["x", "W"], ["e"], "mm2")], "e")
    return _model(
        [helper.make_node("If", ["cond"], ["y"], "if", then_branch=then, else_branch=other)],
        [_init("s", 8), _init("W", 8, 8)],
    )


def norm_in_a_nested_branch():
    inner = _branch(
        "inner",
        [helper.make_node("Mul", ["x", "s"], ["h"], "mul"), helper.make_node("MatMul", ["h", "W"], ["t"], "mm")],
        "t",
    )
    plain = _branch("plain", [helper.make_node("Identity", ["x"], ["p"], "id")], "p")
    then = _branch(
        "then", [helper.make_node("If", ["cond"], ["o"], "inner_if", then_branch=inner, else_branch=plain)], "o"
    )
    return _model(
        [helper.make_node("If", ["cond"], ["y"], "if", then_branch=then, else_branch=plain)],
        [_init("s", 8), _init("W", 8, 8)],
    )


def folded_weight_read_by_a_branch():
    reads_w = _branch("then", [helper.make_node("MatMul", ["x", "W"], ["t"], "branch_mm")], "t")
    plain = _branch("else", [helper.make_node("Identity", ["x"], ["e"], "id")], "e")
    return _model(
        [
            helper.make_node("Mul", ["x", "s"], ["h"], "mul"),
            helper.make_node("MatMul", ["h", "W"], ["y"], "mm"),
            helper.make_node("If", ["cond"], ["z"], "if", then_branch=reads_w, else_branch=plain),
        ],
        [_init("s", 8), _init("W", 8, 8)],
        outputs=("y", "z"),
    )


CASES = {  # graph -> {norm: (status, words its reason holds)}
    norm_in_a_branch: {"if/then_branch/mul": ("kept", "inside the then_branch of If 'if'")},
    norm_in_a_nested_branch: {
        "if/then_branch/inner_if/then_branch/mul": ("kept", "inside the then_branch of If 'inner_if'")
    },
    folded_weight_read_by_a_branch: {"mul": ("folded", "")},
}


@pytest.mark.parametrize("make", list(CASES), ids=lambda f: f.__name__)
def test_a_graph_with_subgraphs_folds_what_it_can_and_keeps_the_rest(make, tmp_path, cli):
    src, dst, report = tmp_path / "in.onnx", tmp_path / "out.onnx", tmp_path / "fold.json"
    onnx.save(make(), src)
    r = cli("fold", src, "-o", dst, "--verify", "--report", report)
    assert r.exit_code == 0, r.stderr
    norms = {e["name"]: (e["status"], e["reason"]) for e in json.loads(report.read_text())["norms"]}
    assert set(norms) == set(CASES[make])
    for name, (status, words) in CASES[make].items():
        assert norms[name][0] == status and words in norms[name][1], norms[name]
    feeds = {"x": RNG.standard_normal((2, 8)).astype(np.float32)}
    for before, after in zip(run(str(src), feeds), run(str(dst), feeds)):
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["in.onnx", "out.onnx", "fold.json", *(["out.onnx.data"] if (tmp_path / "out.onnx.data").exists() else [])]
    )


def test_a_weight_a_branch_reads_is_copied_for_the_fold_and_left_to_the_branch(tmp_path, cli):
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(folded_weight_read_by_a_branch(), src)
    assert cli("fold", src, "-o", dst).exit_code == 0
    out = onnx.load(dst)
    weights = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(src).graph.initializer}
    np.testing.assert_array_equal(weights["W"], original["W"])  # what the branch reads, untouched
    (folded,) = [name for name in weights if name.startswith("W.folded")]
    np.testing.assert_allclose(weights[folded], original["s"][:, None] * original["W"], rtol=1e-6)
