"""`taperfold bench` as one library call: a `BenchRequest` (the command's options, normalised once) and `run_request`,
which checks it against its source and outputs, runs it, prints its tables and writes its reports. The command line
builds the request from what it parsed (`BenchRequest.from_cli`); Python builds one directly."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from taperfold.bench.measure import (
    cells,
    fit_to_context,
    load_bench,
    run_bench,
)
from taperfold.bench.report import BenchReport, require_matplotlib, write_csv, write_plot
from taperfold.bench.request import BenchRequest
from taperfold.bench.source import Source, resolve_source
from taperfold.errors import TaperfoldError
from taperfold.fsutil import Output, check_outputs, files_in, write_json_atomic
from taperfold.ui import bench_progress, err, print_bench

if TYPE_CHECKING:
    from taperfold.bench.serve import ServeReport

REPORTS = {"prefill": "bench.json", "decode": "bench-decode.json", "serve": "bench-serve.json"}  # in DIR, per --mode


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
