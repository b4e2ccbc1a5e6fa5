"""Weight-only quantization after the fold: each MatMul whose weight is a constant becomes ONNX Runtime's
MatMulNBits (int4 or int8 blocks), made by ONNX Runtime's own quantizer (MatMulNBitsQuantizer, round to nearest).

The settings are onnxruntime-genai's builder's on the CPU (its `-p int4` / `-p int8`): blocks of 32 along the input
axis, symmetric (no zero points), accuracy level 4 (the activations quantized to int8 for the product), so that a
folded graph and the builder's own form of the untapered model are quantized alike. A MatMul whose weight is not a
constant (attention's, or a head tied to the embedding, which reads it through a Transpose) keeps its float weight.
A Gemm with a constant weight (GPT-2's Conv1D layers trace to one) is quantized as the MatMul and Add it computes:
the quantizer takes MatMuls only.

The fold leaves c·γ̃ in the rows of the weights it folded into; a block shares one scale along the input axis, so a
row's gain that differs from its neighbours' can widen its block's range. verify measures whether that costs
anything (each quantized graph against the fp32 checkpoint, folded and unfolded alike: docs/deployment.md).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from taperfold.errors import TaperfoldError

BITS = {"int4": 4, "int8": 8}  # the quantized precisions, as manifest.json's `precision` and --quantize name them
BLOCK_SIZES = (16, 32, 64, 128, 256)  # what MatMulNBits and the builder accept
DEFAULT_BLOCK_SIZE = 32
CPU_ACCURACY_LEVEL = 4  # int8 activations: the builder's default on the CPU


@dataclass(frozen=True)
class Quantization:
    precision: str  # int4 | int8
    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = True
    accuracy_level: int = CPU_ACCURACY_LEVEL

    def __post_init__(self) -> None:
        if self.precision not in BITS:
            raise TaperfoldError(f"--quantize takes {' or '.join(BITS)}, got {self.precision!r}")
        if self.block_size not in BLOCK_SIZES:
            raise TaperfoldError(
                f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size}"
            )

    @property
    def bits(self) -> int:
        return BITS[self.precision]

    def to_json(self) -> dict:
        return {**asdict(self), "bits": self.bits, "method": "rtn", "tool": "onnxruntime MatMulNBitsQuantizer"}

    def builder_options(self) -> list[str]:
        """The same settings as onnxruntime-genai's builder's --extra_options."""
        return [
            f"block_size={self.block_size}",
            f"accuracy_level={self.accuracy_level}",
            f"is_symmetric={str(self.symmetric).lower()}",
        ]


def parse_precisions(text: str) -> tuple[str, ...]:
    """--quantize's comma-separated precisions (int4, int8), each once; one line naming what is wrong."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BITS]
    if not names or unknown:
        raise TaperfoldError(f"--quantize takes {' or '.join(BITS)} (or both, comma-separated), got {text!r}")
    return tuple(dict.fromkeys(names))


def quantize_graph(source: Path, dest: Path, quantization: Quantization) -> dict:
    """Write `source` with its constant-weight MatMuls as MatMulNBits to `dest` (weights in dest + '.data', both
    renamed into place once complete); what was quantized."""
    import onnx
    import onnx_ir as ir
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from taperfold.onnx_io import save_model

    model = onnx.load(str(source))
    _gemms_as_matmuls(model)
    matmuls = sum(node.op_type == "MatMul" for node in model.graph.node)
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=quantization.bits,
        block_size=quantization.block_size,
        is_symmetric=quantization.symmetric,
        accuracy_level=quantization.accuracy_level,
    )
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # it logs every node it looks at
    try:
        quantizer.process()
    finally:
        logger.setLevel(level)
    quantized = quantizer.model.model
    done = sum(node.op_type == "MatMulNBits" for node in quantized.graph.node)
    if not done:
        raise TaperfoldError(f"{source}: no MatMul with a constant weight to quantize")
    save_model(ir.serde.deserialize_model(quantized), dest)
    return {**quantization.to_json(), "matmuls_quantized": done, "matmuls_kept": matmuls - done}


def _gemms_as_matmuls(model) -> None:
    """Each Gemm of `model` (an onnx.ModelProto, changed in place) whose B is an initializer and whose A is not
    transposed as the MatMul and Add it computes, so that the quantizer sees its weight (B transposed once where
    transB; C scaled by beta where beta is not 1)."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    nodes: list = []
    replaced: set[str] = set()
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weight = initializers.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) > 1 else None
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        if weight is None or attrs.get("transA", 0) or (bias is not None and bias not in initializers):
            nodes.append(node)
            continue
        name = node.name or node.output[0]
        replaced.update(name for name in node.input[1:] if name)
        b = numpy_helper.to_array(weight) * np.asarray(attrs.get("alpha", 1.0), dtype=np.float64)
        if attrs.get("transB", 0):
            b = b.T
        b_name = f"{weight.name}/as_matmul"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(b).astype(_dtype(weight)), b_name))
        if bias is None:
            nodes.append(helper.make_node("MatMul", [node.input[0], b_name], list(node.output), name=name))
            continue
        c = numpy_helper.to_array(initializers[bias]).astype(np.float64) * attrs.get("beta", 1.0)
        c_name = f"{bias}/as_add"
        graph.initializer.append(numpy_helper.from_array(c.astype(_dtype(initializers[bias])), c_name))
        product = f"{node.output[0]}/matmul"
        nodes.append(helper.make_node("MatMul", [node.input[0], b_name], [product], name=f"{name}/MatMul"))
        nodes.append(helper.make_node("Add", [product, c_name], list(node.output), name=f"{name}/Add"))
    del graph.node[:]
    graph.node.extend(nodes)
    # the replaced weights and biases, unless something else reads them (a subgraph's node, a graph output)
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    if any(attr.g.node or attr.graphs for node in graph.node for attr in node.attribute):
        return  # a subgraph may read them too
    kept = [i for i in graph.initializer if i.name in read or i.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _dtype(initializer):
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(initializer.data_type)
