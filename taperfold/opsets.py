"""Which ONNX opset `taperfold export` writes, per graph and per target: one table, each value with the
measurement or the parser fact behind it (docs/opsets.md has the numbers and how they were taken).

Graphs: "prefill" (baseline / unfolded / folded .onnx: the whole prompt, last-token logits) and
"decoder" (*.decoder.onnx: KV-cached steps). Targets: "ort" (ONNX Runtime) and "trt" (TensorRT's ONNX
parser). `--opset N` overrides the table for every graph; the manifest records, per artifact, the
opset used and whether it came from the table or the override.

Only at opset 23 are RMSNorm fused into `RMSNormalization` and SDPA into `Attention` (onnxscript's fusions, which
taperfold's trace runs without the RoPE one: taperfold.tracing). `--ort-fusions` takes opset 20 from the table:
ONNX Runtime's own fusions match the plain ops written below 23.
What each target does with the graphs:
- ort: below 23 taperfold fuses RMSNorm itself (ONNX Runtime's SimplifiedLayerNormalization,
  taperfold.passes.fuse_norm), so every opset gets a one-kernel norm; the opset then decides attention.
- trt: no ONNX Runtime op may appear. The parser takes `Attention` from TensorRT 10.14 (4-D Q/K/V, no
  past_key/past_value inputs, no present outputs) and `RMSNormalization` / `RotaryEmbedding` from 10.15.
"""

from __future__ import annotations

from dataclasses import dataclass

from taperfold.errors import TaperfoldError

TARGETS = ("ort", "trt")
GRAPHS = ("prefill", "decoder")
MIN_OPSET, MAX_OPSET = 18, 23  # the torch exporter's base opset is 18; 23 is the newest it writes
# The opset of ONNX's RMSNormalization, and the only one at which the exporter fuses RMSNorm, RoPE and attention
FUSING_OPSET = 23
TRT_MIN_VERSION = (10, 15)  # what the "trt" rows assume: RMSNormalization and Attention in the parser


@dataclass(frozen=True)
class OpsetChoice:
    opset: int
    source: str  # "table" | "override"
    reason: str

    def to_dict(self) -> dict:
        return {"opset": self.opset, "opset_source": self.source, "opset_reason": self.reason}


# (target, graph) -> (opset, why). Every reason names its section of docs/opsets.md.
TABLE: dict[tuple[str, str], tuple[int, str]] = {
    ("ort", "prefill"): (
        23,
        "docs/opsets.md#ort-prefill: H100 ORT 1.31.1 CUDA fp16, fused baseline 1.2-1.6x faster "
        "at opset 23 than at 20 (RMSNormalization + Attention; docs/opsets/gpu-h100-fp16.json)",
    ),
    ("ort", "decoder"): (
        23,
        "docs/opsets.md#ort-decoder: H100 ORT 1.31.1 CUDA fp16 KV-cached decode, every decoder "
        "1.09-1.20x faster at opset 23 than at 20 (docs/opsets/gpu-h100-fp16.json)",
    ),
    ("trt", "prefill"): (
        23,
        "docs/opsets.md#trt: TensorRT >= 10.15 parses RMSNormalization, and Attention without past KV (>= 10.14)",
    ),
    ("trt", "decoder"): (
        20,
        "docs/opsets.md#trt: TensorRT's parser takes no Attention with past KV; at opset 20 "
        "attention stays plain MatMul/Softmax",
    ),
}


ORT_FUSIONS_OPSET = 20
ORT_FUSIONS_REASON = (
    "docs/opsets.md#ort-fusions: --ort-fusions: ONNX Runtime's fusions take attention and RMSNorm as the plain ops "
    "written below opset 23"
)


def choose_opset(target: str, graph: str, override: int | None = None, ort_fusions: bool = False) -> OpsetChoice:
    """The opset for `graph` ("prefill" | "decoder") exported for `target` ("ort" | "trt"), and for ONNX Runtime's
    fusions where `ort_fusions`."""
    if target not in TARGETS:
        raise TaperfoldError(f"--target must be one of {', '.join(TARGETS)}, got {target!r}")
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}")
    if override is not None:
        if not MIN_OPSET <= override <= MAX_OPSET:
            raise TaperfoldError(f"--opset must be between {MIN_OPSET} and {MAX_OPSET}, got {override}")
        return OpsetChoice(override, "override", f"--opset {override}")
    if ort_fusions and runs_contrib_ops(target):
        return OpsetChoice(ORT_FUSIONS_OPSET, "table", ORT_FUSIONS_REASON)
    opset, reason = TABLE[(target, graph)]
    return OpsetChoice(opset, "table", reason)


def runs_contrib_ops(target: str) -> bool:
    """Whether the target runs ONNX Runtime's own ops (SimplifiedLayerNormalization, the com.microsoft domain):
    ONNX Runtime does, TensorRT's parser does not."""
    return target == "ort"


def fuses_norms(target: str) -> bool:
    """Whether taperfold fuses decomposed RMSNorm into ONNX Runtime's op for this target (not TensorRT's)."""
    return runs_contrib_ops(target)
