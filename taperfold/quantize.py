"""Weight-only quantization after the fold: each MatMul whose weight is a constant becomes ONNX Runtime's
MatMulNBits (int4 or int8 blocks), made by ONNX Runtime's own quantizer (MatMulNBitsQuantizer, round to nearest).

The settings are onnxruntime-genai's builder's on the CPU (its `-p int4` / `-p int8`): blocks of 32 along the input
axis, symmetric (no zero points), accuracy level 4 (the activations quantized to int8 for the product), so that a
folded graph and the builder's own form of the untapered model are quantized alike. A MatMul whose weight is not a
constant (attention's, or a head tied to the embedding, which reads it through a Transpose) keeps its float weight.

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

    from taperfold.passes.onnx_io import save_model

    model = onnx.load(str(source))
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
