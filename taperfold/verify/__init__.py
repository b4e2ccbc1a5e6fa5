"""`taperfold verify`: run an export's models on the same tokens and hold their logits to tolerances.

Three parts, as Polygraphy keeps them apart: the comparison plan (taperfold.verify.plan: which pairs, with which
bounds, which models run in which order, every artifact verified as its kind says), the scheduler
(taperfold.verify.run: one model in memory at a time, typed outputs) and the judge (taperfold.verify.judge: metrics
and bounds, taperfold.compare). The report is typed (taperfold.verify.report).

The reference is the checkpoint named in manifest.json, rebuilt in PyTorch (fp32, CPU) at its stored gate. Pairs
(reference -> candidate):

- checkpoint -> unfolded: the exporter's own fidelity (unfolded.onnx, ONNX Runtime)
- checkpoint -> folded: what a user gets (model.onnx)
- unfolded -> folded: the fold alone, held to a tighter bound in fp32
- baseline (torch) -> baseline: the plain-norm model (`variants.baseline_of`) against baseline.onnx, and
  baseline-decomposed -> baseline: the fused norm against the plain ops it replaced (fold bound)
- an export of a plain (untapered) checkpoint has its baseline only: checkpoint -> baseline, and the
  report's note says there is nothing folded to verify
- checkpoint -> folded.plan: a TensorRT plan, when the export has one; skipped, with the reason, when
  TensorRT or a GPU is missing
- with decoders (`export --kv-cache`), every `*.decoder.onnx` and `*.static.onnx` against the same torch model
  decoding with a growing cache: a prompt with an empty past, then DECODE_STEPS KV-cached steps, each step's
  logits compared (a static decoder's prompt and steps write its fixed-size cache at their positions)
- any other artifact as its kind says (an engine's logits, or the kind's own check); with `--engine` naming the
  engine of a checked kind (vllm), that engine's greedy generations too: tokens and log-probabilities, each prompt
  alone and all at once, against the checkpoint (taperfold.verify.generations)

Every graph runs on shapes far from the one the exporter traced (export.TRACE_SHAPE, TRACE_PAST):
batch 1 and 4, sequence 1 to the model's longest, past 0 to the longest, so a graph that only works
at its tracing shape (a fused op that fixed a dynamic dimension) fails here.

An export made with --force-gate0 comes from a checkpoint whose gate is not 0, so folding changed the
function on purpose. Its reference is then the checkpoint built at g = 0, which the export must match,
and one more pair, checkpoint@g=<gate> -> folded, shows the cost of forcing g = 0. That pair is
reported but never fails: the user asked for the change, and how much loss it is worth is theirs to judge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from taperfold.engines import ENGINES
from taperfold.errors import TaperfoldError
from taperfold.fsutil import Output, check_outputs, files_in, write_json_atomic
from taperfold.manifest import Manifest, read_manifest
from taperfold.runners.base import RunnerError
from taperfold.sources import ModelSource, checkpoint_digest, open_source
from taperfold.verify.generations import GenerationCheck, run_generation_check
from taperfold.verify.inputs import (
    DECODE_STEPS,
    InputBatch,
    checked_ids,
    decode_cases,
    random_inputs,
    read_text,
    text_windows,
    tokens_from_file,
)
from taperfold.verify.judge import Judge
from taperfold.verify.plan import REFERENCE_ENGINE, TORCH_BASELINE, PlanContext, make_plan
from taperfold.verify.report import REPORT, PairResult, VerifyReport
from taperfold.verify.run import run_models

GRAPH_ENGINE = "ort"  # the engine of the ONNX graphs unless told (--engine openvino), and of --device
NOTHING_FOLDED = (
    "nothing folded to verify: {checkpoint} is a plain model (no tapered norms); checked its "
    "baseline graph against its own forward"
)

__all__ = [
    "DECODE_STEPS",
    "REPORT",
    "InputBatch",
    "PairResult",
    "VerifyReport",
    "decode_cases",
    "random_inputs",
    "tokens_from_file",
    "verify_and_write",
    "verify_export",
]


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


class TorchModels(Mapping):
    """The torch models verify holds graphs to, by name, each built from the checkpoint when asked for and not kept:
    they hold the checkpoint's own tensors (sources.ModelSource.build), so several at once cost one copy of the
    weights. `release()` lets the checkpoint go; a model asked for afterwards reads it again (checked against
    manifest.json as the first time)."""

    def __init__(self, manifest: Manifest, source: ModelSource, builders: dict[str, Callable[[ModelSource], object]]):
        self._manifest, self._builders = manifest, builders
        self._source: ModelSource | None = source

    def __getitem__(self, name: str):
        if self._source is None:
            self._source = _load_reference_checkpoint(self._manifest)
        return self._builders[name](self._source)

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)

    def release(self) -> None:
        self._source = None


def verify_export(
    export_dir: str | Path,
    inputs: list[InputBatch] | None = None,
    device: str = "cpu",
    tolerances: dict | None = None,
    seed: int = 0,
    threads: int | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
    engine: str = GRAPH_ENGINE,
    text: str | Path | None = None,
) -> VerifyReport:
    """Compare every artifact in `export_dir` with the checkpoint it came from (see the module docstring).

    `inputs`: token batches (default: seeded random ones over several shapes); `text`: a text file instead, encoded
    with the checkpoint's tokenizer and cut into windows of its context (verify.inputs.text_windows). Given tokens
    (either) are decoded too, and every pair reports the perplexity both its models give them. `tolerances`:
    overrides {"rtol", "min_top1", "max_kl", "max_ppl_ratio"} applied to every judged pair; `threads`: CPU threads
    for the torch reference and ONNX Runtime; `on_progress(done, total, description)` is called before each model
    run; `engine`: the engine that runs the ONNX graphs (ort, or openvino); other kinds run on theirs.
    """
    if inputs is not None and text is not None:
        raise TaperfoldError("pass token batches or a text, not both")
    text_bytes = read_text(text) if text is not None else None
    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    graph_engine = ENGINES.get(engine)
    if graph_engine is None or not _chosen_by_engine(graph_engine.runs):
        others = [e.name for e in ENGINES.values() if not e.runs_models and _chosen_by_engine(e.runs)]
        raise TaperfoldError(
            f"--engine {engine}: verify's --engine chooses what runs the ONNX graphs, or an engine of artifacts "
            f"otherwise only checked: {' or '.join(others)} (other artifacts run on their own engine anyway)"
        )
    if graph_engine.runs != "onnx" and not manifest.records(graph_engine.runs):
        raise TaperfoldError(
            f"--engine {engine}: {export_dir} holds no artifact {graph_engine.title} runs (kind {graph_engine.runs!r})"
        )
    graph_engine.require(device)
    ckpt = _load_reference_checkpoint(manifest)
    cfg, forced = ckpt.config, manifest.forced_gate0
    checkpoint_path, stored_gate = ckpt.path, ckpt.gate
    if text_bytes is not None:
        try:
            inputs = text_windows(str(text), ckpt.encode_text(text_bytes), cfg.max_seq_len)
        except UnicodeDecodeError as e:
            raise TaperfoldError(f"{text}: not UTF-8 text, which the checkpoint's tokenizer reads ({e})") from None
    batches = inputs if inputs is not None else random_inputs(cfg.vocab_size, cfg.max_seq_len, seed)
    id_arrays = [checked_ids(b, cfg.vocab_size, cfg.max_seq_len) for b in batches]

    reference = "checkpoint@g=0" if forced else "checkpoint"
    at_gate = f"checkpoint@g={stored_gate:g}" if forced else None
    builders: dict[str, Callable[[ModelSource], object]] = {
        reference: lambda source: source.build(gate=0.0 if forced else None),
        TORCH_BASELINE: lambda source: source.build_baseline(),
    }
    if at_gate:
        builders[at_gate] = lambda source: source.build()
    # built when asked for, from one copy of the checkpoint's weights; shared by the prefill and the decoder checks
    models = TorchModels(manifest, ckpt, builders)
    del ckpt  # `models` holds the weights now, and lets them go when the torch models have run
    overrides = {name: value for name, value in (tolerances or {}).items() if value is not None}
    ctx = PlanContext(
        manifest=manifest,
        cfg=cfg,
        torch_models=models,
        release_checkpoint=models.release,
        batches=list(zip(batches, id_arrays)),
        device=device,
        threads=threads,
        tolerances=overrides,
        seed=seed,
        reference=reference,
        at_gate=at_gate,
        engine=engine,
        user_tokens=inputs is not None,
    )
    plan = make_plan(ctx)
    judge = Judge(plan.pairs, given=set(overrides), scored=plan.scored)
    torch_threads = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        for outputs in run_models(plan.models, on_progress or (lambda done, total, description: None)):
            judge.take(outputs)
        generated = [_generations(check, models) for check in plan.generations]
    finally:
        torch.set_num_threads(torch_threads)
    return VerifyReport(
        export_dir=str(export_dir),
        dtype=manifest.dtype,
        logits=manifest.logits,
        device=device,
        engine=engine,
        forced_gate0=forced,
        note=NOTHING_FOLDED.format(checkpoint=checkpoint_path) if ctx.baseline_only else None,
        checkpoint={
            "path": str(checkpoint_path),
            "sha256": manifest.checkpoint_sha256,
            "gate": stored_gate,
            "reference_gate": 0.0 if forced else stored_gate,
        },
        inputs=[{"label": b.label, "shape": list(ids.shape)} for b, ids in zip(batches, id_arrays)],
        pairs=[*judge.results(), *plan.checked, *generated],
    )


def verify_and_write(
    export_dir: str | Path,
    *,
    tokens_file: str | Path | None = None,
    text: str | Path | None = None,
    device: str = "cpu",
    engine: str = GRAPH_ENGINE,
    tolerances: dict | None = None,
    seed: int = 0,
    threads: int | None = None,
    quiet: bool = False,
) -> VerifyReport:
    """`verify_export` as `taperfold verify` runs it: DIR/verify.json checked before any work (it may replace only
    itself, never an input), the token ids of `tokens_file` read (verify.inputs.tokens_from_file), every pair run with
    a progress bar on a terminal unless `quiet`, and the report written to DIR/verify.json. A failed pair is in the
    report (`passed`), not raised."""
    from taperfold.ui import step_progress

    manifest = read_manifest(export_dir)  # the clearest message for a directory that is not an export
    report_path = Path(export_dir) / REPORT
    check_outputs(
        [Output(report_path, REPORT, within=export_dir)],
        inputs=[tokens_file, text, manifest.checkpoint, *files_in(export_dir, keep=report_path)],
    )
    inputs = tokens_from_file(tokens_file) if tokens_file else None
    with step_progress("verifying", quiet=quiet) as on_step:
        report = verify_export(
            export_dir,
            inputs=inputs,
            device=device,
            tolerances=tolerances,
            seed=seed,
            threads=threads,
            on_progress=on_step,
            engine=engine,
            text=text,
        )
    write_json_atomic(report_path, report.to_json(), within=export_dir)
    return report


def _chosen_by_engine(kind: str) -> bool:
    """Whether --engine chooses how artifacts of `kind` are verified: the ONNX graphs (ort or openvino), or a kind
    otherwise only checked, whose engine then runs it too (vllm)."""
    from taperfold.artifacts import artifact_kind
    from taperfold.artifacts.base import CHECKED
    from taperfold.engines import MODELS

    return kind == "onnx" or (kind != MODELS and artifact_kind(kind).verified == CHECKED)


def _generations(check: GenerationCheck, models: TorchModels) -> PairResult:
    """`check` run and judged (taperfold.verify.generations); a runner that fails fails its pair, in one line."""
    try:
        return run_generation_check(check, models[check.reference], ENGINES[REFERENCE_ENGINE])
    except RunnerError as e:
        check.result.status, check.result.reason = "fail", f"{check.candidate} did not run: {e}"
        return check.result
    finally:
        models.release()
