"""Terminal output: progress on stderr (stdout stays clean for --json), tables for results."""

from __future__ import annotations

import contextlib
import math
import os
from typing import TYPE_CHECKING

from rich.console import Console
from rich.padding import Padding
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from taperfold.artifacts.genai_folder import GenaiDetails
from taperfold.artifacts.onnx_graph import OnnxDetails
from taperfold.bench.report import UNIT, speedup_labels
from taperfold.exportdir import FOLDED

if TYPE_CHECKING:
    from taperfold.bench.report import BenchReport
    from taperfold.compare import Metrics
    from taperfold.describe import Description
    from taperfold.manifest import Manifest
    from taperfold.passes.check_fold import FoldCheck
    from taperfold.passes.report import FoldReport, ProjectionReport
    from taperfold.verify.report import VerifyReport


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich would exit 1; the reader went away (`| head`), and taperfold.cli ends quietly as coreutils do
        raise BrokenPipeError


out = _Console(highlight=False)
err = _Console(stderr=True, highlight=False)
if not out.is_terminal and "COLUMNS" not in os.environ:  # piped or captured: no 80-column squeeze, no wrapping
    out.width, out.soft_wrap = 240, True


@contextlib.contextmanager
def train_progress(total: int, quiet: bool = False):
    """Yields on_step(step, record): a progress bar with loss and gate on a terminal, and a loss log line
    every 50 steps (the only output in logs and pipes)."""
    if quiet:
        yield lambda step, record: None
        return

    def log(console: Console, step: int, record: dict) -> None:
        if step % 50 == 0 or step == total:
            console.print(
                f"step {step:5d}  loss {record['loss']:.4f}  aux {record['aux']:.4f}  "
                f"gate {record['gate']:.4f}  lr {record['lr']:.2e}"
            )

    if not err.is_terminal:
        yield lambda step, record: log(err, step, record)
        return
    columns = [
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("train", total=total, info="")

        def on_step(step: int, record: dict) -> None:
            progress.update(task, completed=step, info=f"loss {record['loss']:.3f}  gate {record['gate']:.3f}")
            log(progress.console, step, record)

        yield on_step


def print_trained(val_loss: float, gate: float, steps: int, seconds: float, checkpoint: str | os.PathLike) -> None:
    """The line `taperfold train` ends with: the validation loss, the gate it ended at, and where it went."""
    out.print(
        f"validation loss {val_loss:.4f} (gate {gate:g}, {steps} steps, {seconds:.0f} s) -> {checkpoint}",
        markup=False,
        emoji=False,
        soft_wrap=True,
    )


@contextlib.contextmanager
def stage_status(quiet: bool = False):
    """Yields on_stage(name): a spinner naming the current long step."""
    if quiet or not err.is_terminal:
        yield lambda name: None
        return
    with err.status("starting") as status:
        yield lambda name: status.update(name + " ...")


WIDE = 120  # narrower consoles get lists instead of wide tables


def _fmt(x, spec=".4g"):
    return "-" if x is None else format(x, spec)


def print_inspect(info: Description) -> None:
    out.print(
        f"[bold]{info.path}[/]: {info.arch}, taper={info.taper}, "
        + (f"norm={info.norm}, " if info.norm else "")
        + f"aux={info.aux}, "
        f"{info.parameters:,} parameters, step {info.step}, gate {info.gate:g}"
        + (f", val loss {info.val_loss:.4f}" if info.val_loss is not None else "")
    )
    table = Table(show_lines=False)
    for col in ("norm", "kind", "gate", "c", "γ̃ min", "γ̃ max", "folds into", "foldable"):
        table.add_column(col, no_wrap=col == "norm")
    for n in info.norms:
        readers = ", ".join(r.rsplit(".", 1)[-1] for r in n.folds_into) or "-"
        verdict = "[green]yes[/]" if n.foldable else f"[yellow]no[/]: {n.reason}"
        if n.foldable and n.alpha is not None:  # DyT: what folds and what stays
            verdict += f" (γ, β; tanh(αh) stays, α {n.alpha:.4g})"
        table.add_row(
            n.name,
            n.kind,
            _fmt(n.gate, "g"),
            _fmt(n.c),
            _fmt(n.gamma_tilde_min),
            _fmt(n.gamma_tilde_max),
            readers,
            verdict,
        )
    out.print(table)
    out.print(f"{info.foldable} of {len(info.norms)} norm layers can be folded")
    if info.how_to_taper:
        out.print(f"a plain model: {info.how_to_taper}; then {info.would_fold} of them fold", highlight=False)


def print_export(manifest: Manifest, out_dir) -> None:
    table = Table(title=f"exported to {out_dir}")
    graphs = [(record, record.details) for record in manifest.records() if isinstance(record.details, OnnxDetails)]
    fused = any(details.ort_fusions is not None for _, details in graphs)
    for col in ("variant", "file", "size (MB)", "opset", "norm ops", *(("ONNX Runtime fusions",) if fused else ())):
        table.add_column(col)
    for record in manifest.records():
        size = (record.bytes + record.external_data_bytes) / 1e6
        details = record.details if isinstance(record.details, OnnxDetails) else OnnxDetails()  # another kind: none
        opset = f"{details.opset} ({details.opset_source})" if details.opset is not None else ""
        norms = ", ".join(f"{op} ×{n}" for op, n in (details.norm_ops or {}).items())
        ort = details.ort_fusions
        fusions = "–" if ort is None else ", ".join(f"{op} ×{n}" for op, n in ort.items()) or "none matched"
        if details.ort_fusions_skipped:
            fusions = f"left as traced: {details.ort_fusions_skipped}"
        table.add_row(record.key, record.path, f"{size:.2f}", opset, norms, *((fusions,) if fused else ()))
    out.print(table)
    if manifest.note:
        out.print(manifest.note, highlight=False)
    folders = [r.details for r in manifest.records() if isinstance(r.details, GenaiDetails)]
    for declined in dict.fromkeys(d.builder_declined for d in folders if d.builder_declined is not None):
        out.print(
            f"note: onnxruntime-genai folders by the traced route, not the builder's: {declined}", highlight=False
        )
    summary = (manifest.report(FOLDED, "fold") or {}).get("summary", {})
    if summary:
        out.print("fold: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    t = manifest.timings
    built = "".join(f", building {kind} {seconds:.1f} s" for kind, seconds in t.build_s.items())
    fusing = f", ONNX Runtime fusions {t.ort_fusions_s:.1f} s" if t.ort_fusions_s is not None else ""
    traced = {details.traced_layers for _, details in graphs if details.traced_layers is not None}
    stamped = (
        f" ({'/'.join(map(str, sorted(traced)))} of {manifest.config().n_layers} layers traced, the others stamped out "
        f"in {t.stamp_layers_s or 0.0:.1f} s)"
        if traced
        else ""
    )
    total, rest = (f"export {t.total_s:.1f} s: ", f", the rest {t.total_s - t.counted_s:.1f} s (reading the model, "
                   "the manifest)") if t.total_s is not None else ("", "")  # fmt: skip
    out.print(
        f"{total}torch export {t.torch_export_s:.1f} s{stamped}, passes {t.passes_s:.2f} s{fusing}, "
        f"writing {t.write_s:.2f} s{built}{rest}"
    )


@contextlib.contextmanager
def step_progress(label: str, quiet: bool = False):
    """Yields on_step(done, total, description): a progress bar for work whose size the callee knows."""
    if quiet or not err.is_terminal:  # no bar in logs and pipes
        yield lambda done, total, description: None
        return
    columns = [
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("", total=None)
        yield lambda done, total, description: progress.update(
            task, completed=done, total=total, description=description
        )


METRIC_COLUMNS = ("max abs", "max rel", "rtol", "mean abs", "cosine", "top-1", "top-5", "KL")


def print_verify(report: VerifyReport) -> None:
    """One row per pair, pooled over the input batches (worst case for maxima, means over rows)."""
    styles = {
        "pass": "[green]PASS[/]",
        "fail": "[bold red]FAIL[/]",
        "info": "[cyan]INFO[/]",
        "skipped": "[yellow]SKIPPED[/]",
    }
    table = Table(
        title=f"{report.export_dir}: {report.dtype}, logits={report.logits}, "
        f"{len(report.inputs)} input batch(es), device {report.device}"
    )
    scored = any(p.metrics is not None and p.metrics.scored for p in report.pairs)
    for col in ("pair", "status", *METRIC_COLUMNS, *(["perplexity"] if scored else []), "worst input / note"):
        table.add_column(col)
    for pair in report.pairs:
        m = {k: v for k, v in (pair.metrics.to_dict() if pair.metrics else {}).items() if math.isfinite(v)}
        perplexity = [_perplexity(pair.metrics)] if scored else []
        tol = pair.tolerance.to_dict() if pair.tolerance else {}
        worst = f"worst: {pair.worst_input}" if pair.worst_input else ""
        note = pair.reason or "; ".join([*pair.violations, worst] if pair.violations else [worst])
        if pair.kind == "cost":
            note = f"cost of forcing g=0 (not judged); {note}"
        table.add_row(
            pair.name,
            styles[pair.status],
            _fmt(m.get("max_abs"), ".3g"),
            _fmt(m.get("max_rel"), ".3g"),
            _fmt(tol.get("rtol"), "g"),
            _fmt(m.get("mean_abs"), ".3g"),
            _fmt(m.get("cosine"), ".6f"),
            _fmt(m.get("top1"), ".4f"),
            _fmt(m.get("top5"), ".4f"),
            _fmt(m.get("kl"), ".3g"),
            *perplexity,
            note,
        )
    out.print(table)
    judged = [p for p in report.pairs if p.status in ("pass", "fail")]
    failed = [p for p in judged if p.status == "fail"]
    verdict = "[bold red]FAIL[/]" if failed else "[bold green]PASS[/]"
    out.print(f"{verdict}: {len(judged) - len(failed)} of {len(judged)} pairs within tolerance")
    if report.closer():
        out.print(report.closer(), highlight=False)
    if report.note:
        out.print(report.note, highlight=False)


def _perplexity(metrics: Metrics | None) -> str:
    """The reference's perplexity -> the candidate's, and over how many tokens; empty where none was scored."""
    if metrics is None or not metrics.scored:
        return ""
    ref, cand = math.exp(metrics.nll_reference), math.exp(metrics.nll_candidate)
    return f"{ref:.4g} -> {cand:.4g} (x{metrics.ppl_ratio:.4f}, {metrics.scored} tokens)"


def print_fold_report(src: str | os.PathLike, dst: str | os.PathLike, report: FoldReport, console: Console) -> None:
    """`taperfold fold`: one row per norm found, then the totals (or one line when there was nothing to fold)."""
    from taperfold.passes import NormStatus

    s = report.summary()
    found = {NormStatus.FOLDED, NormStatus.KEPT, NormStatus.NOT_FOLDABLE, NormStatus.WEIGHTS_MERGED}
    if not any(entry.status in found for entry in report.norms):
        real = f"; {s['real_norm']} real norm(s) left as they are" if s["real_norm"] else ""
        wrote = f"wrote {dst}" if report.changed_weights else f"wrote {dst} unchanged"
        console.print(
            f"{src}: nothing to fold (no constant-scale norm found{real}); {wrote}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        _print_projections(report.projections, console)
        return
    if console.width >= WIDE:
        table = Table(title=f"taperfold fold {src}")
        for column in ("norm", "kind", "status", "consumers", "reason"):
            table.add_column(column, no_wrap=column == "norm", overflow="fold")
        for entry in report.norms:
            table.add_row(entry.name, entry.kind, entry.status.value, ", ".join(entry.consumers), entry.reason)
        console.print(table)
    else:  # a narrow terminal: a table would squeeze every cell into a column of broken words; one norm a line
        console.print(f"taperfold fold {src}", highlight=False, markup=False)
        for entry in report.norms:
            readers = f", {len(entry.consumers)} reader(s)" if entry.consumers else ""
            console.print(f"  {entry.name}: {entry.kind}, {entry.status.value}{readers}", highlight=False, markup=False)
            if entry.reason:
                console.print(Padding(Text(entry.reason), (0, 0, 0, 6)), highlight=False)
    merged = f", {s['weights_merged']} real norm gain(s) merged" if s["weights_merged"] else ""
    console.print(
        f"{s['folded']} of {s['folded'] + s['kept']} constant-scale norms folded, {s['kept']} kept, "
        f"{s['not_foldable']} not foldable, {s['real_norm']} real norms untouched{merged}; "
        f"{s['bytes_rewritten'] / 2**20:.2f} MiB of weights rewritten, {s['initializers_copied']} copied; "
        f"nodes {s['nodes_before']} -> {s['nodes_after']}; wrote {dst}",
        highlight=False,
    )
    _print_projections(report.projections, console)
    if report.constants_left:
        console.print(
            f"note: {len(report.constants_left)} node(s) still compute constants at run time "
            f"(too large to fold), e.g. {report.constants_left[0]}",
            highlight=False,
        )
    if s["check_output"] != "passed":
        console.print(f"note: onnx.checker {s['check_output']} (on the input it {s['check_input']})", highlight=False)


def _print_projections(projections: ProjectionReport | None, console: Console) -> None:
    """`fold --fuse-projections`: one line of totals, then each fused group's layers (module paths where known)."""
    if projections is None:
        return
    s = projections.summary()
    console.print(
        f"projections: {s['groups']} group(s) of {s['layers_fused']} linear layers fused, "
        f"linear layers {s['linear_before']} -> {s['linear_after']}, {s['left']} reader(s) left",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    for group in projections.groups:
        names = [module or node for module, node in zip(group.modules, group.nodes)]
        console.print(f"  {' + '.join(names)} -> {group.fused}", highlight=False, markup=False, soft_wrap=True)


def print_fold_check(check: FoldCheck, console: Console) -> None:
    """`taperfold fold --verify`: the metrics of each output, unfolded against folded."""
    shapes = ", ".join(f"{k}:{'x'.join(map(str, v))}" for k, v in check.inputs.items())
    table = Table(title=f"input -> folded in ONNX Runtime (CPU), inputs {shapes}")
    for col in ("output", "status", *METRIC_COLUMNS, "note"):
        table.add_column(col)
    for o in check.outputs:
        m = o.metrics
        cells = (
            ["", "", "", "", "", "", "", ""]
            if m is None
            else [
                f"{m.max_abs:.3g}",
                f"{m.max_rel:.3g}",
                f"{o.tolerance.rtol:g}" if o.tolerance else "",  # (a float output has both)
                f"{m.mean_abs:.3g}",
                f"{m.cosine:.6f}",
                f"{m.top1:.4f}",
                f"{m.top5:.4f}",
                f"{m.kl:.3g}",
            ]
        )
        table.add_row(o.name, "[green]PASS[/]" if o.passed else "[bold red]FAIL[/]", *cells, "; ".join(o.violations))
    console.print(table)
    failed = [o for o in check.outputs if not o.passed]
    verdict = "[bold red]FAIL[/]" if failed else "[bold green]PASS[/]"
    console.print(f"{verdict}: {len(check.outputs) - len(failed)} of {len(check.outputs)} outputs within tolerance")


# how a throughput table's title names the timing its figures come from (a row's `throughput_from`)
THROUGHPUT_FROM = {"pipelined": "pipelined calls", "synced": "synced calls", "generation": "whole generations"}


@contextlib.contextmanager
def bench_progress(total: int):
    """Yields on_call(): one tick per model call (first runs, warm-up and timed calls)."""
    if not err.is_terminal:  # no bar in logs and pipes
        yield lambda: None
        return
    columns = [TextColumn("benchmark"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("bench", total=total)
        yield lambda: progress.advance(task)


def throughput_table(report: BenchReport, phase: str) -> Table:
    """Tokens per second of every variant: the median of the timing each row names in `throughput_from`."""
    scale, unit = UNIT[phase]
    rows = report.rows(phase)
    timing = "/".join(dict.fromkeys(THROUGHPUT_FROM[r.throughput_from] for r in rows))
    title = (
        f"{phase} throughput ({unit}, median, {timing}) — {report.engine} {report.device} "
        f"{report.dtype}{f' ({report.settings.precision} weights)' if report.settings.precision else ''}, "
        f"{report.threads} threads"
    )
    table = Table(title=title)
    table.add_column("batch", justify="right")
    table.add_column("prompt" if phase == "decode" else "seq", justify="right")
    variants = report.labels()
    for v in variants:
        table.add_column(v, justify="right")
    speedup_of = speedup_labels(variants)
    for v in speedup_of:
        table.add_column(f"{v} ×", justify="right")
    by_key = {(r.batch, r.seq, r.label): r for r in rows}
    for batch, seq in dict.fromkeys((b, s) for b, s, _ in by_key):
        cells = [f"{by_key[batch, seq, v].tokens_per_s / scale:.1f}" for v in variants]
        cells += [f"{by_key[batch, seq, v].speedup_vs_baseline:.3f}" for v in speedup_of]
        table.add_row(str(batch), str(seq), *cells)
    return table


def detail_table(report: BenchReport) -> Table:
    """Latency: the synced calls (each timed alone, waited for) of every row."""
    table = Table(
        title="latency per call (ms, synced calls)"
        if report.mode == "prefill"
        else "latency (ms, synced calls): prefill per prompt, decode per token"
    )
    for col in ("phase", "variant", "B", "T", "n", "median", "mean", "p90", "p99", "min", "std", "CV %", "first run"):
        table.add_column(col, justify="left" if col in ("phase", "variant") else "right")
    threshold = report.settings.cv_warn_pct
    for r in report.results:
        s = r.synced.stats_ms
        cv = f"{s.cv_pct:.1f}"
        table.add_row(
            r.phase,
            r.label,
            str(r.batch),
            str(r.seq),
            str(s.n),
            *(f"{value:.3f}" for value in (s.median, s.mean, s.p90, s.p99, s.min, s.std)),
            f"[yellow]{cv}[/]" if s.cv_pct > threshold else cv,
            f"{r.first_run_ms:.3f}",
        )
    return table


def print_bench(report: BenchReport) -> None:
    for phase in report.phases():
        out.print(throughput_table(report, phase))
    out.print(detail_table(report))
    env = report.environment
    device = env.get("gpu", {}).get("name") if report.device.startswith("cuda") else env["cpu"]
    s = report.settings
    out.print(
        f"{device}; warm-up {s.warmup}, iters {s.iters} in {s.rounds} alternating rounds; "
        f"first run reported apart; {report.seconds:.0f} s"
    )
    for mode, meaning in report.timing.items():
        out.print(f"{mode}: {meaning}", highlight=False)
    if report.fused_projections:
        groups = ", ".join(f"{variant} {n}" for variant, n in report.projection_groups.items())
        out.print(
            f"projections fused: each group of siblings (q/k/v, gate/up) runs as one layer; groups: {groups}",
            highlight=False,
        )
    elif report.fused_projections is not None:  # (a report from before it was recorded says nothing)
        out.print("projections unfused: each linear layer runs on its own", highlight=False)
    if report.kv_cache:
        length = f" of {report.cache_length} positions" if report.cache_length else ""
        basis = f" ({report.kv_cache_basis})" if report.kv_cache_basis and report.kv_cache_basis != "--kv-cache" else ""
        out.print(f"decoders: {report.kv_cache} KV cache{length}{basis}", highlight=False)
    if s.precision:
        out.print(f"weights: {s.precision} (the export's weight-quantized graphs, MatMulNBits)", highlight=False)
    for made in report.against:
        out.print(
            f"{made['name']}: the untapered model by {made['tool']} {made['version']}, {made['precision']} "
            f"({made['command']}; built in {made['build_s']} s, {made['folder']})",
            highlight=False,
            soft_wrap=True,
        )
    if report.cuda_graph:
        out.print(
            "rows marked (cuda graph) time replays of one captured CUDA graph per shape; the others run plainly",
            highlight=False,
        )
    if report.compile:
        out.print(
            f"every model torch.compile'd on its own (mode {report.compile_mode}, no fallback to eager)",
            highlight=False,
        )
    for label, kinds in report.setup_s.items():
        spent = ", ".join(f"{kind} {seconds:.1f} s" for kind, seconds in kinds.items())
        out.print(f"{label}: {spent} (one-off, not in the timings)", highlight=False)
    warnings = report.warnings
    for warning in warnings:
        err.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    if warnings:
        err.print(
            f"CV above {s.cv_warn_pct:g} % means the timings spread widely (a busy or throttling "
            "machine?): compare medians with care, or rerun with more --iters and --rounds",
            soft_wrap=True,
        )
