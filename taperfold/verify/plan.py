"""What verify compares, and in which order it runs the models: the comparison plan of one export.

Every artifact the manifest records is verified as its kind says (taperfold.artifacts):

- a kind verified by its LOGITS runs on the first engine that runs that kind (taperfold.engines: ONNX graphs on
  ONNX Runtime, TensorRT plans on TensorRT), and is held to its variant's torch model: the checkpoint for the tapered
  variants (at g = 0 when the export forced it), the checkpoint with plain norms for the baselines. A prefill graph
  runs the input batches; a decoder graph decodes the decode cases (a growing decoder and a static one alike, against
  the torch model decoding with a growing cache; the decode cases are the user's own tokens when given). Where its
  engine cannot run here (no TensorRT, no GPU), a bf16 decoder (numpy cannot feed it), a dtype its engine has no
  kernels for on the device while --engine names another engine (a bf16 export verified `--engine vllm` on the CPU,
  where ONNX Runtime has no bf16 kernels) or a cache too short for a case, the pair is skipped with the reason;
- a CHECKED kind is checked by the kind itself; where --engine names an engine that runs the kind (vLLM's
  checkpoints: `verify --engine vllm`), that engine's greedy generations are held to the variant's torch model as
  well (taperfold.verify.generations), after the other models have run.

And three pairs that isolate one step: unfolded -> folded (the fold alone), baseline-decomposed -> baseline (the
fused norm alone), both anchored on their first graph's own pair; and, for an export with --force-gate0,
checkpoint@g=<gate> -> folded, the cost of forcing g = 0, reported but never judged.

Models run one at a time: the torch models first (then the checkpoint goes), then each graph; decoders after the
prefill graphs, their torch models reading the checkpoint again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from taperfold.artifacts import artifact_kind, is_registered
from taperfold.artifacts.base import CHECKED, ArtifactRecord
from taperfold.compare import QUANTIZED_TOLERANCES, Tolerance, default_tolerance
from taperfold.engines import ENGINES, Engine, engines_running
from taperfold.exportdir import (
    BASELINE,
    DECOMPOSED_BASELINE,
    DTYPES,
    FOLDED,
    GRAPH_TYPES,
    GRAPHS,
    GROWING,
    PREFILL,
    UNFOLDED,
    Graph,
)
from taperfold.manifest import Manifest
from taperfold.verify.generations import GENERATION_TOLERANCES, GenerationCheck, generation_prompts
from taperfold.verify.inputs import USER_DECODE_STEPS, InputBatch, decode_cases, decode_steps
from taperfold.verify.judge import PlannedPair
from taperfold.verify.report import CHECK, COST, EXPORT, FOLD, FUSE, PairResult
from taperfold.verify.run import Case, ModelRun

REFERENCE_ENGINE = "torch"  # the torch models graphs are held to run here, fp32 on the CPU: they are the truth
TORCH_BASELINE = "baseline (torch)"
# The order pairs are reported in: the tapered variants first, then the baselines
_VARIANT_ORDER = (UNFOLDED, FOLDED, BASELINE, DECOMPOSED_BASELINE)


@dataclass
class Plan:
    pairs: list[PlannedPair]
    models: list[ModelRun]  # in the order they run
    checked: list[PairResult] = field(default_factory=list)  # CHECKED kinds, judged when the plan was made
    generations: list[GenerationCheck] = field(default_factory=list)  # run after the models (verify.generations)
    scored: dict[str, Case] = field(default_factory=dict)  # the cases of the user's tokens, by label (perplexity)


@dataclass
class PlanContext:
    """What the plan is made of: the manifest, the checkpoint's torch models by name (built when asked for), the
    inputs, and the options of the run."""

    manifest: Manifest
    cfg: Any  # the model's shape
    torch_models: Mapping[str, object]
    release_checkpoint: Callable[[], None]
    batches: list[tuple[InputBatch, np.ndarray]]  # (batch, its checked ids)
    device: str
    threads: int | None
    tolerances: dict
    seed: int
    reference: str  # the checkpoint's torch model: "checkpoint", or "checkpoint@g=0" for a forced export
    at_gate: str | None  # the checkpoint at its stored gate (a forced export), or None
    engine: str = "ort"  # the engine of the kind it runs (the ONNX graphs); other kinds run on their first engine
    user_tokens: bool = False  # the batches are the user's text or tokens (not random): decode them, score them

    def engine_of(self, kind: str) -> Engine | None:
        """The engine that runs artifacts of `kind` here, or None where none does."""
        engines = engines_running(kind)
        return next((e for e in engines if e.name == self.engine), engines[0] if engines else None)

    @property
    def baseline_only(self) -> bool:
        """An export of a plain (untapered) checkpoint: baseline graphs and nothing tapered or folded."""
        return self.manifest.has_artifact(BASELINE) and not any(
            self.manifest.has_artifact(v) for v in (UNFOLDED, FOLDED)
        )

    def tolerance(self, kind: str, precision: str | None = None) -> Tolerance:
        """The bound of a pair of `kind` whose candidate is in `precision` (default: the export's dtype)."""
        return default_tolerance(precision or self.manifest.dtype, kind).override(**self.tolerances)

    def reference_of(self, variant: str | None) -> str:
        """The torch model a variant's artifacts are held to."""
        if variant in (BASELINE, DECOMPOSED_BASELINE) and not self.baseline_only:
            return TORCH_BASELINE
        return self.reference


def make_plan(ctx: PlanContext) -> Plan:
    pairs: list[PlannedPair] = []
    checked: list[PairResult] = []
    generations: list[GenerationCheck] = []
    runs: dict[tuple[str, str], ModelRun] = {}  # (model name, graph) -> its run, cases added as pairs need them
    prefill_cases = [Case(batch.label, ids, scored=ctx.user_tokens) for batch, ids in ctx.batches]
    manifest = ctx.manifest

    def graph_run(record: ArtifactRecord, engine_name: str, cases: list[Case]) -> None:
        engine = ENGINES[engine_name]
        device = ctx.device if ctx.device in engine.devices else engine.default_device
        graph = record.graph or PREFILL
        runs[(record.key, graph)] = ModelRun(
            record.key,
            lambda: engine.runner(manifest.file(record), device=device, threads=ctx.threads, graph=graph),
            cases,
            ctx.cfg,
            kv_dtype=manifest.dtype,
        )

    def torch_cases(name: str, graph: Graph, cases: list[Case]) -> None:
        run = runs.get((name, graph))
        if run is None:
            engine = ENGINES[REFERENCE_ENGINE]
            label = {TORCH_BASELINE: "with plain norms (reference)", ctx.reference: "(reference)"}.get(name, "")
            decoder = " decoder" if GRAPH_TYPES[graph].has_past else ""
            run = runs[(name, graph)] = ModelRun(
                name,
                lambda: engine.runner(
                    ctx.torch_models[name],
                    device="cpu",
                    logits=manifest.logits,
                    graph=graph,
                    name=f"{manifest.checkpoint} {label or name}".strip() + decoder,
                ),
                [],
                ctx.cfg,
            )
        known = {c.label for c in run.cases}  # torch decodes every case with a growing cache
        run.cases += [Case(c.label, c.ids, c.decode, c.steps, scored=c.scored) for c in cases if c.label not in known]

    for record in sorted(manifest.records(), key=_report_order):
        if not is_registered(record.kind):
            reason = f"artifact kind {record.kind!r} is not registered here (a plug-in adds it)"
            checked.append(PairResult("manifest", record.key, CHECK, None, status="skipped", reason=reason))
            continue
        kind = artifact_kind(record.kind)
        if kind.verified == CHECKED:
            named = ENGINES.get(ctx.engine)
            if named is not None and named.runs == kind.name:  # --engine names what runs it: its generations too
                generations.append(_generation_check(ctx, record, named))
            problems = kind.check(manifest, record)
            checked.append(
                PairResult(
                    record.built_from or "manifest",
                    record.key,
                    CHECK,
                    None,
                    status="fail" if problems else "pass",
                    reason="; ".join(problems) or None,
                )
            )
            continue
        graph = record.graph or PREFILL
        reference = ctx.reference_of(record.variant)
        judged = record.precision in DTYPES or record.precision in QUANTIZED_TOLERANCES
        tolerance = ctx.tolerance(EXPORT, record.precision) if judged else None
        result = PairResult(reference, record.key, EXPORT, tolerance)
        decodes = GRAPH_TYPES[graph].has_past
        cases = _decode_cases(ctx, graph) if decodes else prefill_cases
        why_not = _why_not(ctx, kind.name, graph, cases)
        if why_not:
            result.status, result.reason = "skipped", why_not
            pairs.append(PlannedPair(result, [], graph=graph))
            continue
        engine = ctx.engine_of(kind.name)
        assert engine is not None  # _why_not said so otherwise
        graph_run(record, engine.name, cases)
        torch_cases(reference, GROWING if decodes else graph, cases)  # torch decodes with a growing cache
        pairs.append(PlannedPair(result, [c.label for c in cases], graph=graph))

    pairs = _with_step_pairs(ctx, pairs, prefill_cases, torch_cases)
    models = _run_order(list(runs.values()), ctx)
    scored = {case.label: case for run in models for case in run.cases if case.scored}
    return Plan(pairs, models, checked, generations, scored)


def _generation_check(ctx: PlanContext, record: ArtifactRecord, engine: Engine) -> GenerationCheck:
    """`record`'s artifact generating on `engine` (the one --engine names), held to its variant's torch model."""
    device = ctx.device if ctx.device in engine.devices else engine.default_device
    given = [ids for _, ids in ctx.batches] if ctx.user_tokens else None
    prompts, steps = generation_prompts(ctx.cfg.vocab_size, ctx.cfg.max_seq_len, ctx.seed, given)
    return GenerationCheck(
        record.key,
        ctx.reference_of(record.variant),
        lambda: engine.runner(ctx.manifest.file(record), device=device, threads=ctx.threads),
        prompts,
        steps,
        GENERATION_TOLERANCES[ctx.manifest.dtype],
    )


def _report_order(record: ArtifactRecord) -> tuple[int, int, int]:
    variant = _VARIANT_ORDER.index(record.variant) if record.variant in _VARIANT_ORDER else len(_VARIANT_ORDER)
    return GRAPHS.index(record.graph or PREFILL), record.kind != "onnx", variant


def _decode_cases(ctx: PlanContext, graph: Graph) -> list[Case]:
    """The decode cases of a decoder graph: the user's tokens (as much of each batch as its cache holds), or random
    ones that fit its cache."""
    cfg = ctx.cfg
    cache_len = (ctx.manifest.max_cache or cfg.max_seq_len) if GRAPH_TYPES[graph].fixed_cache else None
    length = cache_len or cfg.max_seq_len
    if ctx.user_tokens:
        cases = []
        for batch, ids in ctx.batches:
            ids = ids[:, :length]
            steps = decode_steps(ids.shape[1], USER_DECODE_STEPS)
            if steps:
                label = f"decode {batch.label} {ids.shape[0]}x{ids.shape[1] - steps}+{steps}"
                cases.append(Case(label, ids, decode=True, steps=steps, cache_len=cache_len, scored=True))
        return cases
    steps = decode_steps(length)
    return [
        Case(c.label, c.ids, decode=True, steps=steps, cache_len=cache_len)
        for c in decode_cases(cfg.vocab_size, length, ctx.seed, cfg.window)
    ]


def _why_not(ctx: PlanContext, kind: str, graph: Graph, cases: list[Case]) -> str | None:
    """Why an artifact of `kind` and `graph` cannot be run here, or None."""
    engine = ctx.engine_of(kind)
    if engine is None:
        return f"no engine runs {artifact_kind(kind).title}s"
    device = ctx.device if ctx.device in engine.devices else engine.default_device
    why = engine.unavailable(device)
    if why:
        return why
    dtype = ctx.manifest.dtype
    if (device, dtype) in engine.lacks_kernels and ctx.engine != engine.name:
        # the artifacts --engine names are what is verified (`--engine vllm` on a bf16 export); where --engine
        # names this engine, its runner refuses the graph in one line instead
        return f"{engine.title} has no {dtype} kernels on the {device} (--device cuda runs them)"
    if GRAPH_TYPES[graph].has_past:
        if not engine.decodes:
            return f"{engine.title} runs no KV-cached decoders"
        if dtype == "bf16":
            return "bf16: numpy has no bfloat16 to feed the KV cache from the host"
        if not cases:
            fixed = GRAPH_TYPES[graph].fixed_cache
            holder = "the static cache" if fixed else "the context"
            length = ctx.manifest.max_cache if fixed else None
            return f"{holder} ({length or ctx.cfg.max_seq_len}) holds no prompt and a step"
    return None


def _with_step_pairs(ctx: PlanContext, pairs: list[PlannedPair], cases: list[Case], torch_cases) -> list[PlannedPair]:
    """The pairs that isolate one step, each placed after the pairs it needs: unfolded -> folded after checkpoint ->
    folded, baseline-decomposed -> baseline after both baselines' own pairs, and the cost of a forced g = 0 last among
    the prefill pairs."""
    labels = [c.label for c in cases]
    by_candidate = {p.result.candidate: p for p in pairs if p.result.kind == EXPORT}
    out = list(pairs)

    def after(key: str, pair: PlannedPair) -> None:
        out.insert(out.index(by_candidate[key]) + 1, pair)

    def judged(key: str) -> bool:
        return key in by_candidate and by_candidate[key].result.status != "skipped"

    if judged(UNFOLDED) and judged(FOLDED):
        anchor = by_candidate[UNFOLDED].result.name
        after(FOLDED, PlannedPair(PairResult(UNFOLDED, FOLDED, FOLD, ctx.tolerance("fold")), labels, anchor))
    if judged(BASELINE) and judged(DECOMPOSED_BASELINE):
        anchor = by_candidate[DECOMPOSED_BASELINE].result.name
        pair = PairResult(DECOMPOSED_BASELINE, BASELINE, FUSE, ctx.tolerance("fold"))
        after(DECOMPOSED_BASELINE, PlannedPair(pair, labels, anchor))
    if ctx.at_gate is not None and judged(FOLDED):
        torch_cases(ctx.at_gate, PREFILL, cases)
        last_prefill = max(i for i, p in enumerate(out) if p.graph == PREFILL)
        out.insert(last_prefill + 1, PlannedPair(PairResult(ctx.at_gate, FOLDED, COST, None, status="info"), labels))
    return out


def _run_order(runs: list[ModelRun], ctx: PlanContext) -> list[ModelRun]:
    """One model in memory at a time: the prefill torch models (then the checkpoint goes), the prefill graphs, the
    decoding torch models (the checkpoint read again, then let go), the decoder graphs."""
    torch_names = {ctx.reference, TORCH_BASELINE, *([ctx.at_gate] if ctx.at_gate else [])}
    prefill = [r for r in runs if not any(c.decode for c in r.cases)]
    decode = [r for r in runs if any(c.decode for c in r.cases)]
    order = []
    for group in (prefill, decode):
        torch = [r for r in group if r.name in torch_names]
        torch.sort(key=lambda r: [ctx.reference, ctx.at_gate, TORCH_BASELINE].index(r.name))
        if torch:
            torch[-1].then = ctx.release_checkpoint
        order += torch + [r for r in group if r.name not in torch_names]
    return order
