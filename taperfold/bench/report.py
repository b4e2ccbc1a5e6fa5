"""The benchmark's outputs: terminal tables, CSV, a plot, and a progress bar on stderr."""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_path
from taperfold.ui import err, out

CSV_COLUMNS = ["mode", "engine", "device", "dtype", "threads", "phase", "variant", "batch", "seq", "new_tokens",
               "iters", "first_run_ms", "median_ms", "mean_ms", "p90_ms", "p99_ms", "min_ms", "max_ms", "std_ms",
               "cv_pct", "tokens_per_s", "speedup_vs_baseline"]
# Prefill throughput in thousands of tokens per second, as the paper's Table 3; decode in tokens per second.
UNIT = {"prefill": (1e3, "k tokens/s"), "decode": (1.0, "tokens/s")}


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


def _phases(report: dict) -> list[str]:
    return list(dict.fromkeys(r["phase"] for r in report["results"]))


def _variants(report: dict) -> list[str]:
    return list(dict.fromkeys(r["variant"] for r in report["results"]))


def throughput_table(report: dict, phase: str) -> Table:
    scale, unit = UNIT[phase]
    title = (f"{phase} throughput ({unit}, median) — {report['engine']} {report['device']} {report['dtype']}, "
             f"{report['threads']} threads")
    table = Table(title=title)
    table.add_column("batch", justify="right")
    table.add_column("prompt" if phase == "decode" else "seq", justify="right")
    variants = _variants(report)
    for v in variants:
        table.add_column(v, justify="right")
    speedup_of = [v for v in variants if v != "baseline"] if "baseline" in variants else []
    for v in speedup_of:
        table.add_column(f"{v} ×", justify="right")
    rows = {(r["batch"], r["seq"], r["variant"]): r for r in report["results"] if r["phase"] == phase}
    for batch, seq in dict.fromkeys((b, s) for b, s, _ in rows):
        cells = [f"{rows[batch, seq, v]['tokens_per_s'] / scale:.1f}" for v in variants]
        cells += [f"{rows[batch, seq, v]['speedup_vs_baseline']:.3f}" for v in speedup_of]
        table.add_row(str(batch), str(seq), *cells)
    return table


def detail_table(report: dict) -> Table:
    table = Table(title="latency per call (ms)" if report["mode"] == "prefill" else
                  "latency (ms): prefill per prompt, decode per token")
    for col in ("phase", "variant", "B", "T", "n", "median", "mean", "p90", "p99", "min", "std", "CV %", "first run"):
        table.add_column(col, justify="left" if col in ("phase", "variant") else "right")
    threshold = report["settings"]["cv_warn_pct"]
    for r in report["results"]:
        s = r["stats_ms"]
        cv = f"{s['cv_pct']:.1f}"
        table.add_row(r["phase"], r["variant"], str(r["batch"]), str(r["seq"]), str(s["n"]),
                      *(f"{s[k]:.3f}" for k in ("median", "mean", "p90", "p99", "min", "std")),
                      f"[yellow]{cv}[/]" if s["cv_pct"] > threshold else cv, f"{r['first_run_ms']:.3f}")
    return table


def print_report(report: dict) -> None:
    for phase in _phases(report):
        out.print(throughput_table(report, phase))
    out.print(detail_table(report))
    env = report["environment"]
    device = env.get("gpu", {}).get("name") if report["device"].startswith("cuda") else env["cpu"]
    s = report["settings"]
    out.print(f"{device}; warm-up {s['warmup']}, iters {s['iters']} in {s['rounds']} alternating rounds; "
              f"first run reported apart; {report['seconds']:.0f} s")
    for warning in report["warnings"]:
        err.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    if report["warnings"]:
        err.print(f"CV above {s['cv_warn_pct']:g} % means the timings spread widely (a busy or throttling "
                  "machine?): compare medians with care, or rerun with more --iters and --rounds", soft_wrap=True)


def csv_rows(report: dict) -> list[dict]:
    rows = []
    for r in report["results"]:
        s = r["stats_ms"]
        rows.append({"mode": report["mode"], "engine": report["engine"], "device": report["device"],
                     "dtype": report["dtype"], "threads": report["threads"], "phase": r["phase"],
                     "variant": r["variant"], "batch": r["batch"], "seq": r["seq"],
                     "new_tokens": r.get("new_tokens", ""), "iters": len(r["times_ms"]),
                     "first_run_ms": r["first_run_ms"], **{f"{k}_ms": s[k] for k in
                                                           ("median", "mean", "p90", "p99", "min", "max", "std")},
                     "cv_pct": s["cv_pct"], "tokens_per_s": r["tokens_per_s"],
                     "speedup_vs_baseline": "" if r["speedup_vs_baseline"] is None else r["speedup_vs_baseline"]})
    return rows


def write_csv(path: str | Path, report: dict) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_rows(report))


def require_matplotlib():
    """Checked before a long run, so that --plot without matplotlib fails at once, not at the end."""
    try:
        import matplotlib
    except ImportError:
        raise TaperfoldError("--plot needs matplotlib: pip install 'taperfold[plot]'") from None
    matplotlib.use("Agg")  # files only, no display needed
    return matplotlib


def write_plot(path: str | Path, report: dict) -> None:
    """Throughput per shape (grouped bars per variant) and speedup vs baseline, one row per phase."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    phases, variants = _phases(report), _variants(report)
    fig, axes = plt.subplots(len(phases), 2, figsize=(12, 4 * len(phases)), squeeze=False)
    width = 0.8 / len(variants)
    for row, phase in enumerate(phases):
        scale, unit = UNIT[phase]
        results = [r for r in report["results"] if r["phase"] == phase]
        shapes = list(dict.fromkeys((r["batch"], r["seq"]) for r in results))
        by_key = {(r["batch"], r["seq"], r["variant"]): r for r in results}
        labels = [f"B{b} T{s}" for b, s in shapes]
        for i, v in enumerate(variants):
            xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(shapes))]
            axes[row][0].bar(xs, [by_key[b, s, v]["tokens_per_s"] / scale for b, s in shapes], width, label=v)
            if v != "baseline" and "baseline" in variants:
                axes[row][1].plot(labels, [by_key[b, s, v]["speedup_vs_baseline"] for b, s in shapes],
                                  marker="o", label=v)
        axes[row][0].set_xticks(range(len(shapes)), labels)
        axes[row][0].set_ylabel(f"{phase} throughput ({unit})")
        axes[row][0].legend()
        axes[row][1].axhline(1.0, color="grey", linewidth=0.8)
        axes[row][1].set_ylabel(f"{phase} speedup vs baseline")
        if len(variants) > 1:
            axes[row][1].legend()
    fig.suptitle(f"taperfold bench: {report['engine']} {report['device']} {report['dtype']}, "
                 f"{report['threads']} threads")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
