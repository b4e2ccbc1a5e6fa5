"""Hand-built ONNX graphs for the pass tests, and running them in ONNX Runtime."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

D, N, V = 8, 6, 11
F32, F16, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64
rng = np.random.default_rng(0)
X = ("x", F32, [2, 3, D])


def rand(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def n(op, ins, outs, name=None, domain="", **attrs):
    """A node spec: (name, op, inputs, outputs, domain, attributes)."""
    return (name or outs[0], op, ins, outs, domain, attrs)


def build(nodes, inputs, outputs, inits, opset=18) -> ir.Model:
    """A hand-built model; inputs/outputs are (name, elem_type, shape). IR version 10: ORT refuses 14."""
    graph = helper.make_graph(
        [
            helper.make_node(op, ins, outs, name=name, domain=domain, **attrs)
            for name, op, ins, outs, domain, attrs in nodes
        ],
        "g",
        [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info(*o) for o in outputs],
        [numpy_helper.from_array(np.asarray(array), name) for name, array in inits.items()],
    )
    opsets = [helper.make_opsetid("", opset)]
    if any(domain == "com.microsoft" for *_, domain, _ in nodes):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    proto = helper.make_model(graph, ir_version=10, opset_imports=opsets)
    return ir.serde.deserialize_model(proto)


def run(model: ir.Model | str, feeds: dict) -> list[np.ndarray]:
    source = model if isinstance(model, str) else ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feeds)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(a).max())


def ops(model: ir.Model) -> Counter:
    return Counter(node.op_type for node in model.graph)


def x3():
    return {"x": rand(2, 3, D)}


def serialized(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


def mul_matmul(scale: np.ndarray, cols: int = N) -> ir.Model:
    """The smallest candidate: y = Mul(x, s) · W."""
    nodes = [n("Mul", ["x", "s"], ["h"]), n("MatMul", ["h", "W"], ["y"])]
    return build(nodes, [X], [("y", F32, [2, 3, cols])], {"s": scale, "W": rand(D, cols)})


def rms_real(gain: bool = True) -> list:
    """An ordinary RMSNorm as the legacy exporter writes a hand-written one: x / sqrt(mean(x²) + ε) · γ."""
    return [
        n("Pow", ["x", "two"], ["sq"]),
        n("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        n("Add", ["ms", "eps"], ["mse"]),
        n("Sqrt", ["mse"], ["rms"]),
        n("Div", ["one", "rms"], ["inv"]),
        n("Mul", ["x", "inv"], ["xn"]),
        *([n("Mul", ["g", "xn"], ["h"])] if gain else [n("Identity", ["xn"], ["h"])]),
    ]


RMS_CONSTS = {
    "two": np.array(2.0, np.float32),
    "axes": np.array([-1]),
    "eps": np.array(1e-6, np.float32),
    "one": np.array(1.0, np.float32),
}


def real_rms_model():
    """A real RMSNorm read by two projections."""
    return build(
        [*rms_real(), n("MatMul", ["h", "Wq"], ["q"]), n("MatMul", ["h", "Wk"], ["k"]), n("Add", ["q", "k"], ["y"])],
        [X],
        [("y", F32, [2, 3, N])],
        {**RMS_CONSTS, "g": rand(D), "Wq": rand(D, N), "Wk": rand(D, N)},
    )
