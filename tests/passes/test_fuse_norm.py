"""passes/fuse_norm.py alone: decomposed RMSNorm → one fused node (and back), on hand-built and exported graphs,
numerics against the decomposed graph in ONNX Runtime."""

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from taperfold.passes.fuse_norm import (
    ExpandRMSNormalizationPass,
    FuseRMSNormPass,
    expand_rms_norms,
    fuse_rms_norms,
    match_rms_norm,
)

D = 8
RNG = np.random.default_rng(0)
WEIGHT = (1 + 0.2 * RNG.standard_normal(D)).astype(np.float32)  # never ones: a multiply by one can vanish


def rms_graph(
    dtype=TensorProto.FLOAT,
    *,
    inverse="Reciprocal",
    weight="after",
    axes=(-1,),
    exponent=2.0,
    opset=20,
    extra_reader=False,
) -> onnx.ModelProto:
    """x → [Cast f32] → Pow → ReduceMean → Add(eps) → Sqrt → inverse → Mul(x) → weight → y (then MatMul).

    weight: "after" (Mul(w32) → Cast back: nn.RMSNorm in fp16), "hf" (Cast back → Mul(w): Hugging Face),
    "none" (no weight). extra_reader: the ReduceMean's result is also a graph output (must block the fusion).
    """
    half = dtype != TensorProto.FLOAT
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [
        numpy_helper.from_array(np.array(exponent, np.float32), "two"),
        numpy_helper.from_array(np.array(axes, np.int64), "axes"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(RNG.standard_normal((D, 4)).astype(npdt), "proj"),
    ]
    nodes, xs = [], "x"
    if half:
        nodes.append(helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT))
        xs = "x32"
    nodes += [
        helper.make_node("Pow", [xs, "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
    ]
    nodes.append(
        helper.make_node("Reciprocal", ["rms"], ["inv"])
        if inverse == "Reciprocal"
        else helper.make_node("Div", ["one", "rms"], ["inv"])
    )
    nodes.append(helper.make_node("Mul", [xs, "inv"], ["normed"]))
    out = "normed"
    if weight == "after":
        inits.append(numpy_helper.from_array(WEIGHT, "w"))
        nodes.append(helper.make_node("Mul", [out, "w"], ["weighted"]))
        out = "weighted"
    if half:
        nodes.append(helper.make_node("Cast", [out], ["back"], to=dtype))
        out = "back"
    if weight == "hf":
        inits.append(numpy_helper.from_array(WEIGHT.astype(npdt), "w"))
        nodes.append(helper.make_node("Mul", ["w", out], ["weighted"]))  # constant first, as HF exports
        out = "weighted"
    nodes.append(helper.make_node("MatMul", [out, "proj"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", dtype, ["b", "s", 4])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("ms", TensorProto.FLOAT, ["b", "s", 1]))
    graph = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", dtype, ["b", "s", D])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def run(model: onnx.ModelProto | ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": x})[0]


def ops(model: ir.Model) -> Counter:
    return Counter(node.op_type for node in model.graph)


X = RNG.standard_normal((3, 5, D)).astype(np.float32)


@pytest.mark.parametrize("inverse", ["Reciprocal", "Div"])
@pytest.mark.parametrize("weight", ["after", "none"])
def test_fp32_pattern_becomes_one_node(inverse, weight):
    proto = rms_graph(inverse=inverse, weight=weight)
    model = ir.serde.deserialize_model(proto)
    assert fuse_rms_norms(model) == 1
    assert ops(model) == Counter({"SimplifiedLayerNormalization": 1, "MatMul": 1})
    node = next(n for n in model.graph if n.op_type == "SimplifiedLayerNormalization")
    assert node.domain == ""  # ONNX Runtime registers it in ai.onnx, not com.microsoft
    assert node.attributes.get_float("epsilon") == pytest.approx(1e-6)
    assert node.attributes.get_int("axis") == -1
    np.testing.assert_allclose(run(model, X), run(proto, X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weight", ["after", "hf"])
def test_fp16_chain_with_casts_fuses_on_the_fp16_input(weight):
    proto = rms_graph(TensorProto.FLOAT16, weight=weight)
    model = ir.serde.deserialize_model(proto)
    assert fuse_rms_norms(model) == 1
    assert ops(model) == Counter({"SimplifiedLayerNormalization": 1, "MatMul": 1})  # both Casts gone
    node = next(n for n in model.graph if n.op_type == "SimplifiedLayerNormalization")
    assert node.inputs[0].name == "x" and node.inputs[1].dtype == ir.DataType.FLOAT16
    assert node.attributes.get_int("stash_type") == 1  # statistics in float32, as the Casts did
    x = X.astype(np.float16)
    np.testing.assert_allclose(run(model, x).astype(np.float32), run(proto, x).astype(np.float32), rtol=2e-2, atol=2e-3)


def test_opset_23_fuses_into_onnx_rmsnormalization_and_expands_back():
    proto = rms_graph(opset=23)
    model = ir.serde.deserialize_model(proto)
    assert fuse_rms_norms(model) == 1
    assert ops(model) == Counter({"RMSNormalization": 1, "MatMul": 1})
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)  # a standard op at 23
    fused = run(model, X)
    assert expand_rms_norms(model) == 1
    assert ops(model)["RMSNormalization"] == 0 and ops(model)["Reciprocal"] == 1
    np.testing.assert_allclose(run(model, X), fused, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused, run(proto, X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change", [dict(axes=(1,)), dict(exponent=3.0), dict(extra_reader=True)])
def test_not_an_rms_norm_is_left_alone(change):
    """A mean over another axis, another power, or an intermediate someone else reads: no fusion."""
    model = ir.serde.deserialize_model(rms_graph(**change))
    before = ops(model)
    result = FuseRMSNormPass()(model)
    assert not result.modified and ops(model) == before


def test_expand_leaves_a_model_without_rmsnormalization_unchanged():
    model = ir.serde.deserialize_model(rms_graph())
    before = ir.serde.serialize_model(model).SerializeToString()
    assert not ExpandRMSNormalizationPass()(model).modified
    assert ir.serde.serialize_model(model).SerializeToString() == before


# ---- on graphs the torch exporter wrote ---------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_baseline():
    """A 2-layer llama with plain RMSNorm, exported at opset 20: the decomposed Reciprocal form."""
    import torch

    from taperfold.export import ExportOptions
    from taperfold.models import baseline_of, random_gate0_model
    from taperfold.tracing import export_to_ir

    model = baseline_of(random_gate0_model("tiny", "llama", n_layers=2, max_seq_len=32))
    with torch.no_grad():  # random norm weights, so a fused op that dropped them would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return ir.serde.serialize_model(export_to_ir(model, ExportOptions(opset=20)))


FUSED_RMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization")


def test_exported_graph_fuses_every_norm_and_ort_keeps_one_node_each(exported_baseline, tmp_path):
    model = ir.serde.deserialize_model(exported_baseline)
    norms = 2 * 2 + 1
    assert sum(1 for n in model.graph if match_rms_norm(n) is not None) == norms
    assert fuse_rms_norms(model) == norms
    assert not any(match_rms_norm(n) for n in model.graph)
    assert ops(model)["SimplifiedLayerNormalization"] == norms

    ids = np.random.default_rng(1).integers(0, 256, (3, 19)).astype(np.int64)
    fused_proto = ir.serde.serialize_model(model)
    results = {}
    for name, proto in (("decomposed", exported_baseline), ("fused", fused_proto)):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.optimized_model_filepath = str(tmp_path / f"{name}.optimized.onnx")
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results[name] = session.run(["logits"], {"input_ids": ids})[0]
        optimized = Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)
        results[name + " ops"] = optimized
    # whatever ONNX Runtime's own optimizer does with the decomposed form, the fused graph runs one norm node per norm
    assert sum(results["fused ops"][op] for op in FUSED_RMS) == norms
    ref = results["decomposed"]
    assert np.abs(results["fused"] - ref).max() / np.abs(ref).max() <= 1e-5
