"""RoPE as ONNX Runtime runs it: two rules of the ONNX Runtime fusions pass (passes/ort_fusions.py), run after
onnxscript's and taperfold's attention rules.

onnxscript's rotary rules take transformers 4's form of RoPE only (the angles a MatMul of inv_freq by the positions,
then a Transpose); transformers 5 computes them as a product, which they leave as traced, about fifteen ops a query
or key. `RopeToRotaryEmbedding` turns that form into ONNX Runtime's RotaryEmbedding; `RotaryIntoGqa` then moves the
rotation of a GroupQueryAttention's query and key into the attention itself (its do_rotary), as onnxruntime-genai's
builder writes it, where the positions are provably the ones GroupQueryAttention rotates by: the past's length + 0..S-1.

Both run after the attention rules on purpose: onnxscript's own GroupQueryAttention rule takes any attention whose
query and key are rotated by RotaryEmbedding, and does not check the mask (its causal-mask match is tested for None,
which it never is), so it would fuse Mistral's sliding window away.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from taperfold.passes._graph import const_array

CONTRIB_DOMAIN = "com.microsoft"
TO_HEADS_FIRST = [0, 2, 1, 3]  # [batch, sequence, heads, dims] <-> [batch, heads, sequence, dims]


class RopeToRotaryEmbedding(pattern.RewriteRuleClassBase):
    """RoPE as transformers 5 computes it, where the positions are one row for the whole batch (the decoders' past
    length + 0..S-1, a prefill's 0..S-1): x·cos + rotate_half(x)·sin, with cos and sin of Concat(f, f), f = positions
    × inv_freq (× a constant attention scaling in some RoPE types) -> ONNX Runtime's RotaryEmbedding on x
    [batch, heads, sequence, rotary dims], its cos/sin cache computed in the graph for positions 0 up to the call's
    last (the angles as the model computes them; no maximum length baked in)."""

    def __init__(self, scaled: bool):
        # the angles are shared by every layer's query and key: the rule leaves them, RemoveUnusedNodes takes them
        super().__init__(f"TransformersRope{'Scaled' if scaled else ''}ToRotaryEmbedding", remove_nodes=False)
        self.scaled = scaled
        self._made: dict[tuple, tuple[ir.Value, ir.Value, ir.Value]] = {}

    def pattern(self, op, x, positions, position_axes, inv_freq, scale, cos_axes, sin_axes, starts, ends, axes, steps):
        freqs = op.Mul(op.Cast(op.Unsqueeze(positions, position_axes), to=ir.DataType.FLOAT), inv_freq)
        angles = op.Concat(freqs, freqs, axis=-1)
        cos, sin = op.Cos(angles), op.Sin(angles)
        if self.scaled:
            cos, sin = op.Mul(cos, scale), op.Mul(sin, scale)
        first_half = op.Slice(x, starts, ends, axes, steps)
        second_half = op.Slice(x, ends, pattern.ANY_VALUE, axes, steps, _outputs=["second_half"])
        rotated = op.Concat(op.Neg(second_half), first_half, axis=-1)
        return op.Add(op.Mul(x, op.Unsqueeze(cos, cos_axes)), op.Mul(rotated, op.Unsqueeze(sin, sin_axes)))

    def check(self, op, x, positions, position_axes, inv_freq, cos_axes, sin_axes, starts, ends, axes, steps,
              second_half, scale=None, **_) -> pattern.MatchResult:  # type: ignore[name-defined]  # fmt: skip
        result = pattern.MatchResult()
        shape = x.shape
        if shape is None or len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            return result.fail("x is not [batch, heads, sequence, rotary dims] with known heads and dims", x)
        half = shape[3] // 2
        if [_scalar(v) for v in (starts, ends, axes, steps)] not in ([0, half, 3, 1], [0, half, -1, 1]):
            return result.fail("x is not split into two halves of its last axis", x)
        if second_half.shape is None or second_half.shape[-1] != shape[3] - half:
            return result.fail("the second half does not run to the end of x", second_half)
        if positions.dtype != ir.DataType.INT64 or positions.shape is None or len(positions.shape) != 1:
            return result.fail("the positions are not one row of int64 for the whole batch", positions)
        if _unknown(positions.shape[0]) or positions.shape[0] != shape[2]:
            return result.fail("the positions are not one per token of x", positions)
        if _size(position_axes) < 1:
            return result.fail("the positions' unsqueeze axes are not constant", position_axes)
        rank = 1 + _size(position_axes)
        if _axes(position_axes, rank) != set(range(rank)) - {rank - 2}:
            return result.fail("the positions are not unsqueezed to [1.., sequence, 1]", position_axes)
        table = const_array(inv_freq)
        if table is None or table.shape != (half,):
            return result.fail("inv_freq is not a constant of half the rotary dims", inv_freq)
        for unsqueeze in (cos_axes, sin_axes):  # [1.., sequence, dims] -> [1, 1, sequence, dims]
            if rank + _size(unsqueeze) != 4 or not _axes(unsqueeze, 4) <= {0, 1}:
                return result.fail("cos/sin are not unsqueezed to [1, 1, sequence, dims]", unsqueeze)
        if self.scaled and (_size(scale) != 1 or const_array(scale).ndim > 1):  # type: ignore[union-attr]
            return result.fail("the attention scaling is not a constant scalar", scale)
        return result

    def rewrite(self, op, x, positions, inv_freq, scale=None, **_):
        # Every layer's query and key get one position_ids value and one cache, made at the first match (the earliest
        # in the graph): RotaryIntoGqa takes a query and key rotated by the same ones
        key = (positions, inv_freq, scale)
        if key not in self._made:
            self._made[key] = self._position_ids(op, x, positions), *self._cache(op, positions, inv_freq, scale)
        position_ids, cos, sin = self._made[key]
        return op.RotaryEmbedding(x, position_ids, cos, sin, interleaved=0, _domain=CONTRIB_DOMAIN)

    @staticmethod
    def _cache(op, positions, inv_freq, scale):
        """cos/sin for positions 0 up to the call's last, the rows RotaryEmbedding (and GroupQueryAttention) read by
        position."""
        zero, one = (op.Constant(value=ir.tensor(np.array(n, dtype=np.int64))) for n in (0, 1))
        count = op.Add(op.ReduceMax(positions, keepdims=0), one)
        every_position = op.Unsqueeze(op.Range(zero, count, one), op.Constant(value_ints=[1]))
        angles = op.Mul(op.Cast(every_position, to=ir.DataType.FLOAT), inv_freq)  # [positions, dims / 2]
        cos, sin = op.Cos(angles), op.Sin(angles)
        return (op.Mul(cos, scale), op.Mul(sin, scale)) if scale is not None else (cos, sin)

    @staticmethod
    def _position_ids(op, x, positions):
        """[batch, sequence]: the positions, one row per sequence of the batch."""
        transpose = x.producer()  # the batch read before the heads went first: RotaryIntoGqa removes that Transpose
        if (
            transpose is not None
            and transpose.op_type == "Transpose"
            and (transpose.attributes.get_ints("perm") or [1])[0] == 0
        ):
            x = transpose.inputs[0]
        batch_by_sequence = op.Concat(op.Shape(x, start=0, end=1), op.Shape(positions), axis=0)
        return op.Expand(op.Unsqueeze(positions, op.Constant(value_ints=[0])), batch_by_sequence)

    def cleanup(self):
        self._made.clear()


class RotaryIntoGqa(pattern.RewriteRuleClassBase):
    """GroupQueryAttention (no rotation of its own) of a query and key rotated by RotaryEmbedding -> the same
    attention rotating them itself (do_rotary, the caches as its cos_cache / sin_cache), reading the heads in the
    [batch, sequence, heads·dims] layout they were projected in. Only where the positions are those
    GroupQueryAttention rotates by (the past's length + 0..S-1, checked through the graph) and the head size is a
    multiple of 16 (ONNX Runtime's CPU kernel refuses others); the rotation covers the whole head (a partial one
    rotates a Slice, which the pattern does not take)."""

    def __init__(self, with_past: bool):
        super().__init__(f"RotaryIntoGqa{'' if with_past else 'NoPast'}")
        self.with_past = with_past

    def pattern(self, op, query_bshd, key_bshd, value, past_key, past_value, seqlens_k, total, position_ids, cos, sin):
        def rotated(heads_last):
            heads_first = op.Transpose(heads_last, perm=TO_HEADS_FIRST)
            embedded = op.RotaryEmbedding(
                heads_first,
                position_ids,
                cos,
                sin,
                interleaved=0,
                _domain=CONTRIB_DOMAIN,
                _allow_other_attributes=False,
            )  # RopeToRotaryEmbedding's: no partial rotation, no scale of its own
            return op.Reshape(op.Transpose(embedded, perm=TO_HEADS_FIRST), pattern.ANY_VALUE)

        return op.GroupQueryAttention(
            rotated(query_bshd), rotated(key_bshd), value, past_key if self.with_past else None,
            past_value if self.with_past else None, seqlens_k, total,
            _domain=CONTRIB_DOMAIN, _outputs=["attention", "present_key", "present_value"],
        )  # fmt: skip

    def check(
        self, op, query_bshd, key_bshd, position_ids, seqlens_k, total, attention, past_key=None, **_
    ) -> pattern.MatchResult:  # type: ignore[name-defined]
        result = pattern.MatchResult()
        attributes = attention.producer().attributes
        if attributes.get_int("do_rotary"):
            return result.fail("the attention rotates already", attention)
        for heads_last in (query_bshd, key_bshd):
            shape = heads_last.shape
            if shape is None or len(shape) != 4 or not isinstance(shape[3], int) or shape[3] % 16:
                return result.fail("not [batch, sequence, heads, head size a multiple of 16]", heads_last)
        if not _every_row_full(seqlens_k, total):
            return result.fail(
                "the attention's rows may hold padding (seqlens_k is not total - 1 for every row)", seqlens_k
            )
        why = _not_gqa_positions(position_ids, query_bshd, past_key)
        return result.fail(why, position_ids) if why else result

    def rewrite(self, op, query_bshd, key_bshd, value, seqlens_k, total, cos, sin, attention, past_key=None,
                past_value=None, **_):  # fmt: skip
        flat = op.Constant(value_ints=[0, 0, -1])
        rotary = ("do_rotary", "rotary_interleaved")
        attributes = {k: a.value for k, a in attention.producer().attributes.items() if k not in rotary}
        return op.GroupQueryAttention(
            op.Reshape(query_bshd, flat), op.Reshape(key_bshd, flat), value, past_key, past_value, seqlens_k, total,
            cos, sin, **attributes, do_rotary=1, rotary_interleaved=0, _domain=CONTRIB_DOMAIN, _outputs=3,
        )  # fmt: skip


def _every_row_full(seqlens_k: ir.Value, total: ir.Value) -> bool:
    """seqlens_k is total - 1 for every row of the batch, as MhaToGqa writes them (Expand(Sub(t, 1)) and Squeeze(t) of
    one t): no row padded, so GroupQueryAttention rotates row b's token i at total - S + i, the model's position."""
    expand, squeeze = _producer(seqlens_k), _producer(total)
    sub = _producer(expand.inputs[0]) if expand is not None and expand.op_type == "Expand" else None
    if sub is None or sub.op_type != "Sub" or _scalar(sub.inputs[1]) != 1:
        return False
    return squeeze is not None and squeeze.op_type == "Squeeze" and squeeze.inputs[0] is sub.inputs[0]


def _not_gqa_positions(position_ids: ir.Value, query_bshd: ir.Value, past_key: ir.Value | None) -> str | None:
    """Why the rows of `position_ids` (RopeToRotaryEmbedding's: positions expanded over the batch) are not what
    GroupQueryAttention rotates by, Range(0, S) + the past's length. None when they are."""
    expand = position_ids.producer()
    unsqueeze = _producer(expand.inputs[0]) if expand is not None and expand.op_type == "Expand" else None
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        return "the positions are not RopeToRotaryEmbedding's"
    sequence = query_bshd.shape[1] if query_bshd.shape else None
    past = [(2, past_key.shape[2] if past_key.shape else None)] if past_key is not None else []
    return not_counted(unsqueeze.inputs[0], count=[(1, sequence)], offset=past)


Dims = list[tuple[int, "int | ir.SymbolicDim | None"]]


def not_counted(positions: ir.Value | None, count: Dims, offset: Dims) -> str | None:
    """Why `positions` (through Unsqueezes) is not Range(0, the sum of `count`) + the sum of `offset` as the
    exporter writes them: each term a Squeeze(Shape(v, start=axis, end=axis + 1)) of a value whose dim `axis` is the
    (axis, dim) named, symbolic or not (so the query's sequence, the past's length). None when it is."""
    node = _producer(positions)
    while node is not None and node.op_type == "Unsqueeze":
        node = _producer(node.inputs[0])
    added: Dims | None = []
    if node is not None and node.op_type == "Add":
        counted, other = node.inputs
        if getattr(_producer(counted), "op_type", None) != "Range":
            counted, other = other, counted
        added, node = _dims_read(other), _producer(counted)
    if node is None or node.op_type != "Range":
        return "the positions are not a range"
    start, limit, delta = node.inputs
    if _scalar(start) != 0 or _scalar(delta) != 1:
        return "the positions' range does not count from 0 by 1"
    if not _same_dims(_dims_read(limit), count):
        return "the positions' range does not count the tokens it should"
    if not _same_dims(added, offset):
        return "the positions are not offset by what they should be (the past's length)"
    return None


def _dims_read(value: ir.Value | None) -> Dims | None:
    """The (axis, dim) terms of `value`: Squeeze(Shape(v, start=axis, end=axis + 1)), or an Add of such."""
    node = _producer(value)
    if node is not None and node.op_type == "Add":
        terms = [_dims_read(v) for v in node.inputs]
        return None if terms[0] is None or terms[1] is None else terms[0] + terms[1]
    shape = _producer(node.inputs[0]) if node is not None and node.op_type == "Squeeze" else None
    source = shape.inputs[0] if shape is not None and shape.op_type == "Shape" else None
    if shape is None or source is None or source.shape is None:
        return None
    axis = shape.attributes.get_int("start", 0)
    if shape.attributes.get_int("end", -1) != axis + 1 or len(source.shape) <= axis:
        return None
    return [(axis, source.shape[axis])]


def _unknown(dim) -> bool:
    return dim is None or (isinstance(dim, ir.SymbolicDim) and dim.value is None)


def _producer(value: ir.Value | None) -> ir.Node | None:
    return value.producer() if value is not None else None


def _scalar(value: ir.Value | None) -> int | None:
    """The integer a one-element constant holds; None for anything else."""
    constant = const_array(value)
    return int(constant.item()) if constant is not None and constant.size == 1 else None


def _same_dims(got: Dims | None, want: Dims) -> bool:
    """`got` and `want` name the same dims; an unknown dim (None, or a symbolic one without a name) is never the
    same as anything."""
    if got is None or any(_unknown(dim) for _, dim in [*got, *want]):
        return False
    return len(got) == len(want) and all(g == w for g, w in zip(sorted(got, key=str), sorted(want, key=str)))


def _size(value: ir.Value | None) -> int:
    constant = const_array(value)
    return -1 if constant is None else constant.size


def _axes(value: ir.Value, rank: int) -> set[int]:
    """The axes a constant names, made non-negative for `rank` (empty where `value` is not constant)."""
    constant = const_array(value)
    return set() if constant is None else {int(a) % rank for a in constant.reshape(-1)}


ROPE_RULES = pattern.RewriteRuleSet(
    [RopeToRotaryEmbedding.rule(scaled=False), RopeToRotaryEmbedding.rule(scaled=True)], commute=True
)
ROTARY_INTO_GQA_RULES = pattern.RewriteRuleSet(
    [RotaryIntoGqa.rule(with_past=True), RotaryIntoGqa.rule(with_past=False)]
)
