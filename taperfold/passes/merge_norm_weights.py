"""Opt-in: merge a real norm's gain (γ, and β) into the layers that read it. The norm itself stays.

This is what QuaRot, SpinQuant and llm-compressor do to ordinary norms: x̂·diag(γ)·W + β·W becomes
x̂·W' + b' with the normalization x̂ untouched. It changes the model's weights but removes no norm, so
it is reported as "weights_merged", never as a fold, and runs only when asked (`--merge-norm-weights`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from taperfold.norms import norm_kind
from taperfold.passes._graph import const_array, node_label, remove_if_dead, write_const
from taperfold.passes.constants import AfterConstantsPass
from taperfold.passes.detect import detect_norms
from taperfold.passes.readers import Blocked, move_into_readers, readers_of
from taperfold.passes.report import NormStatus


def _neutral_gain(graph: ir.Graph, node: ir.Node, kind: str) -> None:
    """The fused norm `node` of `kind` keeps computing x̂: its scale becomes ones and its bias zeros (copies if
    shared)."""
    scale_at, bias_at = norm_kind(kind).fused_ops[node.op_type]
    for index, value in ((scale_at, 1.0), (bias_at, 0.0)):
        current = node.inputs[index] if index is not None and index < len(node.inputs) else None
        old = const_array(current)  # a constant vector: detect took it for the gain
        if index is not None and current is not None and old is not None:
            neutral = ir.tensor(np.full(old.shape, value, old.dtype))
            write_const(graph, node, index, neutral, base=current.name or node_label(node))


class MergeNormWeightsPass(AfterConstantsPass):
    """For every real norm with a constant gain whose readers all take it, move the gain into the readers.

    Requires: constants folded. Ensures: nothing reads a merged gain chain's output (a fused norm keeps its
    output, with a neutral scale and bias); the normalization stays.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for norm in detect_norms(model).real_norms:
            entry = self.report.entry(norm.name, norm.kind, NormStatus.REAL_NORM)
            if norm.gain is None:
                entry.reason = f"real norm ({norm.form}) with no constant gain to merge; left as is"
                continue
            try:
                readers = readers_of(norm.gain.output, norm.gain)
            except Blocked as why:
                entry.reason = f"real norm ({norm.form}); gain not merged: {why}"
                continue
            entry.consumers = [node_label(use.node) for use in norm.gain.output.uses()]
            effects = move_into_readers(model.graph, norm.gain, readers)
            if norm.fused is not None:
                _neutral_gain(model.graph, norm.fused, norm.kind)
            remove_if_dead(model.graph, norm.gain.nodes)
            if norm.fused is None:  # a fused norm's output stays read, its gain now neutral
                self.rewritten.append((norm.name, norm.gain.output))
            entry.status, entry.into = NormStatus.WEIGHTS_MERGED, "consumers"
            entry.reason = f"real norm ({norm.form}) kept; its gain moved into {len(readers)} reader(s)"
            entry.bytes_rewritten += effects.bytes_rewritten
            entry.copied += effects.copied
            modified = True
        return ir.passes.PassResult(model, modified)
