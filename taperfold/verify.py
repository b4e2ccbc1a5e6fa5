"""`taperfold verify`: run an export's models on the same tokens and hold their logits to tolerances.

The reference is the checkpoint named in manifest.json, rebuilt in PyTorch (fp32, CPU) at its stored
gate. Pairs (reference -> candidate):

- checkpoint -> unfolded: the exporter's own fidelity (unfolded.onnx, ONNX Runtime)
- checkpoint -> folded: what a user gets (model.onnx)
- unfolded -> folded: the fold alone, held to a tighter bound in fp32
- baseline (torch) -> baseline: the plain-norm model (`variants.baseline_of`) against baseline.onnx, and
  baseline-decomposed -> baseline: the fused norm against the plain ops it replaced (fold bound)
- an export of a plain (untapered) checkpoint has its baseline only: checkpoint -> baseline, and the
  report's note says there is nothing folded to verify
- checkpoint -> engine: the TensorRT plan, when the export has one; skipped, with the reason, when
  TensorRT or a GPU is missing
- with decoders (`export --kv-cache`), every `*.decoder.onnx` and `*.static.onnx` against the same torch model
  decoding with a growing cache: a prompt with an empty past, then DECODE_STEPS KV-cached steps, each step's
  logits compared (a static decoder's prompt and steps write its fixed-size cache at their positions)

Every graph runs on shapes far from the one the exporter traced (export.TRACE_SHAPE, TRACE_PAST):
batch 1 and 4, sequence 1 to the model's longest, past 0 to the longest, so a graph that only works
at its tracing shape (a fused op that fixed a dynamic dimension) fails here.

An export made with --force-gate0 comes from a checkpoint whose gate is not 0, so folding changed the
function on purpose. Its reference is then the checkpoint built at g = 0, which the export must match,
and one more pair, checkpoint@g=<gate> -> folded, shows the cost of forcing g = 0. That pair is
reported but never fails: the user asked for the change, and how much loss it is worth is theirs to judge.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from taperfold.compare import Metrics, Tolerance, between_graphs, compare_logits, default_tolerance, violations
from taperfold.engines import ENGINES
from taperfold.errors import TaperfoldError
from taperfold.exportdir import (
    BASELINE,
    DECOMPOSED_BASELINE,
    ENGINE_ARTIFACT,
    FOLDED,
    GROWING,
    INPUT,
    KV_CACHES,
    OUTPUT,
    STATIC,
    UNFOLDED,
    Manifest,
    artifact_key,
    read_manifest,
)
from taperfold.runners.base import Runner
from taperfold.sources import ModelSource, checkpoint_digest, open_source

REPORT = "verify.json"
# The engines verify runs: the torch reference, the ONNX graphs (on --device), and a TensorRT plan if one was built.
REFERENCE_ENGINE, GRAPH_ENGINE, PLAN_ENGINE = "torch", "ort", "trt"
BATCH_SIZES = (1, 4)  # the export traces batch 2
SHORT_SEQUENCE = 16  # and sequence 8
DECODE_STEPS = 4  # KV-cached steps after each prompt
TORCH_BASELINE = "baseline (torch)"
NOTHING_FOLDED = (
    "nothing folded to verify: {checkpoint} is a plain model (no tapered norms); checked its "
    "baseline graph against its own forward"
)


@dataclass
class InputBatch:
    label: str  # names the batch in the report, and the file in errors
    ids: np.ndarray  # [batch, sequence] token ids
    tokenizer: str | None = None  # set when the ids were encoded here: must match the checkpoint's


# ---- inputs ------------------------------------------------------------------------------------------


def random_inputs(vocab_size: int, max_seq_len: int, seed: int = 0) -> list[InputBatch]:
    """Uniform random tokens: batch 1 and >1 by sequence 1, a short one and the longest the model allows."""
    rng = np.random.default_rng(seed)
    sequences = sorted({1, min(SHORT_SEQUENCE, max_seq_len), max_seq_len})
    return [
        InputBatch(f"random {b}x{s}", rng.integers(0, vocab_size, size=(b, s), dtype=np.int64))
        for b in BATCH_SIZES
        for s in sequences
    ]


def tokens_from_file(path: str | Path) -> list[InputBatch]:
    """A .npy integer array, or text with whitespace-separated ids, one sequence per line.
    1-D (or one line) is one sequence; 2-D (or several lines of equal length) is a batch."""
    path = Path(path)
    if not path.is_file():
        raise TaperfoldError(f"{path}: no such token file")
    if path.suffix == ".npy":
        try:
            ids = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise TaperfoldError(f"{path}: not a readable .npy array ({e})") from None
        if not np.issubdtype(ids.dtype, np.integer):
            raise TaperfoldError(f"{path}: holds {ids.dtype} values; token ids must be integers")
    else:
        ids = _ids_from_text(path)
    return [InputBatch(str(path), ids[None, :] if ids.ndim == 1 else ids)]


def _ids_from_text(path: Path) -> np.ndarray:
    try:
        lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise TaperfoldError(f"{path}: not a readable token file ({e}); use .npy or whitespace-separated ids") from None
    rows = []
    for number, words in enumerate(lines, 1):
        try:
            rows.append([int(w) for w in words])
        except ValueError:
            bad = next(w for w in words if not w.lstrip("+-").isdigit())
            raise TaperfoldError(f"{path}: line {number}: {bad!r} is not an integer token id") from None
    if not rows:
        raise TaperfoldError(f"{path}: holds no token ids")
    if len({len(r) for r in rows}) > 1:
        raise TaperfoldError(
            f"{path}: lines hold different numbers of ids ({sorted({len(r) for r in rows})}); "
            "a batch needs sequences of equal length, one per line"
        )
    return np.array(rows[0] if len(rows) == 1 else rows, dtype=object)


def tokens_from_text(path: str | Path) -> list[InputBatch]:
    """A text file encoded with taperfold's byte-level tokenizer (its UTF-8 bytes), as one sequence."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TaperfoldError(f"{path}: cannot read text file ({e.strerror or e})") from None
    if not data:
        raise TaperfoldError(f"{path}: is empty")
    return [InputBatch(str(path), np.frombuffer(data, dtype=np.uint8).astype(np.int64)[None, :], tokenizer="bytes")]


def _checked_ids(batch: InputBatch, vocab_size: int, max_seq_len: int, tokenizer: str) -> np.ndarray:
    if batch.tokenizer is not None and batch.tokenizer != tokenizer:
        raise TaperfoldError(
            f"{batch.label}: encoded with the {batch.tokenizer!r} tokenizer, but the checkpoint "
            f"uses {tokenizer!r}; pass token ids with --tokens"
        )
    ids = batch.ids
    if ids.ndim != 2 or ids.size == 0:
        raise TaperfoldError(
            f"{batch.label}: expected a 1-D sequence or a 2-D batch of token ids, got shape {list(ids.shape)}"
        )
    low, high = int(ids.min()), int(ids.max())  # Python ints: no overflow whatever the array's dtype
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise TaperfoldError(
            f"{batch.label}: token id {bad} is out of range (the vocabulary has {vocab_size} ids, 0..{vocab_size - 1})"
        )
    if ids.shape[1] > max_seq_len:
        raise TaperfoldError(
            f"{batch.label}: sequence of {ids.shape[1]} tokens is longer than the model allows "
            f"({max_seq_len}); shorten it"
        )
    return ids.astype(np.int64)


def decode_cases(vocab_size: int, max_seq_len: int, seed: int = 0) -> list[InputBatch]:
    """Prompts for the decoders (past 0 at the prompt, then DECODE_STEPS steps), far from the tracing shape
    (batch 2, 8 tokens, past 5): one short prompt at batch 1, and batch 4 up to the model's longest context.
    The ids hold the prompt and then the token fed at each step (the same for reference and candidate)."""
    rng = np.random.default_rng(seed + 1)
    prompts = sorted({min(SHORT_SEQUENCE, max_seq_len - DECODE_STEPS), max_seq_len - DECODE_STEPS})
    return [
        InputBatch(
            f"decode {b}x{p}+{DECODE_STEPS}", rng.integers(0, vocab_size, size=(b, p + DECODE_STEPS), dtype=np.int64)
        )
        for b, p in zip(BATCH_SIZES, prompts)
        if p >= 1
    ]


# ---- the report ----------------------------------------------------------------------------------------


def _finite_or_none(obj):
    """JSON has no NaN or Infinity: write them as null (the violations still say what happened)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_or_none(v) for v in obj]
    return obj


@dataclass
class PairResult:
    reference: str
    candidate: str
    kind: str  # "export" | "fold" | "cost" (reported, never judged)
    tolerance: Tolerance | None
    status: str = "pass"  # "pass" | "fail" | "info" | "skipped"
    reason: str | None = None
    metrics: Metrics | None = None
    violations: list[str] = field(default_factory=list)
    worst_input: str | None = None
    per_input: list[dict] = field(default_factory=list)
    # a pair of two graphs: the pair holding its first graph to its torch model, whose distance may widen the bound
    # (compare.between_graphs)
    anchor: str | None = None

    @property
    def name(self) -> str:
        return f"{self.reference} -> {self.candidate}"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "reference": self.reference,
            "candidate": self.candidate,
            "kind": self.kind,
            "status": self.status,
            "reason": self.reason,
            "tolerance": self.tolerance.to_dict() if self.tolerance else None,
            "metrics": self.metrics.to_dict() if self.metrics else None,
            "violations": self.violations,
            "worst_input": self.worst_input,
            "per_input": self.per_input,
        }


@dataclass
class VerifyReport:
    export_dir: str
    checkpoint: dict
    dtype: str
    logits: str
    device: str
    forced_gate0: bool
    inputs: list[dict]
    pairs: list[PairResult]
    note: str | None = None  # e.g. NOTHING_FOLDED

    @property
    def passed(self) -> bool:
        return all(p.status != "fail" for p in self.pairs)

    def failure_message(self) -> str:
        """One line naming the worst failing pair, its output and the bounds it breaks."""
        failed = [p for p in self.pairs if p.status == "fail"]
        if not failed:
            return ""

        def excess(p: PairResult) -> float:
            if p.metrics is None or not math.isfinite(p.metrics.max_rel):
                return math.inf
            return p.metrics.max_rel / p.tolerance.rtol if p.tolerance.rtol > 0 else math.inf

        worst = max(failed, key=excess)
        where = f" (worst input: {worst.worst_input})" if worst.worst_input else ""
        more = f"; {len(failed) - 1} more pair(s) failed" if len(failed) > 1 else ""
        detail = worst.reason or ", ".join(worst.violations)
        return f"{worst.name}: logits {detail}{where}{more}"

    def closer(self) -> str:
        """Which of unfolded.onnx and model.onnx is closer to the checkpoint (max rel), as one sentence."""
        pairs = {p.name: p.metrics for p in self.pairs if p.metrics is not None and p.kind == "export"}
        unfolded = next((m for name, m in pairs.items() if name.endswith("-> unfolded")), None)
        folded = next((m for name, m in pairs.items() if name.endswith("-> folded")), None)
        if unfolded is None or folded is None or not (unfolded.max_rel > 0 and math.isfinite(folded.max_rel)):
            return ""
        ratio = folded.max_rel / unfolded.max_rel
        which = "folded" if ratio < 1 else "unfolded" if ratio > 1 else "neither"
        return (
            f"closer to the checkpoint: {which} (max rel folded {folded.max_rel:.3g}, unfolded "
            f"{unfolded.max_rel:.3g}, ratio {ratio:.2f})"
        )

    def to_dict(self) -> dict:
        return _finite_or_none(
            {
                "export_dir": self.export_dir,
                "passed": self.passed,
                "closer": self.closer(),
                "checkpoint": self.checkpoint,
                "dtype": self.dtype,
                "logits": self.logits,
                "device": self.device,
                "forced_gate0": self.forced_gate0,
                "note": self.note,
                "inputs": self.inputs,
                "pairs": [p.to_dict() for p in self.pairs],
            }
        )


# ---- the reference -------------------------------------------------------------------------------------


def _load_reference_checkpoint(manifest: Manifest) -> ModelSource:
    path = manifest.checkpoint
    if not path.exists():
        raise TaperfoldError(f"{path}: checkpoint named in {manifest.path} is missing")
    digest = checkpoint_digest(path)
    if digest != manifest.checkpoint_sha256:
        raise TaperfoldError(
            f"{path}: checkpoint changed since export (sha256 {digest[:12]}..., manifest.json "
            f"says {manifest.checkpoint_sha256[:12]}...); export it again"
        )
    return open_source(path)


def _baseline_only(manifest: Manifest) -> bool:
    """An export of a plain (untapered) checkpoint: baseline graphs and nothing tapered or folded."""
    return not any(manifest.has_artifact(v) for v in (UNFOLDED, FOLDED))


# ---- verification --------------------------------------------------------------------------------------


def verify_export(
    export_dir: str | Path,
    inputs: list[InputBatch] | None = None,
    device: str = "cpu",
    tolerances: dict | None = None,
    seed: int = 0,
    threads: int | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> VerifyReport:
    """Compare every model in `export_dir` with the checkpoint it came from (see the module docstring).

    `inputs`: token batches (default: seeded random ones over several shapes); `tolerances`: overrides
    {"rtol", "min_top1", "max_kl"} applied to every judged pair; `threads`: CPU threads for the torch
    reference and ONNX Runtime; `on_progress(done, total, description)` is called before each model run.
    """
    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    ENGINES[GRAPH_ENGINE].require(device)
    ckpt = _load_reference_checkpoint(manifest)
    cfg, dtype, logits, forced = ckpt.config, manifest.dtype, manifest.logits, manifest.forced_gate0
    checkpoint_path, stored_gate = ckpt.path, ckpt.gate
    batches = inputs if inputs is not None else random_inputs(cfg.vocab_size, cfg.max_seq_len, seed)
    id_arrays = [_checked_ids(b, cfg.vocab_size, cfg.max_seq_len, cfg.tokenizer) for b in batches]

    # The torch references run in fp32 on the CPU, whatever the export's dtype: they are the truth.
    torch_engine, graph_engine, plan_engine = (ENGINES[name] for name in (REFERENCE_ENGINE, GRAPH_ENGINE, PLAN_ENGINE))
    reference = "checkpoint@g=0" if forced else "checkpoint"
    at_gate = f"checkpoint@g={stored_gate:g}"
    baseline_only = _baseline_only(manifest)
    # built when asked for, from one copy of the checkpoint's weights; shared by the prefill and the decoder checks
    models = TorchModels(
        manifest,
        ckpt,
        {
            reference: lambda source: source.build(gate=0.0 if forced else None),
            at_gate: lambda source: source.build(),
            TORCH_BASELINE: lambda source: source.build_baseline(),
        },
    )
    del ckpt  # `models` holds the weights now, and lets them go when the torch models have run

    def torch_model(name: str, label: str) -> ModelRun:
        return ModelRun(name, lambda: torch_engine.runner(models[name], device="cpu", logits=logits, name=label))

    def graph(variant: str) -> ModelRun:
        return ModelRun(
            variant, lambda: graph_engine.runner(manifest.artifact(variant), device=device, threads=threads)
        )

    # One model in memory at a time: the torch models first (then the checkpoint goes), then each graph
    run = [torch_model(reference, f"{checkpoint_path} (reference)")]
    if forced:
        run.append(torch_model(at_gate, f"{checkpoint_path} at g = {stored_gate:g}"))
    overrides = tolerances or {}
    export_tol = default_tolerance(dtype, "export").override(**overrides)
    fold_tol = default_tolerance(dtype, "fold").override(**overrides)
    pairs, graphs = [], []
    if not baseline_only:
        graphs += [graph(UNFOLDED), graph(FOLDED)]
        pairs += [
            PairResult(reference, UNFOLDED, "export", export_tol),
            PairResult(reference, FOLDED, "export", export_tol),
            PairResult(UNFOLDED, FOLDED, "fold", fold_tol, anchor=f"{reference} -> {UNFOLDED}"),
        ]
    baselines = [v for v in (BASELINE, DECOMPOSED_BASELINE) if manifest.has_artifact(v)]
    if baselines:
        # a plain checkpoint is its own baseline: its forward is the reference, built once
        baseline_ref = reference if baseline_only else TORCH_BASELINE
        if not baseline_only:
            run.append(torch_model(TORCH_BASELINE, f"{checkpoint_path} with plain norms (reference)"))
        for variant in baselines:
            graphs.append(graph(variant))
            pairs.append(PairResult(baseline_ref, variant, "export", export_tol))
        if len(baselines) == 2:  # the fused norm against the plain ops it replaced
            pairs.append(
                PairResult(
                    DECOMPOSED_BASELINE, BASELINE, "fuse", fold_tol, anchor=f"{baseline_ref} -> {DECOMPOSED_BASELINE}"
                )
            )
    if FOLDED in manifest.engines:  # a TensorRT plan of model.onnx (manifest.json's artifacts.engine)
        engine_pair = PairResult(reference, ENGINE_ARTIFACT, "export", export_tol)
        pairs.append(engine_pair)
        why_not = plan_engine.unavailable(plan_engine.default_device)
        if why_not:
            engine_pair.status, engine_pair.reason = "skipped", why_not
        else:
            graphs.append(ModelRun(ENGINE_ARTIFACT, lambda: plan_engine.runner(manifest.engine_plan(FOLDED))))
    if forced:
        pairs.append(PairResult(at_gate, FOLDED, "cost", None, status="info"))
    run[-1].then = models.release
    run += graphs

    progress = on_progress or (lambda done, total, description: None)
    given = {name for name, value in overrides.items() if value is not None}
    _run(list(zip(batches, id_arrays)), run, pairs, threads, progress, given)
    if any(manifest.has_artifact(v, decoder=cache) for v in (UNFOLDED, BASELINE) for cache in KV_CACHES):
        pairs += _verify_decoders(manifest, cfg, models, reference, dtype, device, threads, export_tol, seed, progress)
    return VerifyReport(
        export_dir=str(export_dir),
        dtype=dtype,
        logits=logits,
        device=device,
        forced_gate0=forced,
        note=NOTHING_FOLDED.format(checkpoint=checkpoint_path) if baseline_only else None,
        checkpoint={
            "path": str(checkpoint_path),
            "sha256": manifest.checkpoint_sha256,
            "gate": stored_gate,
            "reference_gate": 0.0 if forced else stored_gate,
        },
        inputs=[{"label": b.label, "shape": list(ids.shape)} for b, ids in zip(batches, id_arrays)],
        pairs=pairs,
    )


class TorchModels(Mapping):
    """The torch models verify holds graphs to, by name, each built from the checkpoint when asked for and not kept:
    they hold the checkpoint's own tensors (sources.ModelSource.build), so several at once cost one copy of the
    weights. `release()` lets the checkpoint go; a model asked for afterwards reads it again (checked against
    manifest.json as the first time)."""

    def __init__(self, manifest: Manifest, source: ModelSource, builders: dict[str, Callable[[ModelSource], object]]):
        self._manifest, self._source, self._builders = manifest, source, builders

    def __getitem__(self, name: str):
        if self._source is None:
            self._source = _load_reference_checkpoint(self._manifest)
        return self._builders[name](self._source)

    def __iter__(self):
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)

    def release(self) -> None:
        self._source = None


@dataclass
class ModelRun:
    """One model of verify's prefill run: its runner is made when its turn comes, and closed before the next's."""

    name: str
    runner: Callable[[], Runner]
    then: Callable[[], None] = lambda: None  # after its runs: let go of what no later model needs


def _run(
    batches: list[tuple[InputBatch, np.ndarray]],
    run: list[ModelRun],
    pairs: list[PairResult],
    threads: int | None,
    progress: Callable[[int, int, str], None],
    given: set[str] = frozenset(),
) -> None:
    """Run each model of `run` in turn on every batch, closing it before the next one opens (one model's weights in
    memory at a time); a pair is compared as soon as both its models have run (a pair of two graphs after its
    anchor, whose metrics may widen its bound unless the user `given` it), and a model's logits are dropped once no
    pair waits for them."""
    import torch

    judged = [p for p in pairs if p.status != "skipped"]
    waiting = list(judged)
    collected: dict[str, list[Metrics]] = {p.name: [] for p in judged}
    logits: dict[str, list[np.ndarray]] = {}
    total, done = len(batches) * len(run), 0
    torch_threads = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        for model in run:
            outputs = []
            with model.runner() as runner:
                for batch, ids in batches:
                    progress(done, total, f"{model.name} on {batch.label}")
                    outputs.append(runner.infer({INPUT: ids})[OUTPUT].astype(np.float32))
                    done += 1
            del runner
            model.then()
            _return_freed_memory()
            logits[model.name] = outputs
            for pair in [p for p in waiting if p.reference in logits and p.candidate in logits]:
                if pair.anchor and collected.get(pair.anchor):  # the anchor's models ran first (it is listed first)
                    pair.tolerance = between_graphs(
                        pair.tolerance,
                        Metrics.merge(collected[pair.anchor]),
                        pair.anchor,
                        rtol_given="rtol" in given,
                        max_kl_given="max_kl" in given,
                    )
                for (batch, _), ref, cand in zip(batches, logits[pair.reference], logits[pair.candidate]):
                    _compare_one(pair, batch, ref, cand, collected[pair.name])
                waiting.remove(pair)
            logits = {
                name: out for name, out in logits.items() if any(name in (p.reference, p.candidate) for p in waiting)
            }
    finally:
        torch.set_num_threads(torch_threads)
    for pair in judged:
        _conclude(pair, collected[pair.name])


def _return_freed_memory() -> None:
    """Hand the heap a closed model freed back to the system: glibc keeps it otherwise, and ONNX Runtime sessions
    opened one after another then grew the process by ~0.5x the weights each (a 1.5 GB model, measured)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _compare_one(
    pair: PairResult, batch: InputBatch, reference: np.ndarray, candidate: np.ndarray, collected: list[Metrics]
) -> None:
    rtol = pair.tolerance.rtol if pair.tolerance else 0.0
    try:
        metrics = compare_logits(reference, candidate, rtol)
    except ValueError as e:  # shapes differ: the export is broken for this input
        pair.status, pair.reason = "fail", f"{e} on input {batch.label}"
        pair.per_input.append({"input": batch.label, "metrics": None, "violations": [str(e)]})
        return
    collected.append(metrics)
    broken = violations(metrics, pair.tolerance) if pair.tolerance else []
    pair.per_input.append({"input": batch.label, "metrics": metrics.to_dict(), "violations": broken})


def _conclude(pair: PairResult, collected: list[Metrics]) -> None:
    """Pool the batches; judge the pooled metrics (top-1 and KL are means over all rows)."""
    if not collected:
        return
    pair.metrics = Metrics.merge(collected)
    ranked = [r for r in pair.per_input if r["metrics"] is not None]
    worst = max(ranked, key=lambda r: math.inf if math.isnan(r["metrics"]["max_rel"]) else r["metrics"]["max_rel"])
    pair.worst_input = worst["input"]
    if pair.tolerance is not None:
        pair.violations = violations(pair.metrics, pair.tolerance)
        if pair.violations:
            pair.status = "fail"


# ---- decoders ------------------------------------------------------------------------------------------


def _verify_decoders(
    manifest: Manifest,
    cfg,
    models: TorchModels,
    reference: str,
    dtype: str,
    device: str,
    threads: int | None,
    tolerance: Tolerance,
    seed: int,
    progress,
) -> list[PairResult]:
    """Every decoder graph (`*.decoder.onnx`, `*.static.onnx`) against its torch model (`models`, as verify_export
    built them; released here once the torch models have decoded) decoding the same tokens with a growing cache (see decode_cases): a static graph is
    held to the same reference as a growing one, at every step. A static graph decodes cases that fit its cache."""
    variants = (BASELINE, DECOMPOSED_BASELINE, UNFOLDED, FOLDED)
    graphs = [(v, cache) for cache in KV_CACHES for v in variants if manifest.has_artifact(v, decoder=cache)]
    baseline_ref = reference if _baseline_only(manifest) else TORCH_BASELINE
    refs = {g: baseline_ref if g[0] in (BASELINE, DECOMPOSED_BASELINE) else reference for g in graphs}
    keys = {g: artifact_key(*g) for g in graphs}
    pairs = {g: PairResult(refs[g], keys[g], "export", tolerance) for g in graphs}
    cache_len = {GROWING: None, STATIC: manifest.max_cache or cfg.max_seq_len}
    cases = {cache: decode_cases(cfg.vocab_size, cache_len[cache] or cfg.max_seq_len, seed) for _, cache in graphs}
    for g, pair in pairs.items():
        why_not = (
            "bf16: numpy has no bfloat16 to feed the KV cache from the host"
            if dtype == "bf16"
            else f"{'the static cache' if g[1] == STATIC else 'the context'} ({cache_len[g[1]] or cfg.max_seq_len}) "
            f"holds no prompt and {DECODE_STEPS} steps"
            if not cases[g[1]]
            else None
        )
        if why_not:
            pair.status, pair.reason = "skipped", why_not
    judged = [g for g in graphs if pairs[g].status != "skipped"]
    if not judged:
        return list(pairs.values())
    torch_engine, graph_engine = ENGINES[REFERENCE_ENGINE], ENGINES[GRAPH_ENGINE]
    collected: dict[tuple, list[Metrics]] = {g: [] for g in judged}
    total = sum(len(cases[g[1]]) for g in judged) + len({(refs[g], c.label) for g in judged for c in cases[g[1]]})
    done = 0
    # One model in memory at a time, as for the prefill: each torch reference decodes every case a graph needs of it,
    # then the checkpoint goes; then each graph in turn, held to those logits.
    reference_logits: dict[tuple[str, str], list[np.ndarray]] = {}  # (torch model, case label) -> per-step logits
    for name in dict.fromkeys(refs[g] for g in judged):
        with torch_engine.runner(models[name], device="cpu", decoder=True, name=f"{name} decoder") as runner:
            for case in {c.label: c for g in judged if refs[g] == name for c in cases[g[1]]}.values():
                progress(done, total, f"{name} decoding {case.label}")
                reference_logits[(name, case.label)] = _decode_logits(runner, case.ids, cfg, "fp32")
                done += 1
        del runner
        _return_freed_memory()
    models.release()
    for g in judged:
        with graph_engine.runner(manifest.artifact(*g), device=device, threads=threads, decoder=g[1]) as runner:
            for case in cases[g[1]]:
                progress(done, total, f"{keys[g]} decoding {case.label}")
                candidate = _decode_logits(runner, case.ids, cfg, dtype, cache_len[g[1]])
                done += 1
                for k, (ref, cand) in enumerate(zip(reference_logits[(refs[g], case.label)], candidate)):
                    label = f"{case.label} {'prompt' if k == 0 else f'step {k}'}"
                    _compare_one(pairs[g], InputBatch(label, case.ids), ref, cand, collected[g])
        del runner
        _return_freed_memory()
    for g in judged:
        _conclude(pairs[g], collected[g])
    return list(pairs.values())


def _decode_logits(
    runner: Runner, ids: np.ndarray, cfg, kv_dtype: str, cache_len: int | None = None
) -> list[np.ndarray]:
    """Logits of the prompt (ids minus the last DECODE_STEPS columns, empty past; a static cache of `cache_len`) and of
    each KV-cached step fed the next column of ids; the presents stay in the runner's own form between steps."""
    from taperfold.bench.decode import prompt_feeds, step_feeds

    prompt = ids.shape[1] - DECODE_STEPS
    feeds = prompt_feeds(cfg, ids[:, :prompt], kv_dtype, cache_len)
    logits = []
    for k in range(DECODE_STEPS + 1):
        out = runner.infer(feeds)
        logits.append(out[OUTPUT].astype(np.float32))  # infer() returns host arrays
        if k < DECODE_STEPS:
            feeds = step_feeds(cfg, ids[:, prompt + k : prompt + k + 1], out, prompt + k, cache_len is not None)
    return logits
