"""`taperfold export`: a model source (taperfold.sources) → ONNX (baseline, unfolded, folded) + manifest.json.

The tapered model is exported once at g = 0 with the torch dynamo exporter; its graph holds each
tapered norm as plain ops (`Mul` by c, `Mul` by γ̃; LN adds mean subtraction and `Add` β) tagged with
the module path in the node metadata. That graph is written as `unfolded.onnx`, then the passes in
`taperfold.passes` fold the norms into their readers and the result is written as `model.onnx`.
`baseline.onnx` is the same weights with the model's own untapered norms, in the fastest form the
target runs (one fused norm op: the benchmark's reference); `baseline.decomposed.onnx` keeps RMSNorm as
the plain ops hand-written norms export to (docs/opsets.md). A plain (untapered) model gets its baseline
only: there is nothing to fold.

Every graph (baseline, unfolded, folded, decoders alike, so the fold's own gain stays visible) then gets
its projections fused unless `fuse_projections=False`: the linear layers that read one tensor (q/k/v,
gate/up) become one on their concatenated weights and a Split (passes/fuse_projections.py); the manifest's
artifact entry says what was fused (`projections`, null when the option was off).

Each graph's opset comes from `taperfold.opsets` (per graph: prefill or decoder; per target: ONNX
Runtime or TensorRT) unless `--opset` overrides it; the manifest records the choice per artifact.

With `kv_cache` each variant also gets KV-cached decoders, with the tensor names optimum and onnxruntime-genai
use: inputs `input_ids`, `past_key_values.{i}.key|value`, outputs `logits`, `present.{i}.key|value`. Two caches
(`kv_cache=True` or "growing", "static", or both):

- growing (`*.decoder.onnx`): the cache axes are (batch, kv_heads, past_sequence_length, head_dim); present is past
  plus the new tokens, so every step has new shapes;
- static (`*.static.onnx`): the cache is `max_cache` long (default: the model's context) and a `cache_position`
  input (int64 [sequence], transformers' name) says where the new tokens go; the graph writes their keys and values
  there (ScatterElements on the past input: onnxruntime-genai's past_present_share_buffer binds present to the past's
  buffer, which ONNX Runtime then updates in place) and masks every position beyond each query's. Every step has
  the same shapes: what CUDA graphs need. taperfold's own models take one, and transformers models as
  transformers' StaticCache (hf/model.py) unless their cache has sliding-window layers (STATIC_CACHE_REFUSED).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from taperfold import exportdir
from taperfold.environment import package_versions
from taperfold.errors import TaperfoldError, first_line
from taperfold.exportdir import (
    BASELINE,
    DTYPES,
    FOLDED,
    GROWING,
    INPUT,
    KV_CACHES,
    LOGITS,
    MANIFEST,
    OUTPUT,
    STATIC,
    UNFOLDED,
    cache_of,
    decoder_io_names,
    onnx_file,
    torch_dtype,
)
from taperfold.fsutil import atomic_dir, write_json_atomic
from taperfold.norms import norm_kinds
from taperfold.opsets import FUSING_OPSET, OpsetChoice, choose_opset, fuses_norms, without_fused_rotary
from taperfold.sources import ModelSource, checkpoint_digest, open_source
from taperfold.taper import TaperedLM

NOTHING_TO_FOLD = "nothing to fold: {path} has no tapered norms (a plain model); wrote the baseline only"


# The example inputs the exporter traces with: (batch, sequence), and the decoders' past length. The graphs
# are dynamic in all three; verify runs them on shapes far from these (verify.random_inputs, verify.decode_cases).
TRACE_SHAPE = (2, 8)
TRACE_PAST = 5
MAX_EXPORT_BATCH = 4096  # the graphs' batch dimension is dynamic up to this
# A dynamic axis is traced at 2 or more (torch.export specialises 0 and 1), and a decoder's prompt and past
# together stay within the context: the shortest context export takes.
MIN_CONTEXT = 4
ATTENTION_OPSET = 23  # ONNX Attention; below it torch.onnx writes attention as MatMul and Softmax, which broadcast


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
    kv_cache: bool | str | tuple[str, ...] = False  # decoders: True = "growing", "static", or both as a tuple
    max_cache: int | None = None  # the static cache's length (None: the model's context)
    force_gate0: bool = False
    baseline: bool = True  # also export baseline.onnx (plain norms), the benchmark's reference
    fuse_projections: bool = True  # every graph: linear layers reading one tensor become one and a Split

    @property
    def caches(self) -> tuple[str, ...]:
        """The decoders to export, in KV_CACHES order (the growing one first)."""
        if self.kv_cache is False or self.kv_cache is None:
            return ()
        asked = (self.kv_cache,) if isinstance(self.kv_cache, (bool, str)) else tuple(self.kv_cache)
        kinds = {GROWING if kind is True else kind for kind in asked}
        unknown = sorted(str(kind) for kind in kinds - set(KV_CACHES))
        if unknown or not kinds:
            raise TaperfoldError(
                f"--kv-cache must be {' or '.join(KV_CACHES)} (or both, comma-separated), got "
                f"{','.join(unknown) or 'nothing'}"
            )
        return tuple(kind for kind in KV_CACHES if kind in kinds)


@dataclass
class ExportResult:
    out_dir: Path
    manifest: dict
    timings: dict = field(default_factory=dict)


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


class _StaticDecoder(_Decoder):
    """The static cache's decoder: the model writes the new keys and values into its cache buffers in place; the
    copies make the exported graph a function of its inputs (ScatterElements(past) → present, no copy node)."""

    def forward(self, input_ids, cache_position, past: list[torch.Tensor]):
        pairs = [(past[2 * i].clone(), past[2 * i + 1].clone()) for i in range(len(past) // 2)]
        logits, present = self.model(
            input_ids, logits="last", past_key_values=pairs, use_cache=True, cache_position=cache_position
        )
        return logits, *[t for kv in present for t in kv]


STATIC_CACHE_REFUSED = (
    "{path}: --kv-cache static: the model's transformers cache has sliding-window layers, which "
    "keep a window rather than the positions a static cache names; use --kv-cache growing"
)


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
    import onnx_ir as ir

    for node in ir.traversal.RecursiveGraphIterator(model_ir.graph):
        positions, identity = _NEAR_IDENTITY.get(node.op_type, ((), None))
        for i in positions:
            other = node.inputs[1 - i] if len(node.inputs) == 2 else None
            tensor = ir.convenience.get_const_tensor(node.inputs[i]) if node.inputs[i] is not None else None
            if (
                tensor is None
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
    import onnx_ir as ir

    value = ir.Value(
        name=name,
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        const_value=ir.tensor(array, name=name),
    )
    graph.register_initializer(value)
    return value


def export_to_ir(model: TaperedLM, opts: ExportOptions, decoder: bool | str = False, opset: int | None = None):
    """torch model → onnx_ir.Model with dynamic batch and sequence (and past) axes, at `opset` (default: the
    one `opts` chooses for this graph). `decoder`: False (prefill), True / "growing" or "static" (exportdir)."""
    opset = opset or choose_opset(opts.target, "decoder" if decoder else "prefill", opts.opset).opset
    cfg = model.cfg
    batch = torch.export.Dim("batch", min=1, max=MAX_EXPORT_BATCH)
    seq = torch.export.Dim("sequence", min=1, max=cfg.max_seq_len)
    seq_len, past_len = trace_lengths(cfg.max_seq_len)
    ids = torch.randint(0, cfg.vocab_size, (TRACE_SHAPE[0], seq_len))
    if cache_of(decoder) == STATIC:
        cache_len = static_cache_length(cfg, opts)
        seq = torch.export.Dim("sequence", min=1, max=cache_len)
        seq_len = min(seq_len, cache_len // 2)  # a prompt that fits, not the whole cache (2 at least: MIN_CONTEXT)
        ids = ids[:, :seq_len]
        kv = torch.zeros(TRACE_SHAPE[0], cfg.kv_heads, cache_len, cfg.head_dim, dtype=torch_dtype(opts.dtype))
        past = [kv.clone() for _ in range(2 * cfg.n_layers)]
        inputs, outputs = decoder_io_names(cfg.n_layers, STATIC)
        module, args, kwargs = _StaticDecoder(model), (ids, torch.arange(seq_len), past), {}
        shapes = ({0: batch, 1: seq}, {0: seq}, [{0: batch}] * len(past))
    elif decoder:
        past_dim = torch.export.Dim("past_sequence_length", min=1, max=cfg.max_seq_len)
        kv = torch.zeros(TRACE_SHAPE[0], cfg.kv_heads, past_len, cfg.head_dim, dtype=torch_dtype(opts.dtype))
        past = [kv.clone() for _ in range(2 * cfg.n_layers)]
        inputs, outputs = decoder_io_names(cfg.n_layers)
        module, args = _Decoder(model), (ids, past)
        shapes = ({0: batch, 1: seq}, [{0: batch, 2: past_dim}] * len(past))
        kwargs = {}
    else:
        module, args, kwargs = model, (ids,), {"logits": opts.logits}
        inputs, outputs = [INPUT], [OUTPUT]
        shapes = {INPUT: {0: batch, 1: seq}, OUTPUT: None}
    with _quiet():
        try:
            program = torch.onnx.export(
                module,
                args,
                kwargs=kwargs,
                dynamo=True,
                opset_version=opset,
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=shapes,
                optimize=False,
                verbose=False,
                custom_translation_table=(
                    {torch.ops.aten.scaled_dot_product_attention.default: _attention}
                    if opset >= ATTENTION_OPSET
                    else None
                ),
            )
            _keep_near_identity_constants(program.model)
            program.optimize()
        except Exception as e:  # the exporter raises many types and wraps the cause in a long banner
            cause = e.__cause__ or e
            raise TaperfoldError(f"torch.onnx export failed: {type(cause).__name__}: {first_line(cause)}") from e
    return program.model


def _save(model_ir, path: Path) -> None:
    import onnx_ir as ir

    ir.save(model_ir, path, external_data=path.name + ".data")


def _load(path: Path):
    """A graph just written, its weights read lazily."""
    import onnx_ir as ir

    return ir.load(path)


def check_options(opts: ExportOptions) -> None:
    """A bad --dtype, --logits, --target, --opset, --kv-cache or --max-cache fails before any work."""
    if opts.dtype not in DTYPES:
        raise TaperfoldError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
    if opts.logits not in LOGITS:
        raise TaperfoldError(f"--logits must be 'last' or 'all', got {opts.logits!r}")
    choose_opset(opts.target, "prefill", opts.opset)
    if opts.max_cache is not None:
        if STATIC not in opts.caches:
            raise TaperfoldError(
                f"--max-cache {opts.max_cache}: only a static cache has a length; add --kv-cache static"
            )
        if opts.max_cache < MIN_CONTEXT:
            raise TaperfoldError(
                f"--max-cache must be {MIN_CONTEXT} or more (a prompt and a step), got {opts.max_cache}"
            )


def static_cache_length(cfg, opts: ExportOptions) -> int:
    """The static cache's length: --max-cache, or the model's context."""
    return opts.max_cache or cfg.max_seq_len


def _check_static_cache(source: ModelSource, model: TaperedLM, opts: ExportOptions) -> None:
    if STATIC not in opts.caches:
        return
    if not model.static_cache:
        raise TaperfoldError(STATIC_CACHE_REFUSED.format(path=source.path))
    if opts.max_cache is not None and opts.max_cache > source.config.max_seq_len:
        raise TaperfoldError(
            f"--max-cache {opts.max_cache} exceeds the model's context (max_seq_len "
            f"{source.config.max_seq_len}): positions beyond it have no embedding"
        )


def export_checkpoint(
    ckpt_path: str | Path, out_dir: str | Path, opts: ExportOptions, on_stage=lambda name: None
) -> ExportResult:
    """Write baseline.onnx, unfolded.onnx, model.onnx (folded) and manifest.json into `out_dir`."""
    check_options(opts)
    ckpt_path = Path(ckpt_path)
    source = open_source(ckpt_path)
    _check_gate(source, opts)
    if source.config.max_seq_len < MIN_CONTEXT:
        raise TaperfoldError(
            f"{ckpt_path}: the model's context is {source.config.max_seq_len} token(s); export "
            f"traces a dynamic sequence and a KV cache of 2 tokens or more each, and needs a "
            f"context of {MIN_CONTEXT} or more"
        )
    dtype = torch_dtype(opts.dtype)
    sources = []  # (variant, model); the folded graphs are the unfolded ones after the passes
    if opts.baseline or not source.tapered:
        sources.append((BASELINE, source.build_baseline().to(dtype)))
    if source.tapered:
        sources.append((UNFOLDED, source.build(gate=0.0).to(dtype)))
    _check_static_cache(source, sources[0][1], opts)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        exported = export_graphs(sources, tmp, opts, on_stage)
        on_stage("writing manifest")
        manifest = _manifest(source, ckpt_path, opts, tmp, exported)
        write_json_atomic(tmp / MANIFEST, manifest)
    return ExportResult(out_dir, manifest, exported.timings)


@dataclass
class ExportedGraphs:
    """What `export_graphs` wrote into a folder, for the manifest."""

    reports: dict = field(default_factory=dict)  # artifact key of an unfolded graph -> its fold report
    graphs: dict = field(default_factory=dict)  # artifact key -> opset and norm ops of that graph
    timings: dict = field(default_factory=lambda: {"torch_export_s": 0.0, "passes_s": 0.0, "write_s": 0.0})


def export_graphs(
    sources: list[tuple[str, nn.Module]], folder: Path, opts: ExportOptions, on_stage=lambda name: None
) -> ExportedGraphs:
    """Export each (variant, model) of `sources` ("baseline" and/or "unfolded") into `folder`, and the
    KV-cache decoders `opts.caches` names; an unfolded graph is also folded and written as `folded`. The fold
    reports name norms by their paths in the model's `network`, as the family does."""
    from taperfold.passes import fold_model

    out = ExportedGraphs()
    timings = out.timings
    for decoder in (False, *opts.caches):
        choice = choose_opset(opts.target, "decoder" if decoder else "prefill", opts.opset)
        for variant, model in sources:
            name = exportdir.artifact_key(variant, decoder)
            on_stage(f"exporting {name} (opset {choice.opset})")
            t0 = time.perf_counter()
            model_ir = export_to_ir(model, opts, decoder, opset=choice.opset)
            if fallback := without_fused_rotary(choice, {n.op_type for n in model_ir.graph}):
                choice = fallback  # and for the rest of this group: every variant shares the RoPE
                on_stage(f"exporting {name} (opset {choice.opset}: fused RotaryEmbedding avoided)")
                model_ir = export_to_ir(model, opts, decoder, opset=choice.opset)
            timings["torch_export_s"] += time.perf_counter() - t0
            if variant == BASELINE:
                t0 = time.perf_counter()
                projections = _fuse_projections(model_ir, opts, _network_prefix(model, decoder))
                timings["passes_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                _write_baselines(model_ir, folder, decoder, choice, opts.target, out.graphs, projections)
                timings["write_s"] += time.perf_counter() - t0
                continue
            t0 = time.perf_counter()
            # written aside first: the plain norms the taper keeps (Internal-Taper's final norm) get the
            # baseline's fused form, but only after the fold, whose onnx.checker run knows no ONNX Runtime op
            staged = folder / ("." + onnx_file(variant, decoder))
            _save(model_ir, staged)
            timings["write_s"] += time.perf_counter() - t0
            on_stage(f"folding {name}")
            t0 = time.perf_counter()
            out.reports[name] = _network_names(fold_model(model_ir).to_dict(), model, decoder)
            timings["passes_s"] += time.perf_counter() - t0
            for graph_ir, written in ((model_ir, FOLDED), (_load(staged), UNFOLDED)):
                t0 = time.perf_counter()
                projections = _fuse_projections(graph_ir, opts, _network_prefix(model, decoder))
                timings["passes_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                fused = _fuse(graph_ir, opts.target)
                out.graphs[exportdir.artifact_key(written, decoder)] = _graph_info(graph_ir, choice, fused, projections)
                _save(graph_ir, folder / onnx_file(written, decoder))
                timings["write_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            for path in (staged, staged.with_name(staged.name + ".data")):
                path.unlink()
            timings["write_s"] += time.perf_counter() - t0
    return out


def _network_prefix(model: TaperedLM, decoder: bool) -> str:
    """What the export wrappers put in front of the module paths of the model's network."""
    return (_Decoder.prefix if decoder else "") + (f"{model.network_path}." if model.network_path else "")


def _network_names(report: dict, model: TaperedLM, decoder: bool) -> dict:
    """Norm names (and the producers a backward fold names) as paths in the model's network: without what the export
    wrappers put in front."""
    prefix = _network_prefix(model, decoder)
    for entry in report["norms"]:
        entry["name"] = entry["name"].removeprefix(prefix)
        if prefix:
            entry["reason"] = entry["reason"].replace(f"({prefix}", "(")
    return report


def _fuse(model_ir, target: str) -> int:
    """Fuse decomposed RMSNorms into one op for ONNX Runtime; the number fused (0 for TensorRT)."""
    from taperfold.passes.fuse_norm import fuse_rms_norms

    return fuse_rms_norms(model_ir) if fuses_norms(target) else 0


def _fuse_projections(model_ir, opts: ExportOptions, prefix: str) -> dict | None:
    """Fuse the projections of one graph when `opts` asks, else None; the report names modules as paths in the
    model's network (without `prefix`)."""
    if not opts.fuse_projections:
        return None
    from taperfold.passes import FuseProjectionsPass, ProjectionReport

    report = ProjectionReport()
    FuseProjectionsPass(report)(model_ir)
    for group in report.groups:
        group.modules = [module.removeprefix(prefix) for module in group.modules]
    return report.to_dict()


def _graph_info(model_ir, choice: OpsetChoice, fused: int, projections: dict | None) -> dict:
    """The manifest's words on one graph: its opset and why, the fused norm ops it runs, and its fused projections
    (None: not asked for)."""
    ops = {op: sum(1 for n in model_ir.graph if n.op_type == op) for kind in norm_kinds() for op in kind.fused_ops}
    return {
        **choice.to_dict(),
        "norm_ops": {k: v for k, v in ops.items() if v},
        "norms_fused_by_taperfold": fused,
        "projections": projections,
    }


def _write_baselines(
    model_ir, folder: Path, decoder: bool, choice: OpsetChoice, target: str, graphs: dict, projections: dict | None
) -> None:
    """baseline.onnx in its fused form and, when its norms export as plain ops (RMSNorm),
    baseline.decomposed.onnx with those.

    Below opset 23 the export holds RMSNorm as plain ops, fused afterwards (for ONNX Runtime; TensorRT's parser
    takes no ONNX Runtime op, so there it stays decomposed and is written once); at 23 the exporter fused it,
    and the decomposed file is the fused graph expanded back (passes/fuse_norm.py). LayerNorm exports as
    LayerNormalization at every opset: nothing to fuse or expand.
    """
    from taperfold.passes.fuse_norm import count_rms_norms, expand_rms_norms

    def write(variant: str, fused: int = 0) -> None:
        graphs[exportdir.artifact_key(variant, decoder)] = _graph_info(model_ir, choice, fused, projections)
        _save(model_ir, folder / onnx_file(variant, decoder))

    fuse_after_export = choice.opset < FUSING_OPSET and fuses_norms(target) and count_rms_norms(model_ir) > 0
    if fuse_after_export:
        write(exportdir.DECOMPOSED_BASELINE)
    write(BASELINE, _fuse(model_ir, target) if fuse_after_export else 0)
    if choice.opset >= FUSING_OPSET and expand_rms_norms(model_ir):
        write(exportdir.DECOMPOSED_BASELINE)


def _check_gate(source: ModelSource, opts: ExportOptions) -> None:
    if not source.tapered or source.gate == 0.0:
        return
    if not opts.force_gate0:
        raise TaperfoldError(
            f"{source.path}: gate is {source.gate:g}, not 0: its tapered norms still use per-token "
            "statistics, so folding changes the function; train to the end of the taper, or "
            "pass --force-gate0 to export at g = 0 anyway (`taperfold verify` then reports the cost)"
        )


def _manifest(
    source: ModelSource, ckpt_path: Path, opts: ExportOptions, folder: Path, exported: ExportedGraphs
) -> dict:
    artifacts = exportdir.describe_artifacts(folder)
    for key, info in exported.graphs.items():
        artifacts[key].update(info)
    manifest = exportdir.new_manifest(
        checkpoint={"path": str(ckpt_path.resolve()), "sha256": checkpoint_digest(ckpt_path), "step": source.step},
        config=source.config.to_dict(),
        gate=source.gate,
        forced_gate0=source.tapered and source.gate != 0.0,
        export={
            "logits": opts.logits,
            "dtype": opts.dtype,
            "target": opts.target,
            "opset": opts.opset,  # the --opset override, or None: per graph from the table (see artifacts)
            "kv_cache": list(opts.caches),
            "max_cache": static_cache_length(source.config, opts) if STATIC in opts.caches else None,
            "fuse_projections": opts.fuse_projections,
            "inputs": [INPUT],
            "outputs": [OUTPUT],
        },
        versions=package_versions(),
        artifacts=artifacts,
        fold_report=exported.reports.get(UNFOLDED),
        decoder_fold_report=exported.reports.get(exportdir.artifact_key(UNFOLDED, GROWING)),
        static_fold_report=exported.reports.get(exportdir.artifact_key(UNFOLDED, STATIC)),
        timings=exported.timings,
    )
    manifest.update(source.manifest_block())
    if not source.tapered:
        manifest["note"] = NOTHING_TO_FOLD.format(path=ckpt_path)
    return manifest
