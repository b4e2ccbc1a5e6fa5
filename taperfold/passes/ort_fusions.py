"""ONNX Runtime's own LLM fusions, as one pass: onnxscript's `optimize_for_ort` (onnxscript.rewriter.ort_fusions),
run on a graph after the fold (which works on standard ops).

It rewrites what it recognises into ONNX Runtime's contrib ops (domain com.microsoft): attention as
MultiHeadAttention or GroupQueryAttention, a residual Add and the RMSNorm after it as
SkipSimplifiedLayerNormalization, RoPE as RotaryEmbedding, GELU. TensorRT's parser takes none of them, so export
runs it for the ONNX Runtime target only. What it fused is read from the graph, not from the rules' counts: a rule
that matched can be undone by a later one that did not (onnxscript inlines what no fusion consumed).

onnxscript's GroupQueryAttention rule matches only genai's layout (a mask built from a model input named
attention_mask, the rotary of transformers 4), so on taperfold's graphs its fusions end at MultiHeadAttention over
K/V repeated to every query head (Unsqueeze, Expand, Reshape). One rule of taperfold's own goes on from there
(`MhaToGqa`): such an attention under a plain causal mask becomes GroupQueryAttention, which reads the KV heads as
they are and writes the cache (present.*) itself. ONNX Runtime's CPU kernel then refuses a call of batch > 1 with
more than one new token and a past (a chunked prefill of a batch); a prompt with an empty past and single-token
steps, what generation runs, are unrestricted. onnxscript's rotary rules take transformers 4's RoPE only; two more
rules of taperfold's own (passes/ort_rotary.py) make transformers 5's RotaryEmbedding, and move it into a
GroupQueryAttention where the positions allow.

At opset 23 the exporter writes ONNX's own Attention, RMSNormalization and RotaryEmbedding, which ONNX Runtime runs
as fused kernels and onnxscript's rules do not take: the pass leaves such a graph as it is.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.rewriter import pattern

from taperfold.exportdir import PAST
from taperfold.opsets import FUSING_OPSET
from taperfold.passes._graph import const_array
from taperfold.passes.ort_rotary import CONTRIB_DOMAIN, ROPE_RULES, ROTARY_INTO_GQA_RULES, not_counted

ROTARY_IN_ATTENTION = "RotaryEmbedding in GroupQueryAttention"


def contrib_ops(model: ir.Model) -> Counter:
    """ONNX Runtime's contrib ops in the main graph, by type; GroupQueryAttentions that rotate their query and key
    counted again as ROTARY_IN_ATTENTION."""
    ops = Counter(node.op_type for node in model.graph if node.domain == CONTRIB_DOMAIN)
    rotating = sum(
        1 for node in model.graph if node.op_type == "GroupQueryAttention" and node.attributes.get_int("do_rotary")
    )
    return ops + Counter({ROTARY_IN_ATTENTION: rotating})


class OrtFusionsPass(ir.passes.InPlacePass):
    """onnxscript's ONNX Runtime fusions on a graph below opset 23. `self.fused`: the contrib ops the last call
    added, by type (empty: nothing matched, or an opset-23 graph)."""

    def __init__(self):
        super().__init__()
        self.fused: dict[str, int] = {}
        self.skipped: str | None = None  # why the last call left the graph as it was, where it chose to

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused, self.skipped = {}, None
        if model.opset_imports.get("", 0) >= FUSING_OPSET:
            return ir.passes.PassResult(model, modified=False)
        if (cropped := _cropped_past(model)) is not None:
            # onnxscript's attention rules lose the crop (_cropped_past says how)
            self.skipped = f"{cropped.name} is cropped before attention (a sliding-window cache)"
            return ir.passes.PassResult(model, modified=False)
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        before = contrib_ops(model)
        _canonical_lengths(model)
        optimize_for_ort(model)  # in place
        changed = pattern.RewriteRuleSet([_MHA_TO_GQA, _MHA_TO_GQA_NO_PAST]).apply_to_model(model)
        if changed:
            common_passes.RemoveUnusedNodesPass()(model)  # the causal mask the attention built is read no more
        if ROPE_RULES.apply_to_model(model):  # after the attention rules: ort_rotary.py says why
            common_passes.RemoveUnusedNodesPass()(model)  # the RoPE as traced, which the rules leave
            ROTARY_INTO_GQA_RULES.apply_to_model(model)
        after = contrib_ops(model)
        self.fused = {op: n - before[op] for op, n in sorted(after.items()) if n > before[op]}
        return ir.passes.PassResult(model, modified=True)


def _canonical_lengths(model: ir.Model) -> None:
    """Each symbolic dim of a computed value written in SymPy's one form of it. torch.export names one length
    differently from layer to layer ("sequence + past_sequence_length" in one, "past_sequence_length + sequence" in
    the next, and the layers export stamps out copy their template's), and onnxscript's rules, which bind dims by
    name, then fuse only the layers whose names agree with the mask's. The graph's inputs keep their names."""
    canonical: dict[str, ir.SymbolicDim] = {}

    def simplified(dim):
        if not isinstance(dim, ir.SymbolicDim) or dim.value is None or dim.value.isidentifier():
            return dim
        if dim.value not in canonical:  # onnx_ir parses the text itself (no eval); unparsed, it is kept as written
            simpler = dim.simplify()
            canonical[dim.value] = simpler if simpler.value is not None else dim
        return canonical[dim.value]

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.outputs:
            if value.shape is not None:
                dims = [simplified(d) for d in value.shape]
                if any(new is not old for new, old in zip(dims, value.shape)):
                    value.shape = ir.Shape(dims)


def _cropped_past(model: ir.Model) -> ir.Value | None:
    """The first cache input the graph slices (a sliding-window cache, cropped to the window before attention:
    onnxscript's MultiHeadAttention then takes the mask of every position with the cropped keys, and fails once the
    past is longer than the window)."""
    return next(
        (
            value
            for value in model.graph.inputs
            if (value.name or "").startswith(PAST) and any(use.node.op_type == "Slice" for use in value.uses())
        ),
        None,
    )


def _repeated_to_query_heads(op, kv_heads_bhsd):
    """repeat_kv as the exporter writes it, then MultiHeadAttention's [B, S, H*D] layout."""
    repeated = op.Reshape(op.Expand(op.Unsqueeze(kv_heads_bhsd, [2]), pattern.ANY_VALUE), pattern.ANY_VALUE)
    return op.Reshape(op.Transpose(repeated, perm=[0, 2, 1, 3]), pattern.ANY_VALUE)


class MhaToGqa(pattern.RewriteRuleClassBase):
    """MultiHeadAttention over K/V repeated to every query head, under a plain causal mask -> GroupQueryAttention
    on the KV heads, with the cache (the Concat of past and new K/V, `present.*`) written by it. `with_past`: the
    decoder's form (a past to extend); else a prefill graph's."""

    def __init__(self, with_past: bool):
        super().__init__(f"MhaOverRepeatedKvToGqa{'' if with_past else 'NoPast'}")
        self.with_past = with_past

    def pattern(self, op, query, key, value, mask, past_key, past_value):
        keys = op.Concat(past_key, key, axis=-2) if self.with_past else key
        values = op.Concat(past_value, value, axis=-2) if self.with_past else value
        attention = op.MultiHeadAttention(
            query,
            _repeated_to_query_heads(op, keys),
            _repeated_to_query_heads(op, values),
            None,  # bias
            None,  # key padding mask
            mask,
            num_heads=pattern.AttrVar("num_heads"),
            scale=pattern.AttrVar("scale", can_match_none=True),
            _domain=CONTRIB_DOMAIN,
        )
        return (attention, keys, values) if self.with_past else attention

    def check(self, op, *args, **bound) -> pattern.MatchResult:  # type: ignore[name-defined]
        result, key, mask = pattern.MatchResult(), bound["key"], bound["mask"]
        shape = key.shape
        if shape is None or len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            return result.fail("key is not [batch, KV heads, sequence, head size] with known heads and size", key)
        sequence = bound["query"].shape[1] if bound["query"].shape else None
        past = bound.get("past_key")
        why = _not_plain_causal(mask, sequence, past.shape[2] if past is not None and past.shape else None)
        return result.fail(why, mask) if why else result

    def rewrite(self, op, query, key, value, num_heads, past_key=None, past_value=None, scale=None, **_):
        flat = op.Constant(value_ints=[0, 0, -1])
        key_bsd = op.Reshape(op.Transpose(key, perm=[0, 2, 1, 3]), flat)
        value_bsd = op.Reshape(op.Transpose(value, perm=[0, 2, 1, 3]), flat)
        # the lengths read off the new values, which later rules leave (RotaryIntoGqa replaces the query and key)
        total = op.Shape(value, start=2, end=3)  # every row attends to all it has: past + new tokens
        if self.with_past:
            total = op.Add(op.Shape(past_key, start=2, end=3), total)
        total = op.Cast(total, to=ir.DataType.INT32)
        last = op.Sub(total, op.Constant(value=ir.tensor(np.array([1], dtype=np.int32))))
        seqlens_k = op.Expand(last, op.Shape(value, start=0, end=1))  # the last position of each row
        total_scalar = op.Squeeze(total, op.Constant(value_ints=[0]))
        attributes = {"num_heads": num_heads.value, "kv_num_heads": key.shape[1]}
        if scale is not None:
            attributes["scale"] = scale.value
        outputs = op.GroupQueryAttention(
            query, key_bsd, value_bsd, past_key, past_value, seqlens_k, total_scalar,
            **attributes, _domain=CONTRIB_DOMAIN, _outputs=3,
        )  # fmt: skip
        return outputs if self.with_past else outputs[0]


def _not_plain_causal(mask: ir.Value, sequence, past) -> str | None:
    """Why `mask` (an additive attention bias) is not the plain causal one the exporter writes, key position <= query
    position and nothing else (no window, no padding): Where(LessOrEqual(keys, queries), 0, very negative), broadcast
    by Expands, the keys' positions 0..past + S - 1 and the queries' past..past + S - 1 (`sequence`: the query's S,
    `past`: the past's length, None where there is none). None when it is."""
    node = _through_expands(mask)
    if node is None or node.op_type != "Where":
        return "the mask is not a Where of a comparison"
    allowed, blocked = (const_array(v) for v in node.inputs[1:])
    if allowed is None or blocked is None or np.any(allowed != 0) or np.any(blocked > -1e30):
        return "the mask's Where does not choose between 0 and a very negative constant"
    compare = _through_expands(node.inputs[0])
    if compare is None or compare.op_type != "LessOrEqual":
        return "the mask's condition is not key position <= query position alone (a window, padding, ...)"
    keys, queries = compare.inputs
    if keys is None or queries is None or keys.shape is None or queries.shape is None:
        return "the mask's positions have no known shapes"
    if keys.shape[-1] == 1 or queries.shape[-1] != 1:  # keys along the last axis, queries along the one before
        return "the mask does not compare key positions (columns) with query positions (rows)"
    tokens, before = [(1, sequence)], [(2, past)] if past is not None else []
    return not_counted(keys, count=tokens + before, offset=[]) or not_counted(queries, count=tokens, offset=before)


def _through_expands(value: ir.Value | None) -> ir.Node | None:
    node = value.producer() if value is not None else None
    while node is not None and node.op_type == "Expand" and node.domain == "":
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node


_MHA_TO_GQA = MhaToGqa.rule(with_past=True)
_MHA_TO_GQA_NO_PAST = MhaToGqa.rule(with_past=False)
