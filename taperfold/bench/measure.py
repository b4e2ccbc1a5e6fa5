"""One benchmark run: load every variant up front, then measure each cell in alternating rounds."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from taperfold.bench.against import CONTENDERS, check_contenders, contender, prepare_contender
from taperfold.bench.harness import CellSamples, Job, Schedule, run_rounds
from taperfold.bench.report import GENERATION, BenchReport, BenchRow, BenchSettings, Timing
from taperfold.bench.source import Source
from taperfold.bench.stats import summarize
from taperfold.engines import ENGINES, Engine, check_options, engine, open_runners
from taperfold.environment import machine_info
from taperfold.errors import TaperfoldError
from taperfold.exportdir import (
    ALL_VARIANTS,
    BASELINE,
    DECOMPOSED_BASELINE,
    GRAPH_TYPES,
    GRAPHS,
    GROWING,
    INPUT,
    KV_CACHES,
    PREFILL,
    STATIC,
    VARIANTS,
    Graph,
    check_graph,
    torch_dtype,
)
from taperfold.models import ModelConfig
from taperfold.runners.base import PIPELINED, SYNCED, Runner
from taperfold.taper import ModelShape
from taperfold.tracing import MAX_EXPORT_BATCH
from taperfold.variants import build_variants, fused_group_count


def cv_threshold_pct(device: str) -> float:
    """trtexec warns above 1 % on a dedicated GPU; a shared CPU drifts more, so 5 % there."""
    return 1.0 if device.startswith("cuda") else 5.0


DEFAULT_SEQS = (128, 256, 512)  # prefill lengths, and the decode prompt, when none is given: capped to the context
DEFAULT_PROMPT = 128
DEFAULT_NEW_TOKENS = 32
MAX_BATCH = MAX_EXPORT_BATCH
# The choice an option leaves to bench when the user makes none: --kv-cache (static where the export, or for torch the
# model, has static decoders) and --fuse-projections (as the export in DIR did; unfused for a checkpoint or preset)
AUTO = "auto"
FUSED, UNFUSED = "fused", "unfused"  # --fuse-projections / --no-fuse-projections


@dataclass
class BenchOptions:
    engine: str = "ort"
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))  # canonical names
    batches: list[int] = field(default_factory=lambda: [1, 4])
    seqs: list[int] = field(default_factory=lambda: list(DEFAULT_SEQS))
    warmup: int = 10
    iters: int = 50
    rounds: int = 5
    mode: str = "prefill"  # prefill | decode
    prompt: int = DEFAULT_PROMPT  # decode: prompt length
    new_tokens: int = DEFAULT_NEW_TOKENS  # decode: decode steps after the prompt
    kv_cache: str = AUTO  # decode: "static" | "growing" | AUTO
    dtype: str | None = None  # None: fp32 for torch, the export's dtype for ort / trt
    device: str = "cpu"
    threads: int | None = None  # None: torch's default (the physical cores), used for every engine
    engine_options: dict = field(default_factory=dict)  # runner keyword options the user set (engines.Option)
    seed: int = 0
    fuse_projections: str = AUTO  # torch: sibling projections as one layer: FUSED | UNFUSED | AUTO
    precision: str | None = None  # the exported artifacts' precision (int4, int8: export --quantize); None: the dtype
    against: list[str] = field(default_factory=list)  # contenders built by other tools (bench.against)

    @property
    def schedule(self) -> Schedule:
        # prefill calls are timed both ways; a decode sample is a whole generation, each step synced
        return Schedule(self.warmup, self.iters, self.rounds, pipelined=self.mode == "prefill")


def cells(opts: BenchOptions) -> list[tuple[int, int]]:
    """(batch, tokens per sequence) in the order measured: prompt length in decode mode."""
    lengths = [opts.prompt] if opts.mode == "decode" else opts.seqs
    return [(b, s) for b in opts.batches for s in lengths]


def fit_to_context(
    opts: BenchOptions, source: Source, seqs_given: bool, prompt_given: bool, new_tokens_given: bool = True
) -> tuple[BenchOptions, list[str]]:
    """Default lengths capped to what the model's context holds (in decode mode with a static cache: what the cache
    holds), with a note saying so: the default prompt shortened first, then, where even a 1-token prompt leaves no
    room for the default --new-tokens, the room split between the two; a default --new-tokens shortened to fit after
    a given prompt; lengths the user gave are kept as given (and
    refused by `_check` or `decode_cache` if they do not fit)."""
    chosen = engine(opts.engine)
    _check_request(chosen, source, opts)
    context, notes = source.config.max_seq_len, []
    static = _fixed_cache_length(source, _chosen_cache(chosen, source, opts)) if opts.mode == "decode" else None
    if opts.mode == "prefill" and not seqs_given:
        fit = [s for s in opts.seqs if s <= context]
        if len(fit) < len(opts.seqs):
            fit = fit or [context]
            notes.append(
                f"--seq: the defaults {','.join(map(str, opts.seqs))} are capped at the model's context "
                f"({context}): timing {','.join(map(str, fit))}"
            )
            opts = replace(opts, seqs=fit)
    room, what = (static, "static cache (export --max-cache)") if static else (context, "model's context")
    room -= _kept_token(chosen, opts)
    if opts.mode == "decode" and not prompt_given and opts.prompt + opts.new_tokens > room:
        prompt, new_tokens = room - opts.new_tokens, opts.new_tokens
        if prompt < 1 and not new_tokens_given and room >= 2:
            new_tokens = room // 2
            prompt = room - new_tokens
        if prompt >= 1:
            said = "" if new_tokens == opts.new_tokens else f", --new-tokens {new_tokens}"
            notes.append(
                f"--prompt: the default {opts.prompt} + --new-tokens {opts.new_tokens} would pass the {what} "
                f"({room}): prompt {prompt}{said}"
            )
            opts = replace(opts, prompt=prompt, new_tokens=new_tokens)
    elif opts.mode == "decode" and not new_tokens_given and opts.prompt + opts.new_tokens > room > opts.prompt:
        new_tokens = room - opts.prompt
        notes.append(
            f"--new-tokens: the default {opts.new_tokens} after --prompt {opts.prompt} would pass the {what} "
            f"({room}): {new_tokens} step{'s' if new_tokens > 1 else ''}"
        )
        opts = replace(opts, new_tokens=new_tokens)
    return opts, notes


def _check_mode(chosen: Engine, opts: BenchOptions) -> None:
    if opts.mode != "decode" and not chosen.prefills:
        raise TaperfoldError(f"--engine {chosen.name}: {chosen.title} runs whole generations only; use --mode decode")


def _check_request(chosen: Engine, source: Source, opts: BenchOptions) -> None:
    """What the engine, the source and the options cannot do together, in one line, before any note or work."""
    _check_mode(chosen, opts)
    _check_variants(chosen, opts)
    _check_precision(chosen, source, opts)
    dtype = source.manifest.dtype if source.manifest is not None else "fp32"
    check_contenders(opts.against, source.manifest, opts.mode, opts.precision or dtype)


def _check_variants(chosen: Engine, opts: BenchOptions) -> None:
    """Variants the engine has nothing to run of (Engine.only_variants: vLLM's checkpoint is the folded model's
    alone), refused in one line naming what it runs."""
    only = chosen.only_variants
    if only is None:
        return
    other = [v for v in opts.variants if v not in only]
    if not other:
        return
    from taperfold.artifacts import artifact_kind

    stock = f"; the untapered model: --against {chosen.name}" if chosen.name in CONTENDERS else ""
    raise TaperfoldError(
        f"--variants {','.join(other)}: --engine {chosen.name} runs an export's {artifact_kind(chosen.runs).title}, "
        f"which exists of {','.join(only)} only: leave --variants out or give --variants {','.join(only)}{stock}"
    )


def _check_precision(chosen: Engine, source: Source, opts: BenchOptions) -> None:
    if opts.precision is not None and (chosen.runs_models or source.manifest is None):
        runs_them = " or ".join(e.name for e in ENGINES.values() if not e.runs_models and e.decodes)
        raise TaperfoldError(
            f"--precision {opts.precision} times an export's quantized graphs (export --quantize): give an export "
            f"directory and an engine that runs them (--engine {runs_them})"
        )


def _kept_token(chosen: Engine, opts: BenchOptions) -> int:
    """1 where a generation holds its last chosen token in the context too (Engine.keeps_last_token, or a
    contender's runtime), else 0."""
    keeps = chosen.keeps_last_token or any(contender(name).keeps_last_token for name in opts.against)
    return int(opts.mode == "decode" and keeps)


def _check(opts: BenchOptions, cfg, dtype: str) -> None:
    kept = _kept_token(engine(opts.engine), opts)
    longest = opts.prompt + opts.new_tokens + kept if opts.mode == "decode" else max(opts.seqs)
    what = f"--prompt {opts.prompt} + --new-tokens {opts.new_tokens}" if opts.mode == "decode" else f"--seq {longest}"
    if kept:
        what += " + the last chosen token (onnxruntime-genai keeps it in the context)"
    if longest > cfg.max_seq_len:
        raise TaperfoldError(f"{what} exceeds the model's context (max_seq_len {cfg.max_seq_len})")
    if opts.mode == "decode" and engine(opts.engine).feeds_cache_from_host and dtype == "bf16":
        raise TaperfoldError(
            "--mode decode with a bf16 export: numpy has no bfloat16 to feed the KV cache; "
            "use --engine torch --dtype bf16"
        )


def decode_cache(chosen: Engine, source: Source, opts: BenchOptions) -> tuple[Graph, int | None]:
    """The decoders' KV cache (--kv-cache; else `default_cache`) and the static cache's length (the export's
    --max-cache, else the context; None for a growing cache). A torch model that takes no static cache is refused by
    its runner."""
    cache = _chosen_cache(chosen, source, opts)
    length = _fixed_cache_length(source, cache)
    if length is not None and opts.prompt + opts.new_tokens > length:
        raise TaperfoldError(
            f"--prompt {opts.prompt} + --new-tokens {opts.new_tokens} exceeds the static cache "
            f"({length} positions: export --max-cache, else the context)"
        )
    return cache, length


# The cache bench decodes with when not told, per device, and why: on the CPU the growing cache was as fast or faster
# (ONNX Runtime, SmolLM2-135M's shape: static 0.95x at B1, 0.81x at B4; docs/benchmarks.md); on CUDA the static one,
# whose fixed shapes CUDA graphs replay.
PREFERRED_CACHE = {"cpu": GROWING, "cuda": STATIC}
CACHE_BASIS = {
    GROWING: "the CPU default: growing was as fast or faster than static here (docs/benchmarks.md)",
    STATIC: "the CUDA default: fixed shapes, which CUDA graphs replay",
}


def cache_basis(opts: BenchOptions, cache: Graph | None) -> str | None:
    """Why decode ran `cache`: --kv-cache, the device's default and its measurement, or the default missing from the
    export (or the engine) for a variant timed."""
    if cache is None:
        return None
    if opts.kv_cache != AUTO:
        return "--kv-cache"
    device = opts.device.split(":")[0]
    preferred = PREFERRED_CACHE.get(device, GROWING)
    if cache == preferred:
        return CACHE_BASIS[cache]
    return f"the {device.upper()} default ({preferred}) is not there for every variant timed"


def default_cache(chosen: Engine, source: Source, opts: BenchOptions) -> Graph:
    """The device's preferred cache (PREFERRED_CACHE) where the engine and the export have it for every variant
    timed (torch: where the model takes one), else the other."""
    manifest = source.manifest
    preferred = PREFERRED_CACHE.get(opts.device.split(":")[0], GROWING)

    def available(cache: Graph) -> bool:
        if cache not in chosen.caches:
            return False
        if manifest is not None and not chosen.runs_models:
            return all(manifest.has_artifact(v, cache) for v in opts.variants)
        return not GRAPH_TYPES[cache].fixed_cache or (chosen.runs_models and isinstance(source.config, ModelConfig))

    others = [c for c in KV_CACHES if c != preferred]
    return next((c for c in [preferred, *others] if available(c)), GROWING)


def _chosen_cache(chosen: Engine, source: Source, opts: BenchOptions) -> Graph:
    """The cache decode runs (--kv-cache, else `default_cache`), refused where the engine decodes with another."""
    if opts.kv_cache != AUTO and opts.kv_cache not in KV_CACHES:
        raise TaperfoldError(f"--kv-cache must be one of {', '.join(KV_CACHES)}, got {opts.kv_cache!r}")
    cache = default_cache(chosen, source, opts) if opts.kv_cache == AUTO else check_graph(opts.kv_cache)
    if cache not in chosen.caches:
        raise TaperfoldError(
            f"--kv-cache {cache}: {chosen.title} decodes with a {' or '.join(chosen.caches)} cache only"
        )
    return cache


def _fixed_cache_length(source: Source, cache: Graph) -> int | None:
    """The length of a cache of fixed length (the export's --max-cache, else the context); None for a growing one."""
    if not GRAPH_TYPES[cache].fixed_cache:
        return None
    manifest = source.manifest
    return manifest.max_cache if manifest is not None and manifest.max_cache else source.config.max_seq_len


def _check_exported(manifest, variants: list[str], graph: Graph) -> None:
    """A plain model's export has its baseline only, and an export --no-baseline no baseline: asking for what was
    not exported is one line saying what it can time. (Other missing graphs are named by `Manifest.artifact` when the
    runners open.)"""
    present = [v for v in ALL_VARIANTS if manifest.has_artifact(v, graph)]
    missing = [v for v in variants if v not in present]
    if missing and present and set(present) <= {BASELINE, DECOMPOSED_BASELINE}:
        raise TaperfoldError(
            f"{manifest.directory}: only the baseline was exported (a plain model: nothing tapered "
            f"or folded), so {', '.join(missing)} cannot be timed; it can time --variants "
            f"{','.join(present)}"
        )

    def was_exported(variant: str) -> bool:  # a script may add a variant of its own (gpu_table3's nonorm)
        return any(manifest.has_artifact(variant, g) for g in GRAPHS)

    exported = [v for v in dict.fromkeys([*ALL_VARIANTS, *variants]) if was_exported(v)]
    absent = [v for v in variants if not was_exported(v)]
    if absent and exported:  # e.g. the baseline of an export --no-baseline: no re-export of a cache brings it
        why = " (export --no-baseline leaves the baseline out)" if BASELINE in absent else ""
        raise TaperfoldError(
            f"{manifest.directory}: {', '.join(absent)} {'was' if len(absent) == 1 else 'were'} not exported{why}, "
            f"so it cannot be timed; this export can time --variants {','.join(exported)}"
        )


@dataclass
class LoadedBench:
    source: Source
    opts: BenchOptions
    cfg: ModelShape
    dtype: str
    threads: int
    runners: dict[str, Runner]
    cache: Graph | None = None  # decode: the decoders' KV cache (GROWING | STATIC)
    cache_len: int | None = None  # a static cache's length
    fused_projections: bool | None = False  # the variants run sibling projections (q/k/v, gate/up) as one; None:
    # the artifacts' kind cannot tell (onnxruntime-genai's builder packs q/k/v itself)
    projection_groups: dict[str, int] = field(default_factory=dict)  # per variant: the sibling groups fused
    against: list[dict] = field(default_factory=list)  # the contenders timed beside the variants (bench.against)


@contextlib.contextmanager
def load_bench(source: Source, opts: BenchOptions) -> Iterator[LoadedBench]:
    """Check the options against the model, fix the thread count, and load every variant up front."""
    chosen = engine(opts.engine)
    # graph engines run the dtype the graphs were exported in; torch builds fp32 unless told
    exported = source.manifest.dtype if not chosen.runs_models and source.manifest else "fp32"
    dtype = opts.dtype or exported
    _check(opts, source.config, dtype)
    if opts.kv_cache != AUTO and opts.mode != "decode":
        raise TaperfoldError("--kv-cache chooses the decoders' cache: it needs --mode decode")
    _check_request(chosen, source, opts)
    cache, cache_len = decode_cache(chosen, source, opts) if opts.mode == "decode" else (None, None)
    graph = cache or PREFILL
    if not chosen.runs_models and source.manifest:
        _check_exported(source.manifest, opts.variants, graph)
    threads = opts.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    fused = fused_projections(chosen, source, opts.fuse_projections)
    contenders = []  # built before the variants' artifacts: a contender's tool that fails leaves the export as it was
    for name in opts.against:
        if cache != GROWING:
            raise TaperfoldError(f"--against {name} decodes with a growing cache: add --kv-cache growing")
        assert source.manifest is not None  # check_contenders said so otherwise
        contenders.append(prepare_contender(name, source.manifest, opts.precision or dtype))
    runners, groups = make_runners(
        chosen,
        source,
        opts.variants,
        graph=graph,
        device=opts.device,
        dtype=dtype,
        threads=threads,
        options=opts.engine_options,
        shapes=shape_count(opts, cache),
        fuse_projections=fused,
        precision=opts.precision,
    )
    against = []
    for made in contenders:
        runners[made.name] = contender(made.name).runner(made.folder, threads, f"{made.name} ({made.folder})")
        against.append({"name": made.name, "folder": str(made.folder), **made.info})
    known = {name: n for name, n in groups.items() if n is not None}
    reported: bool | None = fused
    if len(known) < len(groups):  # the artifacts' kind cannot tell: the report says nothing of fusion
        reported, known = None, {}
    with open_runners(runners):
        yield LoadedBench(
            source, opts, source.config, dtype, threads, runners, cache, cache_len, reported, known, against
        )


def shape_count(opts: BenchOptions, cache: Graph | None = GROWING) -> int:
    """Distinct input shapes one runner sees: a cell each in prefill; in decode the prompt and every step per batch
    size with a growing cache (one longer each step), the prompt and one step shape with a static cache."""
    if opts.mode != "decode":
        return len(cells(opts))
    steps_share_a_shape = cache is not None and GRAPH_TYPES[cache].fixed_cache
    return len(cells(opts)) * (2 if steps_share_a_shape else 1 + opts.new_tokens)


GRAPH_LABEL = " (cuda graph)"


def runner_label(variant: str, execution: str) -> str:
    """How reports name a runner: the variant, marked when its rows are CUDA-graph replays."""
    return variant + (GRAPH_LABEL if execution == "cuda-graph" else "")


def execution_of(runner: Runner) -> str:
    return getattr(runner, "execution", "cuda-graph" if getattr(runner, "cuda_graph", False) else "eager")


def fused_projections(engine: Engine, source: Source, asked: str = AUTO) -> bool:
    """Whether the variants bench times run each group of sibling projections (q/k/v, gate/up) as one layer.

    Exported graphs run as export wrote them (`export --no-fuse-projections` is the switch there); a
    --fuse-projections / --no-fuse-projections that contradicts them is refused, not ignored. torch models are fused
    as asked, and by default as the export they come from (manifest `export.fuse_projections`): `bench DIR` on
    torch and on ONNX Runtime then times the same layers, the comparison a user of a fused export expects. A
    checkpoint or preset has no export to match and runs its layers as the model defines them (unfused)."""
    if asked not in (AUTO, FUSED, UNFUSED):
        raise ValueError(f"fuse_projections is one of {AUTO}, {FUSED}, {UNFUSED}; got {asked!r}")
    manifest = source.manifest
    exported = manifest is not None and manifest.fused_projections
    if not engine.runs_models:  # (without an export, make_runners says that this engine needs one)
        if manifest is not None and asked != AUTO and (asked == FUSED) != exported:
            raise TaperfoldError(
                f"--{'' if asked == FUSED else 'no-'}fuse-projections: --engine {engine.name} times the graphs "
                f"as exported, {'fused' if exported else 'unfused'} ({manifest.path}: key "
                f"'export.fuse_projections'); re-export {'with' if exported else 'without'} "
                "--no-fuse-projections, or time --engine torch"
            )
        return exported
    return exported if asked == AUTO else asked == FUSED


def make_runners(
    engine: Engine,
    source: Source,
    variants: list[str],
    *,
    graph: Graph,
    device: str,
    dtype: str,
    threads: int,
    options: dict,
    shapes: int | None = None,
    fuse_projections: bool = False,
    precision: str | None = None,
) -> tuple[dict[str, Runner], dict[str, int | None]]:
    """One runner per variant (not loaded yet) of `graph` (prefill, or a decoder). With
    `cuda_graph`, two per variant: the plain one and one that replays CUDA graphs (keyed
    `runner_label(variant, "cuda-graph")`), measured side by side. Also each variant's fused projection groups:
    counted in the torch models (built with `fuse_projections`), read from the manifest for exported graphs (those of
    `precision`, default the export's dtype)."""
    check_options(engine, options, device)
    engine.require(device)
    if GRAPH_TYPES[graph].has_past and not engine.decodes:
        others = " or ".join(f"--engine {e}" for e, spec in ENGINES.items() if spec.decodes)
        raise TaperfoldError(f"--mode decode: {engine.title} runs no KV-cached decoders; use {others}")
    targets: dict[str, Any]  # what each runner opens: a file, or a torch model
    if not engine.runs_models:
        if source.manifest is None:
            raise TaperfoldError(
                f"--engine {engine.name} runs exported graphs: give an export directory (DIR), "
                "not --checkpoint or --preset"
            )
        if dtype != source.manifest.dtype:
            raise TaperfoldError(
                f"{source.manifest.path}: the graphs were exported in {source.manifest.dtype} "
                f"(key 'export.dtype'); re-export with --dtype {dtype} to benchmark {dtype}"
            )
        targets = engine.files(source.manifest, variants, graph, precision)
        groups = {name: engine.projection_groups(source.manifest, name, graph, precision) for name in targets}
    else:
        models = build_variants(source.model_source(), variants, torch_dtype(dtype), fuse_projections=fuse_projections)
        groups = {name: fused_group_count(model) for name, model in models.items()}
        targets = dict(models)
    replays = [False, True] if options.get("cuda_graph") else [False]
    runners = {}
    for name, target in targets.items():
        for replay in replays:
            kind = (
                {**options, "cuda_graph": True} if replay else {k: v for k, v in options.items() if k != "cuda_graph"}
            )
            runner = engine.runner(
                target,
                device=device,
                threads=threads,
                graph=graph,
                logits=source.logits,
                name=f"{name} ({source.label})",
                shapes=shapes,
                **kind,
            )
            runners[runner_label(name, "cuda-graph" if replay else "eager")] = runner
    return runners, groups


def run_bench(bench: LoadedBench, on_call: Callable[[], None] = lambda: None) -> BenchReport:
    """Measure every variant in every cell; return the report (docs/benchmarks.md lists its keys)."""
    opts, cfg, runners = bench.opts, bench.cfg, bench.runners
    schedule = opts.schedule
    rng = np.random.default_rng(opts.seed)
    results: list[BenchRow] = []
    started = time.time()
    for batch, seq in cells(opts):
        ids = rng.integers(0, cfg.vocab_size, (batch, seq), dtype=np.int64)
        marks = {name: len(getattr(r, "setup_log", ())) for name, r in runners.items()}
        if opts.mode == "decode":
            # torch runners cast fed caches to the model's dtype; graphs take theirs as exported
            kv_dtype = bench.dtype if not engine(opts.engine).runs_models else "fp32"
            generations = {
                name: Job(functools.partial(r.generate, ids, opts.new_tokens, cfg, kv_dtype, bench.cache_len))
                for name, r in runners.items()
            }
            rows = _decode_rows(run_rounds(generations, schedule, on_call), batch, seq, opts.new_tokens)
        else:
            prepared = {name: r.prepare({INPUT: ids}) for name, r in runners.items()}
            jobs = {
                name: Job(
                    synced=functools.partial(_synced_call, r, prepared[name]),
                    pipelined=functools.partial(_pipelined_calls, r, prepared[name]),
                )
                for name, r in runners.items()
            }
            samples = run_rounds(jobs, schedule, on_call)
            rows = [
                _prefill_row(
                    name,
                    batch,
                    seq,
                    samples.first[name],
                    samples.synced[name],
                    samples.pipelined[name],
                    schedule.iter_slices,
                )
                for name in runners
            ]
        for row in rows:  # a row's label is its runner's name
            row.execution = execution_of(runners[row.label])
            row.setup_s = _setup_since(runners[row.label], marks[row.label])
        results += rows
    _add_speedups(results)
    seconds = round(time.time() - started, 1)
    compiled = bool(opts.engine_options.get("compile"))
    return BenchReport(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        seconds=seconds,
        mode=opts.mode,
        kv_cache=bench.cache,
        cache_length=bench.cache_len,
        kv_cache_basis=cache_basis(opts, bench.cache),
        fused_projections=bench.fused_projections,
        projection_groups=bench.projection_groups,
        against=bench.against,
        engine=opts.engine,
        device=opts.device,
        dtype=bench.dtype,
        threads=bench.threads,
        compile=compiled,
        compile_mode=opts.engine_options.get("compile_mode", "default") if compiled else None,
        cuda_graph=bool(opts.engine_options.get("cuda_graph")),
        engine_options=opts.engine_options,
        source=bench.source.to_dict(),
        config=cfg.to_dict(),
        settings=BenchSettings(
            **{k: v for k, v in asdict(opts).items() if k not in ("dtype", "threads")},
            warmup_slices=schedule.warmup_slices,
            iter_slices=schedule.iter_slices,
            cv_warn_pct=cv_threshold_pct(opts.device),
        ),
        environment=machine_info(),
        results=results,
    )


def _synced_call(runner: Runner, prepared: Any) -> float:
    """One call, timed alone and waited for: its seconds."""
    return runner.timed_run(prepared)[1]


def _pipelined_calls(runner: Runner, prepared: Any, calls: int) -> float:
    """`calls` calls issued back to back, one wait at the end: seconds per call."""
    return runner.pipelined_run(prepared, calls)[1]


def _ms(seconds: list[float]) -> list[float]:
    return [round(s * 1e3, 6) for s in seconds]


def _setup_since(runner: Runner, mark: int) -> dict[str, float]:
    """One-off work of `runner` (compiles, graph captures) logged since `mark`, seconds per kind: never timed."""
    totals: dict[str, float] = {}
    for kind, _, seconds in getattr(runner, "setup_log", [])[mark:]:
        totals[kind] = round(totals.get(kind, 0.0) + seconds, 6)
    return totals


def _timing(seconds: list[float], calls: list[int] | None = None) -> Timing:
    return Timing(_ms(seconds), summarize(seconds).scaled(1e3), calls)


def _row(phase: str, label: str, batch: int, seq: int, first_s: float, synced: Timing) -> BenchRow:
    """A row with its latency (synced calls); its throughput is set by the caller."""
    return BenchRow(
        phase=phase,
        variant=label.removesuffix(GRAPH_LABEL),
        label=label,
        batch=batch,
        seq=seq,
        tokens=batch * seq,
        first_run_ms=round(first_s * 1e3, 6),
        synced=synced,
        throughput_from=SYNCED,
        tokens_per_s=0.0,
    )


def _prefill_row(
    label: str, batch: int, seq: int, first_s: float, synced_s: list[float], pipelined_s: list[float], calls: list[int]
) -> BenchRow:
    """Latency from the synced calls, throughput from the pipelined samples (`calls[i]` calls each)."""
    row = _row("prefill", label, batch, seq, first_s, _timing(synced_s))
    row.pipelined = _timing(pipelined_s, list(calls))
    row.throughput_from = PIPELINED
    row.tokens_per_s = batch * seq / float(np.median(pipelined_s))
    return row


def _decode_rows(samples: CellSamples, batch: int, prompt: int, steps: int) -> list[BenchRow]:
    """The prompt call of every generation (synced, a prefill row) and its steps (a decode row: per-token latency,
    throughput from whole generations)."""
    rows = []
    for name, gens in samples.synced.items():
        first = samples.first[name]
        prompt_s = [g.prefill_s for g in gens]
        row = _row("prefill", name, batch, prompt, first.prefill_s, _timing(prompt_s))
        row.tokens_per_s = batch * prompt / float(np.median(prompt_s))
        rows.append(row)
        totals = [sum(g.step_s) for g in gens]
        per_token = Timing([_ms(g.step_s) for g in gens], summarize([s for g in gens for s in g.step_s]).scaled(1e3))
        row = _row("decode", name, batch, prompt, sum(first.step_s), per_token)
        row.tokens, row.new_tokens = batch * steps, steps
        row.generation = _timing(totals)
        row.throughput_from = GENERATION
        row.tokens_per_s = batch * steps / float(np.median(totals))
        rows.append(row)
    return rows


def _add_speedups(rows: list[BenchRow]) -> None:
    """speedup = variant throughput / baseline throughput in the same cell, phase and execution (graph replays
    against the baseline's graph replays), None without a baseline."""

    def key(r: BenchRow) -> tuple[str, int, int, str]:
        return r.phase, r.batch, r.seq, r.execution

    base = {key(r): r.tokens_per_s for r in rows if r.variant == BASELINE}
    for r in rows:
        ref = base.get(key(r))
        r.speedup_vs_baseline = r.tokens_per_s / ref if ref else None
