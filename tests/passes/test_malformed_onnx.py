"""Malformed ONNX: one line naming the file and the node, tensor or input, exit 2, no
traceback, nothing written; the graph is checked (taperfold.onnx_files.check_graph, through load_model) before
any pass runs, and `fold --verify` refuses an input it cannot generate before allocating it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from taperfold.errors import TaperfoldError
from taperfold.passes import fold_onnx_file

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
rng = np.random.default_rng(0)


def weight(name, *shape):
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def raw_tensor(name, dims, data=b"", data_type=F32):
    """A tensor that claims `dims` whatever `data` holds (onnx.helper would refuse to build it)."""
    tensor = TensorProto(name=name, data_type=data_type, dims=dims)
    tensor.raw_data = data
    return tensor


def external(name, dims, location="w.data", **entries):
    tensor = TensorProto(name=name, data_type=F32, dims=dims, data_location=TensorProto.EXTERNAL)
    for key, value in {"location": location, **entries}.items():
        tensor.external_data.add(key=key, value=str(value))
    return tensor


def node(op, inputs, outputs, name=None, **attrs):
    return helper.make_node(op, inputs, outputs, name=name or outputs[0], **attrs)


def model(nodes, inits, inputs=(("x", F32, [2, 8]),), outputs=(("y", F32, None),)):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info(*o) for o in outputs],
        inits,
    )
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])


def scale_matmul(s=None, w=None, extra=(), **kw):
    """y = Mul(x, s) · W: a constant-scale norm that folds."""
    return model(
        [node("Mul", ["x", "s"], ["h"], "mul"), node("MatMul", ["h", "W"], ["y"], "mm")],
        [s or weight("s", 8), w or weight("W", 8, 4), *extra],
        **kw,
    )


def embedding(rows=11, ids_shape=(1, "seq")):
    """y = Mul(Gather(E, input_ids), s) · W."""
    return model(
        [node("Gather", ["E", "input_ids"], ["e"]), node("Mul", ["e", "s"], ["h"]), node("MatMul", ["h", "W"], ["y"])],
        [weight("E", rows, 8), weight("s", 8), weight("W", 8, 4)],
        inputs=(("input_ids", I64, list(ids_shape)),),
    )


def if_model(branch_reads):
    """An If whose then-branch negates `branch_reads` (read from the enclosing graph)."""
    branch = helper.make_graph(
        [node("Neg", [branch_reads], ["t"], "neg")], "then", [], [helper.make_tensor_value_info("t", F32, None)]
    )
    other = helper.make_graph(
        [node("Identity", ["x"], ["e"], "id")], "else", [], [helper.make_tensor_value_info("e", F32, None)]
    )
    return model(
        [
            node("Mul", ["x", "s"], ["h"], "mul"),
            node("MatMul", ["h", "W"], ["m"], "mm"),
            node("If", ["cond"], ["y"], "if", then_branch=branch, else_branch=other),
        ],
        [weight("s", 8), weight("W", 8, 8), numpy_helper.from_array(np.array(True), "cond")],
    )


def short_typed():
    tensor = TensorProto(name="W", data_type=F32, dims=[8, 4])
    tensor.float_data.extend([1.0, 2.0, 3.0])
    return tensor


def short_constant():
    const = node("Constant", [], ["W"], "c", value=raw_tensor("W", [8, 4], b"\0" * 40))
    return model(
        [node("Mul", ["x", "s"], ["h"], "mul"), const, node("MatMul", ["h", "W"], ["y"], "mm")], [weight("s", 8)]
    )


def cyclic():
    return model(
        [
            node("Add", ["x", "b"], ["a"], "A"),
            node("Relu", ["a"], ["b"], "B"),
            node("Mul", ["a", "s"], ["h"], "mul"),
            node("MatMul", ["h", "W"], ["y"], "mm"),
        ],
        [weight("s", 8), weight("W", 8, 4)],
    )


W_BYTES = np.ones(16, np.float32).tobytes()  # w.data: 64 bytes

# case -> (the model, the one line's telling part)
CASES = {
    "undefined input": (
        lambda: model(
            [node("Mul", ["x", "nope"], ["h"], "mul"), node("MatMul", ["h", "W"], ["y"])], [weight("W", 8, 4)]
        ),
        "node 'mul' (Mul) reads 'nope', which no graph input, initializer or node defines",
    ),
    "undefined in a subgraph": (
        lambda: if_model("nope"),
        "in attribute 'then_branch' of node 'if' (If): node 'neg' (Neg) reads 'nope'",
    ),
    "undefined output": (
        lambda: scale_matmul(outputs=(("y", F32, None), ("z", F32, None))),
        "graph output 'z' is not defined by any node, input or initializer",
    ),
    "duplicate initializer": (lambda: scale_matmul(extra=[weight("W", 8, 4)]), "initializer 'W' is defined twice"),
    "value written twice": (
        lambda: model(
            [
                node("Mul", ["x", "s"], ["h"], "mul"),
                node("Neg", ["x"], ["h"], "neg"),
                node("MatMul", ["h", "W"], ["y"]),
            ],
            [weight("s", 8), weight("W", 8, 4)],
        ),
        "value 'h' is written by both node 'mul' (Mul) and node 'neg' (Neg)",
    ),
    "10^12 elements": (
        lambda: scale_matmul(w=raw_tensor("W", [10**6, 10**6])),
        "initializer 'W' has 0 bytes of data, its shape [1000000, 1000000] of FLOAT needs 4000000000000",
    ),
    "2^42 elements": (
        lambda: scale_matmul(w=raw_tensor("W", [2**21, 2**21])),
        "initializer 'W' claims 4,398,046,511,104 elements (shape [2097152, 2097152])",
    ),
    "negative dim": (
        lambda: scale_matmul(w=raw_tensor("W", [-1, 4])),
        "initializer 'W' has a negative dimension: shape [-1, 4]",
    ),
    "unknown data type": (
        lambda: scale_matmul(w=raw_tensor("W", [8, 4], b"\0" * 128, data_type=99)),
        "initializer 'W' has no valid data type (99)",
    ),
    "short raw data": (
        lambda: scale_matmul(w=raw_tensor("W", [8, 4], b"\0" * 40)),
        "initializer 'W' has 40 bytes of data, its shape [8, 4] of FLOAT needs 128",
    ),
    "short typed data": (
        lambda: scale_matmul(w=short_typed()),
        "initializer 'W' has 3 values, its shape [8, 4] of FLOAT needs 32",
    ),
    "short Constant": (short_constant, "attribute 'value' of node 'c' (Constant) has 40 bytes of data"),
    "external length short": (
        lambda: scale_matmul(w=external("W", [8, 4], offset=0, length=40)),
        "'w.data' (initializer 'W'): length 40 bytes, its shape [8, 4] of FLOAT needs 128",
    ),
    "external file short": (
        lambda: scale_matmul(w=external("W", [8, 4])),
        "'w.data' (initializer 'W') is too short: 64 bytes, the model reads up to byte 128",
    ),
    "external 10^12": (
        lambda: scale_matmul(w=external("W", [10**6, 10**6])),
        "(initializer 'W') is too short: 64 bytes, the model reads up to byte 4000000000000",
    ),
    "cycle": (
        cyclic,
        "nodes form a cycle, each reading the next one's output: node 'A' (Add) -> node 'B' (Relu) -> node 'A' (Add)",
    ),
}


def save(proto, directory, name="in.onnx"):
    path = directory / name
    onnx.save(proto, path)
    (directory / "w.data").write_bytes(W_BYTES)
    return path


def assert_refused(cli, src, dst, message, *options, names_file=True):
    """`taperfold fold src -o dst [options]`: exit 2, exactly one line on stderr, nothing written."""
    result = cli("fold", src, "-o", dst, *options)
    assert result.exit_code == 2, result
    assert result.stderr.startswith("taperfold: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and (str(src) in result.stderr or not names_file), result.stderr
    assert result.stdout == ""
    assert not dst.exists() and not dst.with_name(dst.name + ".data").exists()


class TestMalformedOnnx:
    @pytest.mark.parametrize("case", list(CASES))
    def test_malformed_graph_is_one_line_and_writes_nothing(self, tmp_path, cli, case):
        build, message = CASES[case]
        src, dst = save(build(), tmp_path), tmp_path / "out.onnx"
        with pytest.raises(TaperfoldError) as info:
            fold_onnx_file(src, dst)
        assert message in str(info.value) and str(src) in str(info.value) and "\n" not in str(info.value)
        assert not dst.exists() and not dst.with_name(dst.name + ".data").exists()
        assert_refused(cli, src, dst, message)
        assert_refused(cli, src, dst, message, "--verify")

    def test_well_formed_graphs_pass_the_check_and_a_cycle_does_not(self, tmp_path, cli):
        src = save(if_model("m"), tmp_path, "if.onnx")  # a subgraph reading a value of the enclosing graph
        result = cli("fold", src, "-o", tmp_path / "if.folded.onnx", "--verify")
        assert result.exit_code == 0 and result.stderr == "", result
        proto = scale_matmul()
        proto.graph.node.reverse()  # MatMul before the Mul it reads: no cycle, only out of order
        src = save(proto, tmp_path, "unsorted.onnx")
        result = cli("fold", src, "-o", tmp_path / "unsorted.folded.onnx", "--verify")
        assert result.exit_code == 0 and "1 of 1 constant-scale norms folded" in " ".join(result.stdout.split())
        src = save(cyclic(), tmp_path, "cyclic.onnx")
        assert_refused(cli, src, tmp_path / "cyclic.folded.onnx", CASES["cycle"][1])

    def test_non_integer_external_offset_is_refused_by_fold_verify_and_the_runtime(self, tmp_path, cli):
        from taperfold.engines import ENGINES, open_runners

        const = node("Constant", [], ["W"], "c", value=external("W", [4, 4], length="abc"))
        cases = {
            "init.onnx": (
                scale_matmul(w=external("W", [4, 4], offset="abc", length=64)),
                "'w.data' (initializer 'W'): offset and length must be integers, got 'abc', '64'",
            ),
            "const.onnx": (
                model(
                    [node("Mul", ["x", "s"], ["h"], "mul"), const, node("MatMul", ["h", "W"], ["y"])],
                    [weight("s", 4)],
                    inputs=(("x", F32, [2, 4]),),
                ),
                "'w.data' (attribute 'value' of node 'c' (Constant)): offset and length must be "
                "integers, got None, 'abc'",
            ),
        }
        for name, (proto, message) in cases.items():
            src = save(proto, tmp_path, name)
            assert_refused(cli, src, tmp_path / "out.onnx", message)
            assert_refused(cli, src, tmp_path / "out.onnx", message, "--verify")
            with (
                pytest.raises(TaperfoldError, match="offset and length must be integers"),  # verify and bench
                open_runners({"m": ENGINES["ort"].runner(src, device="cpu")}),
            ):
                pass

    @pytest.mark.parametrize(
        "shapes, message",
        [
            ("input_ids:1x0", "--shapes: 'input_ids:1x0' has a 0 dimension"),
            ("input_ids:1x1000000000000", "--shapes: 'input_ids:1x1000000000000' is more than 2,147,483,648 (2^31)"),
            ("input_ids:65536x65536", "--shapes: 'input_ids:65536x65536' is more than 2,147,483,648 (2^31)"),
            ("input_ids:1x" + "9" * 5000, "is more than 2,147,483,648 (2^31) elements"),
            ("input_ids:1x4,input_ids:1x8", "--shapes: 'input_ids' is given twice"),
        ],
        ids=["0 dim", "10^12 dim", "2^32 elements", "5000 digits", "twice"],
    )
    def test_verify_shapes_that_cannot_be_generated_are_refused_before_any_work(self, tmp_path, cli, shapes, message):
        src = save(embedding(), tmp_path)
        assert_refused(cli, src, tmp_path / "out.onnx", message, "--verify", "--shapes", shapes, names_file=False)

    @pytest.mark.parametrize(
        "build, message",
        [
            (
                lambda: scale_matmul(inputs=(("x", F32, [10**12, 8]),)),
                "input 'x' would be 8,000,000,000,000 elements in the graph's static shape ([1000000000000, 8]), "
                "more than the 2,147,483,648 (2^31)",
            ),
            (
                lambda: scale_matmul(inputs=(("x", F32, [0, 8]),)),
                "input 'x' has a 0 dimension in the graph's static shape ([0, 8])",
            ),
            (lambda: embedding(rows=0, ids_shape=(1, 4)), "input 'input_ids' indexes a table of 0 rows"),
        ],
        ids=["10^12 static dim", "0 static dim", "0-row table"],
    )
    def test_verify_refuses_an_input_it_cannot_generate_before_allocating(self, tmp_path, cli, build, message):
        from taperfold.passes.check_fold import check_inputs

        src = save(build(), tmp_path)
        with pytest.raises(TaperfoldError) as info:  # what fold --verify calls before it writes anything
            check_inputs(src)
        assert message in str(info.value) and str(src) in str(info.value) and "\n" not in str(info.value)
        assert_refused(cli, src, tmp_path / "out.onnx", message, "--verify")

    def test_zero_size_weights_fold_and_an_empty_output_is_compared_by_shape(self, tmp_path, cli):
        # zero-size initializers are legitimate (empty axes, a Resize's roi, a projection to 0 columns): the fold
        # takes them; --verify has no values to compare on an empty output, only its shape
        src = save(scale_matmul(w=weight("W", 8, 0)), tmp_path)
        result = cli("fold", src, "-o", tmp_path / "out.onnx", "--verify", "--json")
        assert result.exit_code == 0 and result.stderr == "", result
        assert '"passed": true' in result.stdout

    def test_verify_failure_names_the_input_not_an_unfolded_model(self):
        from taperfold.passes.check_fold import FoldCheck, OutputCheck

        check = FoldCheck({"x": [2, 8]}, [OutputCheck("y", None, None, ["values differ"])])
        assert check.failure_message() == "input -> folded, output 'y': values differ"
