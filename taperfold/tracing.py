"""Tracing a tapered model into ONNX: one graph (prefill, or a KV-cached decoder) at a time, through torch.onnx's
dynamo exporter, into an onnx_ir model.

Each graph type is one `GraphSpec` (GRAPH_SPECS): the call it is traced from (the model itself, or a wrapper that
flattens the KV cache into named tensors), its example arguments and dynamic axes, its input and output names, the
opset table's row it takes and the prefix its wrapper adds to module paths. What the type is (its files, whether it
carries a past, a cache of fixed length) is exportdir.GRAPH_TYPES, keyed alike and torch-free. taperfold.export runs
the graph pipeline around a trace (layer stamping, the fold, fusions, the manifest); an artifact kind that converts
the model itself (OpenVINO's PyTorch frontend) traces the same call.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir
import torch
from torch import nn

from taperfold.errors import TaperfoldError, first_line
from taperfold.exportdir import (
    GROWING,
    INPUT,
    KV_CACHES,
    OUTPUT,
    PREFILL,
    STATIC,
    Graph,
    decoder_io_names,
    torch_dtype,
)
from taperfold.opsets import FUSING_OPSET, choose_opset
from taperfold.taper import TaperedLM
from taperfold.traced_lengths import check_lengths

# The example inputs the exporter traces with: (batch, sequence), and the decoders' past length. The graphs
# are dynamic in all three; verify runs them on shapes far from these (verify.random_inputs, verify.decode_cases).
TRACE_SHAPE = (2, 8)
TRACE_PAST = 5
MAX_EXPORT_BATCH = 4096  # the graphs' batch dimension is dynamic up to this
# A dynamic axis is traced at 2 or more (torch.export specialises 0 and 1), and a decoder's prompt and past
# together stay within the context: the shortest context export takes.
MIN_CONTEXT = 4
ATTENTION_OPSET = 23  # ONNX Attention; below it torch.onnx writes attention as MatMul and Softmax, which broadcast


class ExporterFailed(TaperfoldError):
    """torch.onnx could not export the model (its exception, in one line)."""


def trace_lengths(max_seq_len: int) -> tuple[int, int]:
    """(sequence, past) lengths the exporter traces with for a model of this context: TRACE_SHAPE's and
    TRACE_PAST's where they fit, else the context shared out, 2 at least each."""
    seq = max(2, min(TRACE_SHAPE[1], max_seq_len // 2))
    return seq, max(2, min(TRACE_PAST, max_seq_len - seq))


@dataclass
class ExportOptions:
    logits: str = "last"  # "last": [batch, vocab] (the paper's benchmark mode) | "all": [batch, seq, vocab]
    dtype: str = "fp32"
    opset: int | None = None  # None: per graph and target from taperfold.opsets.TABLE
    target: str = "ort"  # "ort" (ONNX Runtime) | "trt" (TensorRT's ONNX parser): decides opsets and norm fusion
    decoders: tuple[Graph, ...] = ()  # the KV-cached decoders to export: GROWING, STATIC or both
    max_cache: int | None = None  # the static cache's length (None: the model's context)
    force_gate0: bool = False
    baseline: bool = True  # also export baseline.onnx (plain norms), the benchmark's reference
    fuse_projections: bool = True  # every graph: linear layers reading one tensor become one and a Split
    # every graph but baseline-decomposed (its norms stay written out): ONNX Runtime's own LLM fusions, last
    # (passes/ort_fusions.py); for the ONNX Runtime target only
    ort_fusions: bool = False
    # trace the first decoder layers and stamp out the others where those after them are alike (taperfold.layer_trace)
    stamp_layers: bool = True
    # write the ONNX graphs; False (--no-onnx): only the artifacts converted from the model itself (--vllm, --openvino),
    # with no trace
    onnx: bool = True
    # artifacts built from the graphs once they are written: kind name -> that kind's request (an instance of its
    # `request_type`, taperfold.artifacts), e.g. {"tensorrt-plan": TensorrtRequest(batch="1/4/8")} for `export --trt`;
    # built in the registry's order (taperfold.artifacts.in_build_order), whatever this dict's
    artifacts: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.decoders = tuple(cache for cache in KV_CACHES if cache in self.decoders) + tuple(
            cache
            for cache in self.decoders
            if cache not in KV_CACHES  # refused by check_options, named
        )


class _Decoder(nn.Module):
    """Flattens the KV cache into named tensors for export."""

    prefix = "model."  # what it adds to the module paths of the model it wraps

    def __init__(self, model: TaperedLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids, past: list[torch.Tensor]):
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, present = self.model(input_ids, logits="last", past_key_values=pairs, use_cache=True)
        return logits, *[t for kv in present for t in kv]


class _StaticDecoder(nn.Module):
    """The static cache's decoder: the model writes the new keys and values into its cache buffers in place; the
    copies make the exported graph a function of its inputs (ScatterElements(past) → present, no copy node)."""

    def __init__(self, model: TaperedLM):
        super().__init__()
        self.model = model  # under the same path as in _Decoder: module paths gain _Decoder.prefix

    def forward(self, input_ids, cache_position, past: list[torch.Tensor]):
        pairs = [(past[2 * i].clone(), past[2 * i + 1].clone()) for i in range(len(past) // 2)]
        logits, present = self.model(
            input_ids, logits="last", past_key_values=pairs, use_cache=True, cache_position=cache_position
        )
        return logits, *[t for kv in present for t in kv]


@contextlib.contextmanager
def _quiet():
    """torch.onnx prints progress lines and warnings meant for its own debugging; keep ours clean."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)


def _attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
):
    """aten's scaled_dot_product_attention as one ONNX Attention (opset 23), whatever the key/value heads.

    torch.onnx's own translation refuses fewer key/value heads than query heads unless enable_gqa is set, yet
    torch broadcasts a single key/value head over every query head, and Falcon-7B's multi-query attention passes
    one without the flag. One head shared by all is grouped-query attention with a single group, which Attention
    computes (its q_num_heads and kv_num_heads come from the 4-D shapes). Inference graphs only: no dropout."""
    from onnxscript import opset23 as op

    if dropout_p != 0.0:
        raise AssertionError("scaled_dot_product_attention with dropout: export the model in eval mode")
    if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        raise AssertionError(
            f"scaled_dot_product_attention: {query.shape[1]} query heads cannot share "
            f"{key.shape[1]} key and {value.shape[1]} value heads"
        )
    output, _, _, _ = op.Attention(query, key, value, attn_mask, scale=scale, is_causal=is_causal)
    return output


# onnxscript's optimizer (torch.onnx.export(optimize=True)) takes x + c, x - c for x when c is within 1e-8 of 0, and
# x·c, x / c for x when c is within 1e-5 (relative) of 1: it drops an RMSNorm's epsilon of 1e-8 (Helium's), which
# an all-zero row (a padding token's embedding) then turns into NaN. (op, inputs it may sit at, identity element)
_NEAR_IDENTITY = {"Add": ((0, 1), 0.0), "Sub": ((1,), 0.0), "Mul": ((0, 1), 1.0), "Div": ((1,), 1.0)}


def _keep_near_identity_constants(model_ir) -> None:
    """Reshape each scalar constant the optimizer would take for an identity, but is not one, from [] to [1] (the
    same broadcast against a tensor of rank ≥ 1), which its no-op rules do not match."""
    for node in ir.traversal.RecursiveGraphIterator(model_ir.graph):
        positions, identity = _NEAR_IDENTITY.get(node.op_type, ((), None))
        for i in positions:
            other = node.inputs[1 - i] if len(node.inputs) == 2 else None
            value = node.inputs[i]
            tensor = ir.convenience.get_const_tensor(value) if value is not None else None
            if (
                identity is None
                or tensor is None
                or other is None
                or other.shape is None
                or other.shape.rank() == 0
                or tensor.shape.rank() != 0
                or not tensor.dtype.is_floating_point()
            ):
                continue
            c = float(tensor.numpy())
            if c != identity and math.isclose(c, identity, rel_tol=1e-5, abs_tol=1e-8):
                node.replace_input_with(
                    i, _initializer(model_ir.graph, f"{node.name}_kept_constant", tensor.numpy().reshape(1))
                )


def _initializer(graph, name: str, array):
    value = ir.Value(
        name=name,
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        const_value=ir.tensor(array, name=name),
    )
    graph.register_initializer(value)
    return value


def _optimize(model_ir: ir.Model) -> None:
    """What torch.onnx's `program.optimize()` runs (onnxscript's optimizer, then at opset 23 its fusions into ONNX's
    RMSNormalization, RotaryEmbedding and grouped-query Attention), the RoPE fusion left out: ONNX Runtime 1.31 refuses
    the fused RotaryEmbedding on any shape but the traced one (docs/opsets.md#rotary), and a graph with RoPE as plain
    ops takes the table's opset at one trace."""
    from onnxscript import optimizer
    from onnxscript.rewriter.rules.fusion import _gqa, _rms_normalization  # onnxscript >= 0.5.2, as torch.onnx's own

    optimizer.optimize_ir(model_ir)
    if model_ir.opset_imports.get("") == FUSING_OPSET:
        _rms_normalization.fuse_rms_normalization(model_ir)
        _gqa.fuse_gqa(model_ir)


@dataclass
class TraceCall:
    """What one graph is traced from: the module, its example arguments, the dynamic axes torch.export takes for
    them, and the graph's input and output names."""

    module: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    shapes: Any  # per input: the dynamic axes torch.export takes
    inputs: list[str]
    outputs: list[str]
    ids: torch.Tensor  # the example input_ids
    max_sequence: int  # the sequence axis' upper bound


def _example(model: TaperedLM) -> tuple[Any, Any, torch.Tensor, int]:
    """(batch axis, sequence axis, example input_ids, example past length) every graph's trace starts from."""
    cfg = model.cfg
    batch = torch.export.Dim("batch", min=1, max=MAX_EXPORT_BATCH)
    seq = torch.export.Dim("sequence", min=1, max=cfg.max_seq_len)
    seq_len, past_len = trace_lengths(cfg.max_seq_len)
    return batch, seq, torch.randint(0, cfg.vocab_size, (TRACE_SHAPE[0], seq_len)), past_len


def _prefill_call(model: TaperedLM, opts: ExportOptions) -> TraceCall:
    batch, seq, ids, _ = _example(model)
    shapes = {INPUT: {0: batch, 1: seq}, OUTPUT: None}
    return TraceCall(model, (ids,), {"logits": opts.logits}, shapes, [INPUT], [OUTPUT], ids, seq.max)


def _growing_call(model: TaperedLM, opts: ExportOptions) -> TraceCall:
    cfg = model.cfg
    batch, seq, ids, past_len = _example(model)
    # a past leaves room for one new token at least: torch.export infers past < context, and with a wider range
    # torch.onnx would trace the whole decoder again with that bound
    past_dim = torch.export.Dim("past_sequence_length", min=1, max=cfg.max_seq_len - 1)
    kv = torch.zeros(TRACE_SHAPE[0], cfg.kv_heads, past_len, cfg.head_dim, dtype=torch_dtype(opts.dtype))
    past = [kv.clone() for _ in range(2 * cfg.n_layers)]
    inputs, outputs = decoder_io_names(cfg.n_layers, GROWING)
    shapes = ({0: batch, 1: seq}, [{0: batch, 2: past_dim}] * len(past))
    return TraceCall(_Decoder(model), (ids, past), {}, shapes, inputs, outputs, ids, seq.max)


def _static_call(model: TaperedLM, opts: ExportOptions) -> TraceCall:
    cfg = model.cfg
    batch, _, ids, _ = _example(model)
    cache_len = static_cache_length(cfg, opts)
    seq = torch.export.Dim("sequence", min=1, max=cache_len)
    seq_len = min(ids.shape[1], cache_len // 2)  # a prompt that fits, not the whole cache (2 at least: MIN_CONTEXT)
    ids = ids[:, :seq_len]
    kv = torch.zeros(TRACE_SHAPE[0], cfg.kv_heads, cache_len, cfg.head_dim, dtype=torch_dtype(opts.dtype))
    past = [kv.clone() for _ in range(2 * cfg.n_layers)]
    inputs, outputs = decoder_io_names(cfg.n_layers, STATIC)
    shapes = ({0: batch, 1: seq}, {0: seq}, [{0: batch}] * len(past))
    return TraceCall(
        _StaticDecoder(model), (ids, torch.arange(seq_len), past), {}, shapes, inputs, outputs, ids, seq.max
    )


@dataclass(frozen=True)
class GraphSpec:
    """How one graph type is traced: its call (module, example arguments, dynamic axes, input and output names), the
    opset table's row it takes (taperfold.opsets) and the prefix its traced module adds to the model's module paths."""

    call: Callable[[TaperedLM, ExportOptions], TraceCall]
    opset_row: str
    module_prefix: str


GRAPH_SPECS: dict[Graph, GraphSpec] = {
    PREFILL: GraphSpec(_prefill_call, "prefill", ""),
    GROWING: GraphSpec(_growing_call, "decoder", _Decoder.prefix),
    STATIC: GraphSpec(_static_call, "decoder", _Decoder.prefix),
}


def trace_call(model: TaperedLM, opts: ExportOptions, graph: Graph = PREFILL) -> TraceCall:
    """The call `graph` (prefill, or a decoder) of `model` is traced from, with dynamic batch and sequence (and past)
    axes."""
    return GRAPH_SPECS[graph].call(model, opts)


# What a matcher of onnxscript's rewrite rules keeps of the last graph it matched (SimplePatternMatcher in
# onnxscript/rewriter/_matcher.py, 0.7.2)
_MATCH_STATE = ("_graph", "_current_node", "_match", "_tracer")
# Where module-level rewrite rules live: onnxscript's (the exporter's optimizer, ONNX Runtime's fusions) and taperfold's
# own (passes/ort_fusions.py, passes/ort_rotary.py)
_RULE_MODULES = ("onnxscript.rewriter", "taperfold.passes")


def forget_matched_graphs() -> None:
    """The rewrite rules that ran on a graph are module-level objects (the exporter's optimizer, _optimize(),
    runs onnxscript's default rules and at opset 23 its fusions of RMSNorm and attention;
    OrtFusionsPass runs ONNX Runtime's and taperfold's own), whose matchers keep the last graph they matched until
    their next match, and through it every weight of the model: the checkpoint's own tensors, memory-mapped from its
    files. Dropped after each trace and before export builds its artifacts, so that the model can be let go (a 1.1 B
    source stayed mapped after its graphs were written, and `--vllm` mapped it a second time). Memory only: an
    onnxscript whose rules look otherwise is left as it is (tests/test_memory.py holds the installed one to this)."""
    try:
        from onnxscript.rewriter import RewriteRule, RewriteRuleSet
    except ImportError:
        return
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_RULE_MODULES):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, RewriteRuleSet):
                rules = getattr(value, "rules", ())
            elif isinstance(value, tuple | list):  # the default rules
                rules = value
            else:
                rules = [value]
            for rule in rules:
                matcher = getattr(rule, "_matcher", None) if isinstance(rule, RewriteRule) else None
                for state in _MATCH_STATE:
                    if hasattr(matcher, state):
                        setattr(matcher, state, None)


def export_to_ir(model: TaperedLM, opts: ExportOptions, graph: Graph = PREFILL, opset: int | None = None):
    """torch model → onnx_ir.Model of `graph` (prefill, or a decoder) with dynamic batch and sequence (and past)
    axes, at `opset` (default: the one `opts` chooses for this graph)."""
    opset = opset or choose_opset(opts.target, opset_graph(graph), opts.opset, opts.ort_fusions).opset
    call = trace_call(model, opts, graph)
    with _quiet():
        try:
            program = torch.onnx.export(
                call.module,
                call.args,
                kwargs=call.kwargs,
                dynamo=True,
                opset_version=opset,
                input_names=call.inputs,
                output_names=call.outputs,
                dynamic_shapes=call.shapes,
                optimize=False,
                verbose=False,
                custom_translation_table=(
                    {torch.ops.aten.scaled_dot_product_attention.default: _attention}
                    if opset >= ATTENTION_OPSET
                    else None
                ),
            )
            assert program is not None  # dynamo=True always returns the program
            _keep_near_identity_constants(program.model)
            _optimize(program.model)
        except Exception as e:  # the exporter raises many types and wraps the cause in a long banner
            cause = e.__cause__ or e
            raise ExporterFailed(f"torch.onnx export failed: {type(cause).__name__}: {first_line(cause)}") from e
        finally:
            forget_matched_graphs()
    _check_dynamic(program.model, call.ids)
    if program.exported_program is not None:  # what torch.export traced, kept by the dynamo exporter
        check_lengths(
            program.exported_program, {0: ("batch", MAX_EXPORT_BATCH), 1: ("sequence", call.max_sequence)}, INPUT
        )
    return program.model


def export_any_attention(
    model: TaperedLM, opts: ExportOptions, graph: Graph, opset: int, name: str, on_stage
) -> tuple[ir.Model, str | None]:
    """export_to_ir; where torch.onnx fails on the model's attention as it runs by default (Doge's SDPA: the strides
    torch.export records for its output disagree with the exporter's), its plain MatMul and Softmax form, said as
    a stage of graph `name`. With the graph: why it took the eager form, or None."""
    try:
        return export_to_ir(model, opts, graph, opset=opset), None
    except ExporterFailed as failed:
        eager = model.eager_attention()
        if eager is None:
            raise
        on_stage(f"exporting {name} with eager attention (MatMul, Softmax): {failed}")
        with eager:
            try:
                return export_to_ir(model, opts, graph, opset=opset), str(failed)
            except ExporterFailed as again:
                raise ExporterFailed(f"{failed}; with eager attention: {again}") from None


def _check_dynamic(model: ir.Model, ids: torch.Tensor) -> None:
    """The graph takes any batch and sequence length: where the model's code branches on a length (Qwen3-Next's
    chunked linear attention), torch.export fixes it to the traced one instead of failing, and the graph would run on
    that shape alone (ONNX Runtime refuses every other)."""
    tokens = next((v for v in model.graph.inputs if v.name == INPUT), None)
    shape = tokens.shape if tokens is not None else None
    if shape is None:
        return
    fixed = [(axis, dim) for axis, dim in enumerate(list(shape)[:2]) if isinstance(dim, int)]
    if fixed:
        axis, dim = fixed[0]
        raise TaperfoldError(
            f"torch.onnx export fixed the {('batch', 'sequence')[axis]} length of '{INPUT}' to {dim} (the traced "
            f"{tuple(ids.shape)[axis]}): the model's code branches on it, so the graph would take that length only"
        )


def static_cache_length(cfg, opts: ExportOptions) -> int:
    """The static cache's length: --max-cache, or the model's context."""
    return opts.max_cache or cfg.max_seq_len


def opset_graph(graph: Graph) -> str:
    """The opset table's name of a graph (taperfold.opsets): "prefill", or "decoder" for either cache."""
    return GRAPH_SPECS[graph].opset_row
