"""ONNX Runtime's own LLM fusions, as one pass: onnxscript's `optimize_for_ort` (onnxscript.rewriter.ort_fusions),
run on a graph after the fold (which works on standard ops).

It rewrites what it recognises into ONNX Runtime's contrib ops (domain com.microsoft): attention as
MultiHeadAttention or GroupQueryAttention, a residual Add and the RMSNorm after it as
SkipSimplifiedLayerNormalization, RoPE as RotaryEmbedding, GELU. TensorRT's parser takes none of them, so export
runs it for the ONNX Runtime target only. What it fused is read from the graph, not from the rules' counts: a rule
that matched can be undone by a later one that did not (onnxscript inlines what no fusion consumed).

At opset 23 the exporter writes ONNX's own Attention, RMSNormalization and RotaryEmbedding, which ONNX Runtime runs
as fused kernels and onnxscript's rules do not take: the pass leaves such a graph as it is.
"""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from taperfold.opsets import FUSING_OPSET

CONTRIB_DOMAIN = "com.microsoft"


def contrib_ops(model: ir.Model) -> Counter:
    """ONNX Runtime's contrib ops in the main graph, by type."""
    return Counter(node.op_type for node in model.graph if node.domain == CONTRIB_DOMAIN)


class OrtFusionsPass(ir.passes.InPlacePass):
    """onnxscript's ONNX Runtime fusions on a graph below opset 23. `self.fused`: the contrib ops the last call
    added, by type (empty: nothing matched, or an opset-23 graph)."""

    def __init__(self):
        super().__init__()
        self.fused: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused = {}
        if model.opset_imports.get("", 0) >= FUSING_OPSET:
            return ir.passes.PassResult(model, modified=False)
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        before = contrib_ops(model)
        optimize_for_ort(model)  # in place
        after = contrib_ops(model)
        self.fused = {op: n - before[op] for op, n in sorted(after.items()) if n > before[op]}
        return ir.passes.PassResult(model, modified=True)
