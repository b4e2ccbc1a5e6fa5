"""Fold a norm that reads a linear layer's output into that layer: the backward fold of post-norms.

A post-norm (Gemma 2/3, OLMo 2, GLM-4) reads a projection's output before the residual Add, so no linear
layer reads it and `FoldIntoReadersPass` keeps it. At g = 0 it is a map of the projection's output alone:
with row vectors z = x·W + b (W stored [d_in, n]) and s the norm's per-channel scale,
  scale only                 z·diag(s)                        -> W' = W·diag(s),  b' = b·s
  with centering (LN form)   (z - mean(z))·diag(s)            -> W' = W·(I - 11ᵀ/n)·diag(s),  b' = (b - mean(b))·s
  with a shift (beta)        ... + beta                       -> b' = ... + beta
All in float64 from the stored weights, cast once. Only when nothing but the norm reads the layer's output
(another reader would see the rewritten output): otherwise the norm is kept, and the report says who reads it.
In the pipeline it runs after the forward folds, which are preferred; it sees only what they kept.
"""

from __future__ import annotations

import dataclasses
from typing import TypeGuard

import numpy as np
import onnx_ir as ir

from taperfold.passes._graph import (
    NormMatch,
    const_array,
    derived_tensor,
    describe,
    folded_source,
    node_label,
    past_range,
    remove_if_dead,
    sole_use,
    write_const,
)
from taperfold.passes.constants import AfterConstantsPass
from taperfold.passes.detect import detect_norms, scopes
from taperfold.passes.readers import (
    Blocked,
    Effects,
    WeightView,
    new_bias_slot,
    weight_source,
    why_readers_cannot,
)
from taperfold.passes.report import NormStatus


@dataclasses.dataclass(eq=False)
class Producer(WeightView):
    """MatMul(x, W) or Gemm(x, W, [C]) with a constant W whose output the norm alone reads, maybe through an Add
    of a constant bias."""

    node: ir.Node
    root: ir.Value  # the constant behind W
    tensor: ir.TensorProtocol
    via: list[ir.Node]  # Identity/Transpose nodes between root and node
    transposed: bool  # W[d_in, n] = tensor.T
    reads_nd: bool  # Gemm with transB=1: the node takes W as [n, d_in]
    bias: tuple[ir.Node, int] | None  # where the constant bias is read: (Add, i) or (Gemm, 2)


def _linear(node: ir.Node | None) -> TypeGuard[ir.Node]:
    return node is not None and node.domain == "" and node.op_type in ("MatMul", "Gemm")


def _layer_and_bias(value: ir.Value) -> tuple[ir.Node, tuple[ir.Node, int] | None] | None:
    """The linear layer computing `value`, directly or through an Add of a constant (its bias); None if none."""
    node = value.producer()
    if _linear(node):
        return node, None
    if node is None or node.domain != "" or node.op_type != "Add" or len(node.inputs) != 2:
        return None
    for i, other in enumerate(node.inputs):
        layer = other.producer() if other is not None else None
        if _linear(layer) and layer.op_type == "MatMul" and const_array(node.inputs[1 - i]) is not None:
            return layer, (node, 1 - i)
    return None


def producer_of(match: NormMatch) -> Producer | None:
    """The linear layer that computes the norm's input; None when none does (an embedding lookup, a reshape,
    attention), Blocked when there is one that cannot take the fold."""
    found = _layer_and_bias(match.input)
    if found is None:
        return None
    node, bias = found
    if others := [u.node for u in match.input.uses() if u.node not in match.nodes]:
        raise Blocked(f"{describe(node)}'s output is also read by {describe(others[0])}")
    if match.input.is_graph_output():
        raise Blocked(f"{describe(node)}'s output is a graph output")
    inner = [v for step in match.nodes for v in step.outputs if v is not match.output]
    if shared := [u.node for v in inner for u in v.uses() if u.node not in match.nodes]:
        raise Blocked(f"its centering is shared with {describe(shared[0])}")
    if bias is not None and (sole_use(node.outputs[0]) or (None,))[0] is not bias[0]:
        raise Blocked(f"{describe(node)}'s output is also read before its bias is added")
    if node.op_type == "Gemm":
        if node.attributes.get_int("transA", 0) != 0:
            raise Blocked(f"{describe(node)} has transA=1")
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            if const_array(node.inputs[2]) is None:
                raise Blocked(f"{describe(node)}'s bias is not a constant")
            if node.attributes.get_float("beta", 1.0) == 0:
                raise Blocked(f"{describe(node)} has beta=0")
            bias = (node, 2)
    source = weight_source(node.inputs[1])
    if source is None:
        raise Blocked(f"{describe(node)}'s weight is not a constant")
    root, tensor, via, transposed = source
    reads_nd = node.op_type == "Gemm" and node.attributes.get_int("transB", 0) != 0
    producer = Producer(node, root, tensor, via, transposed ^ reads_nd, reads_nd, bias)
    n = producer.shape[1]
    if n != match.width:
        raise Blocked(f"{describe(node)} has {n} output channels for {match.width}")
    if bias is not None:
        b = const_array(bias[0].inputs[bias[1]])
        if b is None:
            raise Blocked(f"{describe(bias[0])} adds a bias that is not a constant")
        if (
            b.size not in (1, n)
            or any(dim != 1 for dim in b.shape[:-1])
            or (bias[0] is not node and b.ndim > 1 and (match.input.shape is None or b.ndim > len(match.input.shape)))
        ):
            raise Blocked(f"{describe(bias[0])} adds a bias of shape {list(b.shape)}, not one per channel")
    why = past_range(lambda: folded_producer_weight(producer, match), producer.tensor.dtype)
    if not why and writes_bias(producer, match):
        why = past_range(lambda: folded_producer_bias(producer, match), producer_bias_dtype(producer), "bias")
    if why:
        raise Blocked(f"{describe(node)}: {why}")
    return producer


def folded_producer_weight(producer: Producer, match: NormMatch) -> np.ndarray:
    """W·diag(scale) (centered: W·(I - 11ᵀ/n) first) as a new float64 [inputs, outputs] array."""
    w = producer.weight()
    if match.centered:  # (I - 11ᵀ/n) on the right: subtract each row's mean over the n output channels
        w -= w.mean(axis=1, keepdims=True)
    w *= match.scale
    return w


def folded_producer_bias(producer: Producer, match: NormMatch) -> np.ndarray:
    """The producer's bias once the norm moved in (where `writes_bias`), (b, centered: minus its mean)·diag(scale) + β,
    as float64 in its own bias's shape (none: [n])."""
    n, node, at = producer.shape[1], producer.node, producer.bias
    old = _old_bias(producer)
    b = np.zeros(n) if old is None else np.broadcast_to(old.astype(np.float64).reshape(-1), (n,)).copy()
    gemm_beta = node.attributes.get_float("beta", 1.0) if at is not None and at[0] is node else 1.0  # adds beta·C
    if match.centered:
        b -= b.mean()
    b *= match.scale
    if match.bias is not None:
        b += match.bias / gemm_beta
    return b if old is None else b.reshape(*old.shape[:-1], n)


def writes_bias(producer: Producer, match: NormMatch) -> bool:
    """Whether the fold writes the producer a bias: it has one, or the norm centers or shifts."""
    return producer.bias is not None or match.centered or match.bias is not None


def producer_bias_dtype(producer: Producer) -> ir.DataType:
    """The dtype of the bias the fold writes: the producer's own bias's, else its weight's."""
    old = _old_bias(producer)
    return producer.tensor.dtype if old is None else ir.DataType.from_numpy(old.dtype)


def _old_bias(producer: Producer) -> np.ndarray | None:
    return None if producer.bias is None else const_array(producer.bias[0].inputs[producer.bias[1]])


def move_into_producer(graph: ir.Graph, match: NormMatch, producer: Producer) -> tuple[Effects, ir.Value]:
    """Rewrite the producer's weight columns and bias to compute the norm's output; return what was written and the
    value that now holds the norm's output before any Cast of the chain: the norm's input, or a new bias Add's output
    (the match's nodes are left for the caller to remove once nothing reads them)."""
    effects, node, output = Effects(), producer.node, match.input

    def compute() -> np.ndarray:
        w = folded_producer_weight(producer, match)
        return w.T if producer.reads_nd else w

    d_in, n = producer.shape
    tensor = derived_tensor(compute, producer.tensor.dtype, (n, d_in) if producer.reads_nd else (d_in, n))
    path = [producer.root, *(v.outputs[0] for v in producer.via)]
    others = [u.node for v in path for u in v.uses() if u.node is not node and u.node not in producer.via]
    new = write_const(graph, node, 1, tensor, base=producer.root.name or node_label(node))
    if others:
        effects.copied.append(f"{producer.root.name} -> {new.name} (also read by {describe(others[0])})")
    effects.bytes_rewritten += tensor.nbytes

    if writes_bias(producer, match):
        bias_tensor = ir.tensor(folded_producer_bias(producer, match).astype(producer_bias_dtype(producer).numpy()))
        at, index = producer.bias or new_bias_slot(graph, node)
        output = at.outputs[0] if producer.bias is None else output
        current = at.inputs[index] if producer.bias is not None else None
        base = current.name if current is not None else None
        write_const(graph, at, index, bias_tensor, base=base or f"{node.name}.bias")
        effects.bytes_rewritten += bias_tensor.nbytes
    return effects, output


class FoldIntoProducerPass(AfterConstantsPass):
    """For every candidate norm still in the graph whose input a linear layer alone produces, rewrite that layer.

    Requires: constants folded (FoldConstantsPass). Ensures: nothing reads a folded norm's output; its readers
    read the producer's output, the producer's weight and bias rewritten.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for candidate in detect_norms(model).candidates:
            match = candidate.match
            if match.output.is_graph_output():
                continue  # the forward fold's reason stands: the graph's output must stay what it is
            try:
                producer = producer_of(match)
            except Blocked as why:
                note = f"; {candidate.note}" if candidate.note else ""
                self.report.entry(
                    candidate.name, candidate.kind
                ).reason = f"{why_readers_cannot(match)}; not into its producer: {why}{note}"
                continue
            if producer is None:
                continue
            entry = self.report.entry(candidate.name, candidate.kind)
            effects, output = move_into_producer(model.graph, match, producer)
            match.output.replace_all_uses_with(folded_source(dataclasses.replace(match, input=output)))
            remove_if_dead(model.graph, match.nodes)
            self.rewritten.append((candidate.name, match.output))
            entry.status, entry.into = NormStatus.FOLDED, "producer"
            module = scopes(producer.node)[-1][0] if scopes(producer.node) else ""
            entry.reason = f"folded into its producer {describe(producer.node)}" + (f" ({module})" if module else "")
            entry.reason += f"; {candidate.note}" if candidate.note else ""
            entry.bytes_rewritten += effects.bytes_rewritten
            entry.copied += effects.copied
            modified = True
        return ir.passes.PassResult(model, modified)
