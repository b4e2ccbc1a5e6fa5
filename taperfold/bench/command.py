"""`taperfold bench` as one library call: a `BenchRequest` (the command's options, normalised once) and `run_request`,
which checks it against its source and outputs, runs it, prints its tables and writes its reports. The command line
builds the request from what it parsed (`BenchRequest.from_cli`); Python builds one directly."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taperfold.bench.measure import (
    AUTO,
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPT,
    DEFAULT_SEQS,
    FUSED,
    MAX_BATCH,
    UNFUSED,
    BenchOptions,
    cells,
    fit_to_context,
    load_bench,
    run_bench,
)
from taperfold.bench.report import BenchReport, require_matplotlib, write_csv, write_plot
from taperfold.bench.source import Source, resolve_source
from taperfold.engines import ENGINES, all_options, changed_options
from taperfold.errors import TaperfoldError
from taperfold.exportdir import VARIANTS, canonical_variants
from taperfold.fsutil import Output, check_outputs, files_in, write_json_atomic
from taperfold.ui import bench_progress, err, print_bench

if TYPE_CHECKING:
    from taperfold.bench.serve import ServeReport

REPORTS = {"prefill": "bench.json", "decode": "bench-decode.json", "serve": "bench-serve.json"}  # in DIR, per --mode


@dataclass(frozen=True)
class BenchRequest:
    """What one `taperfold bench` asks for. None: not given, resolved against the source when the request runs (the
    defaults --help states). The comma-separated lists stay text until the mode that reads them parses them (--batch
    and --seq: prefill and decode; --concurrency: serve), so that a run refuses only the lists it uses."""

    export_dir: str | None = None  # exactly one of export_dir, checkpoint and preset (resolve_source)
    checkpoint: str | None = None
    preset: str | None = None
    arch: str = "llama"  # with preset
    engine: str | None = None  # None: ort for an export directory, torch for a checkpoint or preset
    variants: tuple[str, ...] = VARIANTS  # canonical names
    batches: str = "1,4"
    seqs: str | None = None
    warmup: int = 10
    iters: int = 50
    rounds: int | None = None
    mode: str = "prefill"  # prefill | decode | serve
    concurrency: str | None = None  # serve
    requests: int | None = None  # serve
    prompt: int | None = None
    new_tokens: int | None = None
    kv_cache: str | None = None
    dtype: str | None = None
    against: tuple[str, ...] = ()  # contenders built by other tools (bench.against)
    precision: str | None = None
    device: str | None = None
    threads: int | None = None
    engine_options: Mapping[str, Any] = field(default_factory=dict)  # runner keyword -> value, only those set
    fuse_projections: bool | None = None  # torch engine; None: as the export did (unfused for a checkpoint, preset)
    seed: int = 0
    json_path: str | None = None  # --report ('-': stdout)
    csv_path: str | None = None
    plot_path: str | None = None

    @classmethod
    def from_cli(cls, params: Mapping[str, Any]) -> BenchRequest:
        """The request of `taperfold bench`'s parsed options, by click's names (an engine option by its runner
        keyword, engines.all_options): --variants made canonical (refused in one line naming the option), --against
        split, and only the engine options the user changed kept."""
        given = dict(params)
        # the engine options the command line offers (those registered before it was built: engines.register)
        engine_options = changed_options({name: given.pop(name) for name in all_options() if name in given})
        spelled = given.pop("variants")
        try:
            variants = canonical_variants([v.strip() for v in spelled.split(",") if v.strip()])
        except TaperfoldError as e:
            raise TaperfoldError(f"--variants: {e}") from None
        against = tuple(name.strip() for name in (given.pop("against") or "").split(",") if name.strip())
        return cls(**given, variants=tuple(variants), against=against, engine_options=engine_options)

    @property
    def engine_name(self) -> str:
        return self.engine or ("ort" if self.export_dir else "torch")

    def options(self) -> BenchOptions:
        """The prefill or decode run's options, the lengths not given at their defaults (fit_to_context caps them)."""
        return BenchOptions(
            engine=self.engine_name,
            variants=list(self.variants),
            batches=int_list("--batch", self.batches, MAX_BATCH),
            seqs=int_list("--seq", self.seqs) if self.seqs else list(DEFAULT_SEQS),
            warmup=self.warmup,
            iters=self.iters,
            rounds=self.rounds or min(5, self.iters),
            mode=self.mode,
            prompt=self.prompt or DEFAULT_PROMPT,
            new_tokens=self.new_tokens or DEFAULT_NEW_TOKENS,
            kv_cache=self.kv_cache or AUTO,
            dtype=self.dtype,
            device=self.device or ENGINES[self.engine_name].default_device,
            threads=self.threads,
            engine_options=dict(self.engine_options),
            seed=self.seed,
            fuse_projections=AUTO if self.fuse_projections is None else FUSED if self.fuse_projections else UNFUSED,
            precision=self.precision,
            against=list(self.against),
        )


def int_list(option: str, text: str, maximum: int | None = None) -> list[int]:
    """A comma-separated list of positive integers, repeats dropped; refused in one line naming `option`."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise TaperfoldError(f"{option}: {text!r} is not a comma-separated list of positive integers")
    if maximum is not None and max(values) > maximum:
        raise TaperfoldError(f"{option}: {max(values)} is above the largest allowed, {maximum}")
    return list(dict.fromkeys(values))


def run_request(request: BenchRequest) -> BenchReport | ServeReport:
    """Run `request` as `taperfold bench` does: every refusal one line before any work (the options together, the
    source, the outputs), progress and notes on stderr, the tables on stdout (stderr while a report is written
    there), then the reports: --report, --csv, --plot, and DIR's own (REPORTS) when the source is an export."""
    if request.rounds is not None and request.rounds > request.iters:
        raise TaperfoldError(
            f"--rounds {request.rounds} exceeds --iters {request.iters}: every round needs a timed call"
        )
    if request.plot_path:
        require_matplotlib()
    source = resolve_source(request.export_dir, request.checkpoint, request.preset, request.arch)
    export_dir = request.export_dir
    dir_report = Path(export_dir) / REPORTS[request.mode] if export_dir else None
    plan = check_outputs(
        [
            Output(request.json_path, "--report", stream=True),
            Output(request.csv_path, "--csv", stream=True),
            Output(request.plot_path, "--plot", stream=True),
            Output(dir_report, REPORTS[request.mode], within=export_dir),
        ],
        inputs=[
            request.checkpoint,
            source.manifest.checkpoint if source.manifest is not None else None,
            *files_in(export_dir, keep=dir_report),
        ],
    )
    if request.mode == "serve" or request.concurrency or request.requests:
        from taperfold.bench.serve import bench_serve

        return bench_serve(request, source, dir_report, plan)
    report = _measure(request, source)
    with plan.human_output():
        print_bench(report)
    outputs = [  # the report's files: JSON, CSV and the plot are views of one BenchReport
        (request.json_path, lambda path: write_json_atomic(path, report.to_json())),
        (request.csv_path, lambda path: write_csv(path, report)),
        (request.plot_path, lambda path: write_plot(path, report)),
        (dir_report, lambda path: write_json_atomic(path, report.to_json(), within=export_dir)),
    ]
    for path, write in outputs:
        if path:
            write(path)
    return report


def _measure(request: BenchRequest, source: Source) -> BenchReport:
    """A prefill or decode run: the default lengths fitted to the model (a note each), every variant loaded, then
    timed with a progress bar on a terminal."""
    opts, notes = fit_to_context(
        request.options(),
        source,
        seqs_given=bool(request.seqs),
        prompt_given=request.prompt is not None,
        new_tokens_given=request.new_tokens is not None,
    )
    runners = len(opts.variants) * (2 if opts.engine_options.get("cuda_graph") else 1)  # --cuda-graph: both each
    total = len(cells(opts)) * runners * opts.schedule.calls_per_variant()
    with load_bench(source, opts) as loaded:
        for note in notes:  # once every runner has opened: a refusal stays one line
            err.print(f"note: {note}", highlight=False, soft_wrap=True)
        with bench_progress(total) as on_call:
            return run_bench(loaded, on_call)
