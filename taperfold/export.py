"""`taperfold export`: a model source (taperfold.sources) → ONNX (baseline, unfolded, folded) + manifest.json.

The tapered model is exported once at g = 0 with the torch dynamo exporter; its graph holds each
tapered norm as plain ops (`Mul` by c, `Mul` by γ̃; LN adds mean subtraction and `Add` β) tagged with
the module path in the node metadata. That graph is written as `unfolded.onnx`, then the passes in
`taperfold.passes` fold the norms into their readers and the result is written as `model.onnx`.
`baseline.onnx` is the same weights with the model's own untapered norms, in the fastest form the
target runs (one fused norm op: the benchmark's reference); `baseline.decomposed.onnx` keeps RMSNorm as
the plain ops hand-written norms export to (docs/opsets.md). The baseline differs from the unfolded model in
its norms alone, so its graph is made from the unfolded trace by putting each real norm back where its constant
map is (passes/restore_norms.py: one trace per graph kind, the manifest's `built_from` says so); it is traced
itself where that cannot be done (float16/bfloat16 graphs, gated norms, DyT). A plain (untapered) model gets its
baseline only: there is nothing to fold.

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
  transformers' StaticCache (hf/model.py), sliding-window layers keeping every position, unless their cache has
  layers that hold more than keys and values (an indexer's keys: STATIC_CACHE_REFUSED).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx_ir as ir
import torch
from torch import nn

from taperfold import interrupts
from taperfold.artifacts import all_kinds, artifact_kind, in_build_order, reads_graphs
from taperfold.artifacts.base import ArtifactKind, ArtifactRecord
from taperfold.artifacts.onnx_graph import ONNX_GRAPH, OnnxDetails
from taperfold.errors import TaperfoldError
from taperfold.export_manifest import export_manifest
from taperfold.exportdir import (
    BASELINE,
    DECOMPOSED_BASELINE,
    DTYPES,
    FOLDED,
    KV_CACHES,
    LOGITS,
    PREFILL,
    STATIC,
    UNFOLDED,
    Graph,
    graph_key,
    onnx_file,
    torch_dtype,
)
from taperfold.fsutil import Output, atomic_dir, check_outputs
from taperfold.layer_trace import MIN_LAYERS, few_layer_model, why_trace_every_layer
from taperfold.manifest import Manifest, is_export_dir, read_manifest
from taperfold.nn import TaperedNorm
from taperfold.norms import is_norm_module, norm_kinds, tapered_kind
from taperfold.opsets import (
    FUSING_OPSET,
    OpsetChoice,
    choose_opset,
    fuses_norms,
    runs_contrib_ops,
)
from taperfold.passes.fuse_norm import ExpandRMSNormalizationPass, count_rms_norms
from taperfold.passes.pipeline import Pipeline, Step
from taperfold.passes.restore_norms import RealNorm, RestoreNormsPass
from taperfold.passes.stamp_layers import StampLayersPass
from taperfold.sources import ModelSource, open_source
from taperfold.taper import TaperedLM
from taperfold.tracing import (
    GRAPH_SPECS,
    MIN_CONTEXT,
    ExportOptions,
    export_any_attention,
    forget_matched_graphs,
    opset_graph,
)


@dataclass
class ExportResult:
    out_dir: Path
    manifest: Manifest
    timings: dict = field(default_factory=dict)


STATIC_CACHE_REFUSED = (
    "{path}: --kv-cache static: the model's transformers cache has layers that hold more than keys and values "
    "(an indexer's keys), which taperfold's static decoders do not carry; use --kv-cache growing"
)


@dataclass(frozen=True)
class HowTraced:
    """How a graph was traced, where the manifest says so: with eager attention (why), or its first layers alone."""

    eager_attention: str | None = None  # why the trace took the plain MatMul and Softmax form (None: it did not)
    traced_layers: int | None = None  # layers traced, the others stamped out from them (None: every layer traced)


def _trace(
    model: TaperedLM, opts: ExportOptions, graph: Graph, opset: int, name: str, on_stage, clock: StageClock
) -> tuple[ir.Model, HowTraced]:
    """Graph `graph` of `model`: traced from its first layers and the rest stamped out where its layers are alike
    (taperfold.layer_trace, passes/stamp_layers.py; the stage says so, and why not where they differ), else traced
    whole."""
    why = why_trace_every_layer(model) if opts.stamp_layers else "--trace-every-layer"
    if why is None:
        scope = GRAPH_SPECS[graph].module_prefix + str(model.layers_path)
        few, layers = few_layer_model(model, scope)
        with clock("torch_export_s"):
            model_ir, eager = export_any_attention(few, opts, graph, opset, name, on_stage)
        stamp = Pipeline(model_ir, stamp_layers=layers)
        stamp.run(clock=clock)
        why = stamp[StampLayersPass].refused
        if why is None:
            on_stage(f"{name}: traced {layers.in_trace} of {layers.count} layers, the others stamped out from them")
            return model_ir, HowTraced(eager, layers.in_trace)
    if model.cfg.n_layers >= MIN_LAYERS:
        on_stage(f"{name}: tracing every layer ({why})")
    with clock("torch_export_s"):
        model_ir, eager = export_any_attention(model, opts, graph, opset, name, on_stage)
    return model_ir, HowTraced(eager)


def check_options(opts: ExportOptions) -> None:
    """A bad --dtype, --logits, --target, --opset, --kv-cache or --max-cache fails before any work."""
    if opts.dtype not in DTYPES:
        raise TaperfoldError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
    if opts.logits not in LOGITS:
        raise TaperfoldError(f"--logits must be 'last' or 'all', got {opts.logits!r}")
    unknown = [str(cache) for cache in opts.decoders if cache not in KV_CACHES]
    if unknown:
        raise TaperfoldError(
            f"--kv-cache must be {' or '.join(KV_CACHES)} (or both, comma-separated), got {','.join(unknown)}"
        )
    choose_opset(opts.target, "prefill", opts.opset)
    if opts.ort_fusions and not runs_contrib_ops(opts.target):
        raise TaperfoldError(
            f"--ort-fusions writes ONNX Runtime's own ops (com.microsoft), which --target {opts.target} cannot run"
        )
    if opts.max_cache is not None:
        if STATIC not in opts.decoders:
            raise TaperfoldError(
                f"--max-cache {opts.max_cache}: only a static cache has a length; add --kv-cache static"
            )
        if opts.max_cache < MIN_CONTEXT:
            raise TaperfoldError(
                f"--max-cache must be {MIN_CONTEXT} or more (a prompt and a step), got {opts.max_cache}"
            )
    if not opts.onnx:
        _check_without_graphs(opts)
    for name, request in opts.artifacts.items():
        kind = artifact_kind(name)
        if type(kind).build is ArtifactKind.build:
            raise TaperfoldError(f"artifact kind {name!r} is written by export itself: it takes no request")
        if not isinstance(request, kind.request_type):
            raise TaperfoldError(
                f"artifact kind {name!r} takes a {kind.request_type.__name__} request, not {type(request).__name__}"
            )
        kind.check_request(request, opts)


def _check_without_graphs(opts: ExportOptions) -> None:
    """--no-onnx: no option that shapes the graphs, no kind made from them, and a kind that is not (else nothing would
    be written)."""
    graph_options = {
        "--kv-cache": bool(opts.decoders),
        "--opset": opts.opset is not None,
        "--ort-fusions": opts.ort_fusions,
        "--trace-every-layer": not opts.stamp_layers,
    }
    for flag, given in graph_options.items():
        if given:
            raise TaperfoldError(f"{flag} shapes the ONNX graphs, which --no-onnx does not write: drop one of them")
    for name in opts.artifacts:
        if reads_graphs(name):
            kind = artifact_kind(name)
            asked = kind.options[0].flag if kind.options else f"artifact kind {name!r}"
            raise TaperfoldError(f"{asked} is made from the ONNX graphs, which --no-onnx does not write")
    if not opts.artifacts:
        flags = [kind.options[0].flag for kind in all_kinds() if kind.options and not reads_graphs(kind.name)]
        raise TaperfoldError(
            f"--no-onnx leaves nothing to write: ask for a folder converted from the model ({', '.join(flags)})"
        )


def _planned(opts: ExportOptions, source: ModelSource, tapered: TaperedLM | None) -> ExportOptions:
    """`opts` with each artifact's request planned for `source` (ArtifactKind.plan: the genai route decided once),
    in build order, and the decoders asked for joined by those the planned requests are built from (--genai's
    traced route: a growing cache; its builder route needs none), in KV_CACHES order."""
    artifacts = {
        name: artifact_kind(name).plan(opts.artifacts[name], source, tapered, opts.dtype)
        for name in in_build_order(opts.artifacts)
    }
    needed = {graph for name, request in artifacts.items() for graph in artifact_kind(name).needed_graphs(request)}
    decoders = tuple(graph for graph in KV_CACHES if graph in needed or graph in opts.decoders)
    return replace(opts, decoders=decoders, artifacts=artifacts)


def _check_caches(source: ModelSource, model: TaperedLM, opts: ExportOptions) -> None:
    if opts.decoders and not model.kv_cache:
        raise TaperfoldError(
            f"{source.path}: --kv-cache: the model's transformers cache keeps recurrent states (linear attention, "
            "Mamba) beside keys and values, which taperfold's decoders do not carry; export without --kv-cache "
            "(its prefill graph takes any length)"
        )
    if STATIC not in opts.decoders:
        return
    if not model.static_cache:
        raise TaperfoldError(STATIC_CACHE_REFUSED.format(path=source.path))
    if opts.max_cache is not None and opts.max_cache > source.config.max_seq_len:
        raise TaperfoldError(
            f"--max-cache {opts.max_cache} exceeds the model's context (max_seq_len "
            f"{source.config.max_seq_len}): positions beyond it have no embedding"
        )


def export_to_dir(
    ckpt_path: str | Path, out_dir: str | Path, opts: ExportOptions, *, overwrite: bool = False, quiet: bool = False
) -> ExportResult:
    """`export_checkpoint` as `taperfold export` runs it: the options, then `out_dir` checked before any work (an
    existing directory is replaced only if it is an export, or with `overwrite`), the current stage shown on a
    terminal unless `quiet`, and a signal stopping it at the next stage."""
    from taperfold.ui import stage_status

    check_options(opts)
    check_outputs(
        [Output(out_dir, "-o", directory="taperfold export", owned=is_export_dir, overwrite=overwrite)],
        inputs=[ckpt_path],
    )
    with stage_status(quiet=quiet) as show_stage:

        def on_stage(name: str) -> None:
            interrupts.check()  # stops here even if a library swallowed the KeyboardInterrupt
            show_stage(name)

        return export_checkpoint(ckpt_path, out_dir, opts, on_stage=on_stage)


def export_checkpoint(
    ckpt_path: str | Path, out_dir: str | Path, opts: ExportOptions, on_stage=lambda name: None
) -> ExportResult:
    """Write baseline.onnx, unfolded.onnx, model.onnx (folded) and manifest.json into `out_dir`, then build the
    artifacts `opts.artifacts` asks for (a TensorRT engine, a plug-in's kind) from them: all or nothing. Without
    `opts.onnx`, no graph: the manifest and the artifacts converted from the model itself."""
    started = time.perf_counter()
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
    sources: list[
        tuple[str, TaperedLM]
    ] = []  # (variant, model); the folded graphs are the unfolded ones after the passes
    if opts.onnx and (opts.baseline or not source.tapered):
        sources.append((BASELINE, source.build_baseline().to(dtype)))
    if source.tapered:
        sources.append((UNFOLDED, source.build(gate=0.0).to(dtype)))
    _check_fits([model for _, model in sources], opts.dtype, ckpt_path)
    opts = _planned(opts, source, dict(sources).get(UNFOLDED))
    if sources:
        _check_caches(source, sources[0][1], opts)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        if opts.onnx:
            with source.export_context():
                exported = export_graphs(sources, tmp, opts, on_stage)
        else:
            exported = ExportedGraphs()
        on_stage("writing manifest")
        manifest = export_manifest(source, ckpt_path, opts, tmp, exported.records, exported.clock.seconds)
        manifest.write()
        # the models and the source's tensors let go (a tapered model's modules refer to each other: collected now)
        # before the artifacts are built: a kind that reads the source again (--vllm) would map the model twice
        del source, sources
        forget_matched_graphs()  # OrtFusionsPass's rules ran after the last trace
        gc.collect()
        for kind, request in opts.artifacts.items():  # in build order (_planned)
            on_stage(f"building {artifact_kind(kind).title}")
            manifest.build(kind, request, on_stage)
        manifest.timings = manifest.timings.with_total(time.perf_counter() - started)
        manifest.write()
        read_manifest(tmp)  # what it lists, checked before the directory takes its place (--no-onnx: a folder)
    return ExportResult(out_dir, read_manifest(out_dir), exported.clock.seconds)


_WIDER_RANGE = {"fp16": "export with --dtype bf16 or fp32", "bf16": "export with --dtype fp32"}


def _check_fits(models: Sequence[nn.Module], dtype: str, ckpt_path: Path) -> None:
    """Every weight still finite once cast to the export's dtype: a value past its range (a DyT alpha of 1e5 in fp16,
    3.4e38 in bf16, a float64 checkpoint's 1e300 in fp32) would be written as Inf, which the checkpoint (checked
    finite when read) did not hold."""
    for model in models:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                limit = torch.finfo(tensor.dtype).max
                remedy = _WIDER_RANGE.get(dtype, "no export dtype holds it")
                raise TaperfoldError(
                    f"{ckpt_path}: '{name}' holds values beyond {dtype}'s range (±{limit:.6g}): {remedy}"
                )


class StageClock:
    """Where an export's time goes: seconds per stage, each measured by one context manager (`with clock(stage):`);
    STAGES always (0 where nothing ran), a stage an option adds (ort_fusions_s) once it ran."""

    STAGES = ("torch_export_s", "passes_s", "write_s")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.STAGES, 0.0)

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start  # an option's stage: new


@dataclass
class ExportedGraphs:
    """What `export_graphs` wrote into a folder: a record per graph (taperfold.artifacts.onnx_graph), and the time."""

    records: list[ArtifactRecord] = field(default_factory=list)
    clock: StageClock = field(default_factory=StageClock)


def projections_report(pipeline: Pipeline, prefix: str) -> dict | None:
    """What FuseProjectionsPass fused (None: not asked for), modules named as paths in the model's network (without
    what the export wrappers put in front, `prefix`)."""
    if pipeline.projections is None:
        return None
    for group in pipeline.projections.groups:
        group.modules = [module.removeprefix(prefix) for module in group.modules]
    return pipeline.projections.to_json()


def graph_details(
    model_ir: ir.Model,
    choice: OpsetChoice,
    passes: Pipeline | None,
    projections: dict | None,
    traced: HowTraced | None = None,
) -> OnnxDetails:
    """The manifest's words on one graph (the ONNX kind's details): its opset and why, the fused norm ops it runs, the
    norms export fused, its fused projections (None: not asked for), ONNX Runtime's fusions (where they ran), and how
    it was traced where that differs from the plain trace of every layer."""
    ops = {op: sum(1 for n in model_ir.graph if n.op_type == op) for kind in norm_kinds() for op in kind.fused_ops}
    return OnnxDetails(
        opset=choice.opset,
        opset_source=choice.source,
        opset_reason=choice.reason,
        norm_ops={k: v for k, v in ops.items() if v},
        norms_fused_by_taperfold=passes.norms_fused if passes else 0,
        projections=projections,
        # only where they ran: a manifest without the option reads as before it existed
        ort_fusions=passes.ort_fused if passes else None,
        ort_fusions_skipped=(passes.ort_fusions_skipped or None) if passes else None,
        eager_attention=(traced.eager_attention or None) if traced else None,
        traced_layers=(traced.traced_layers or None) if traced else None,
    )


def graph_pipeline(
    opts: ExportOptions,
    variant: str,
    opset: int,
    model_ir: ir.Model,
    restore_norms: dict[str, RealNorm] | None = None,
) -> Pipeline:
    """The pipeline of one graph (passes/pipeline.py), as the options ask: for the folded graph the fold (the unfolded
    trace becomes the folded graph); for every graph fused projections (--fuse-projections), decomposed RMSNorms
    fused into one op (where the target runs ONNX Runtime's op) and ONNX Runtime's LLM fusions (--ort-fusions); for a
    baseline made from the unfolded trace its norms restored first (`restore_norms`). A baseline's norms are fused
    below opset 23 alone: from 23 the exporter wrote them fused, and the decomposed baseline is that graph with each
    RMSNormalization expanded, last."""
    baseline = variant == BASELINE
    return Pipeline(
        model_ir,
        restore_norms=restore_norms,
        fold=variant == FOLDED,
        fuse_projections=opts.fuse_projections,
        fuse_norms=fuses_norms(opts.target) and not (baseline and opset >= FUSING_OPSET),
        ort_fusions=opts.ort_fusions,
        expand_norms=baseline and opset >= FUSING_OPSET,
    )


def export_graphs(
    sources: Sequence[tuple[str, TaperedLM]], folder: Path, opts: ExportOptions, on_stage=lambda name: None
) -> ExportedGraphs:
    """Export each (variant, model) of `sources` ("baseline" and/or "unfolded") into `folder`, and the
    KV-cache decoders `opts.decoders` names; an unfolded graph is also folded and written as `folded`. The fold
    reports name norms by their paths in the model's `network`, as the family does."""
    out = ExportedGraphs()
    clock = out.clock
    models = dict(sources)
    for graph in (PREFILL, *opts.decoders):
        choice = choose_opset(opts.target, opset_graph(graph), opts.opset, ort_fusions=opts.ort_fusions)
        # the unfolded model first: the baseline's graph is made from its trace where the norms allow
        restorable = _baseline_norms(models, graph, opts)
        derived = False
        for variant, model in sorted(sources, key=lambda pair: pair[0] != UNFOLDED):
            name = graph_key(variant, graph)
            if variant == BASELINE and derived:
                continue
            on_stage(f"exporting {name} (opset {choice.opset})")
            model_ir, traced = _trace(model, opts, graph, choice.opset, name, on_stage, clock)
            prefix = _network_prefix(model, graph)
            if variant == BASELINE:
                baseline = graph_pipeline(opts, BASELINE, choice.opset, model_ir)
                out.records += _write_baselines(baseline, folder, graph, choice, opts, clock, prefix, traced)
                continue
            # written aside first: the folded graph is made from the unfolded one in place, and the unfolded
            # graph then read back (its weights lazily) for its own passes; two copies are never held
            staged = folder / ("." + onnx_file(variant, graph))
            with clock("write_s"):
                _save(model_ir, staged)
            if restorable:
                baseline_ir = _load(staged)
                baseline = graph_pipeline(opts, BASELINE, choice.opset, baseline_ir, restore_norms=restorable)
                baseline.run(until=Step.RESTORE_NORMS, clock=clock)
                missing = baseline[RestoreNormsPass].missing
                if not missing:
                    on_stage(f"{graph_key(BASELINE, graph)}: made from {name}, its norms restored (no trace)")
                    records = _write_baselines(baseline, folder, graph, choice, opts, clock, prefix, traced)
                    for record in records:
                        record.built_from = name
                    out.records += records
                    derived = True
                else:  # traced in its turn; say why, as the stage it adds shows
                    on_stage(f"{graph_key(BASELINE, graph)}: traced ({missing[0]}: not found as its map)")
                del baseline_ir, baseline
            on_stage(f"folding {name}")
            folding = graph_pipeline(opts, FOLDED, choice.opset, model_ir)
            folding.run(clock=clock)
            assert folding.fold is not None
            report = _network_names(folding.fold.to_json(), prefix)
            details = graph_details(model_ir, choice, folding, projections_report(folding, prefix), traced)
            with clock("write_s"):
                folded = ONNX_GRAPH.write(model_ir, folder, FOLDED, graph, opts.dtype, details)
            folded.built_from, folded.reports["fold"] = name, report
            unfolded_ir = _load(staged)
            passes = graph_pipeline(opts, UNFOLDED, choice.opset, unfolded_ir)
            passes.run(clock=clock)
            details = graph_details(unfolded_ir, choice, passes, projections_report(passes, prefix), traced)
            with clock("write_s"):
                unfolded = ONNX_GRAPH.write(unfolded_ir, folder, UNFOLDED, graph, opts.dtype, details)
                for path in (staged, staged.with_name(staged.name + ".data")):
                    path.unlink()
            out.records += [unfolded, folded]
    return out


def _baseline_norms(models: dict[str, TaperedLM], graph: Graph, opts: ExportOptions) -> dict[str, RealNorm]:
    """Each tapered norm of the unfolded model as the real norm the baseline model has in its place, by its name in
    the traced graph (RestoreNormsPass); empty where the baseline is traced instead: not both models asked for, a
    graph other than float32, or a norm of a form the pass does not write (a gated or grouped norm, DyT)."""
    unfolded, baseline = models.get(UNFOLDED), models.get(BASELINE)
    if unfolded is None or baseline is None or opts.dtype != "fp32":
        return {}
    wrapper = GRAPH_SPECS[graph].module_prefix
    norms = {}
    for path, module in unfolded.named_modules():
        kind = tapered_kind(module)
        if kind is None:
            continue
        try:
            plain = baseline.get_submodule(path)
        except AttributeError:
            return {}
        if not isinstance(module, TaperedNorm) or type(module) is not kind.tapered or not kind.gated:
            return {}  # a gated norm (its own subclass) or DyT
        # γ and β as the baseline's module holds them: a norm class without β (Cohere's LayerNorm) drops the one the
        # tapered norm trained; the form (centring, gain offset, epsilon) is the one the tapering measured
        weight, bias = getattr(plain, "weight", None), getattr(plain, "bias", None)
        gain = weight.detach().double() if isinstance(weight, torch.Tensor) else torch.ones(module.dim).double()
        shift = bias.detach().double() if isinstance(bias, torch.Tensor) else None
        if not is_norm_module(plain) or gain.shape != (module.dim,) or (shift is not None and not kind.shift):
            return {}
        with torch.no_grad():
            constant = kind.constant_map(module)
        norms[wrapper + path] = RealNorm(
            centered=kind.centered,
            gain=module.gain(gain).cpu().numpy(),
            bias=shift.cpu().numpy() if shift is not None else None,
            eps=float(module.eps),
            constant_scale=constant.scale.cpu().numpy(),
            constant_bias=constant.bias.cpu().numpy() if constant.bias is not None else None,
            module_class=(_class_name(module), _class_name(plain)),
        )
    return norms


def _class_name(module: nn.Module) -> str:
    """A module's class as the exporter's metadata names it."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _save(model_ir, path: Path) -> None:
    ir.save(model_ir, path, external_data=path.name + ".data")


def _load(path: Path) -> ir.Model:
    """A graph just written, its weights read lazily."""
    return ir.load(path)


def _network_prefix(model: TaperedLM, graph: Graph) -> str:
    """What the export wrappers put in front of the module paths of the model's network."""
    wrapper = GRAPH_SPECS[graph].module_prefix
    return wrapper + (f"{model.network_path}." if model.network_path else "")


def _network_names(report: dict, prefix: str) -> dict:
    """Norm names (and the producers a backward fold names) as paths in the model's network: without what the export
    wrappers put in front (`prefix`)."""
    for entry in report["norms"]:
        entry["name"] = entry["name"].removeprefix(prefix)
        if prefix:
            entry["reason"] = entry["reason"].replace(f"({prefix}", "(")
    return report


def _write_baselines(
    pipeline: Pipeline,
    folder: Path,
    graph: Graph,
    choice: OpsetChoice,
    opts: ExportOptions,
    clock: StageClock,
    prefix: str,
    traced: HowTraced,
) -> list[ArtifactRecord]:
    """baseline.onnx in its fused form and, when its norms export as plain ops (RMSNorm),
    baseline.decomposed.onnx with those: the baseline's graph `pipeline.model` run through its `pipeline`
    (graph_pipeline), written where it holds each (`traced`: how the graph was traced).

    Below opset 23 the export holds RMSNorm as plain ops, fused afterwards (for ONNX Runtime; TensorRT's parser
    takes no ONNX Runtime op, so there it stays decomposed and is written once); at 23 the exporter fused it,
    and the decomposed file is the fused graph expanded back (passes/fuse_norm.py). LayerNorm exports as
    LayerNormalization at every opset: nothing to fuse or expand.
    """
    records = []
    model_ir = pipeline.model
    pipeline.run(until=Step.FUSE_PROJECTIONS, clock=clock)  # fused projections, as in every graph
    projections = projections_report(pipeline, prefix)

    def write(variant: str, passes: Pipeline | None = None) -> None:
        details = graph_details(model_ir, choice, passes, projections, traced)
        with clock("write_s"):
            records.append(ONNX_GRAPH.write(model_ir, folder, variant, graph, opts.dtype, details))

    if Step.FUSE_NORMS in pipeline.steps and count_rms_norms(model_ir) > 0:
        write(DECOMPOSED_BASELINE)  # before ONNX Runtime's fusions too: they would fuse its norms
    pipeline.run(until=Step.ORT_FUSIONS, clock=clock)
    write(BASELINE, pipeline)
    pipeline.run(clock=clock)
    expand = pipeline.get(ExpandRMSNormalizationPass)  # ONNX Runtime's fusions leave an opset-23 graph as it is
    if expand and expand.expanded:
        write(DECOMPOSED_BASELINE)
    return records


def _check_gate(source: ModelSource, opts: ExportOptions) -> None:
    if not source.tapered or source.gate == 0.0:
        return
    if not opts.force_gate0:
        raise TaperfoldError(
            f"{source.path}: gate is {source.gate:g}, not 0: its tapered norms still use per-token "
            "statistics, so folding changes the function; train to the end of the taper, or "
            "pass --force-gate0 to export at g = 0 anyway (`taperfold verify` then reports the cost)"
        )
