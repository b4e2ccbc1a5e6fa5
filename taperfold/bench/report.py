"""The benchmark's files: CSV and a plot (the terminal tables are in taperfold.ui)."""

from __future__ import annotations

import csv
from pathlib import Path

from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_path
from taperfold.runners.base import PIPELINED, SYNCED

FORMAT = "taperfold-bench"
# 2: a row's timings under `synced` (latency), `pipelined` (throughput, prefill) or `generation` (decode), and
#    `throughput_from` naming the one tokens_per_s comes from; 1: one set of synced timings (`times_ms`, `stats_ms`)
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)

STATS = ("median", "mean", "p90", "p99", "min", "max", "std")
CSV_COLUMNS = [
    "mode",
    "engine",
    "device",
    "dtype",
    "threads",
    "fused_projections",
    "phase",
    "variant",
    "execution",
    "batch",
    "seq",
    "new_tokens",
    "first_run_ms",
    "synced_n",
    *(f"synced_{k}_ms" for k in STATS),
    "synced_cv_pct",
    "pipelined_n",
    "pipelined_calls",
    *(f"pipelined_{k}_ms" for k in STATS),
    "pipelined_cv_pct",
    "throughput_from",
    "tokens_per_s",
    "speedup_vs_baseline",
]
# Prefill throughput in thousands of tokens per second, as the paper's Table 3; decode in tokens per second.
UNIT = {"prefill": (1e3, "k tokens/s"), "decode": (1.0, "tokens/s")}


def report_phases(report: dict) -> list[str]:
    return list(dict.fromkeys(r["phase"] for r in report["results"]))


def row_label(row: dict) -> str:
    """The variant, marked " (cuda graph)" when the row times CUDA-graph replays (rows before labels: the variant)."""
    return row.get("label", row["variant"])


def report_variants(report: dict) -> list[str]:
    """The runners of a report, by label: `folded`, `folded (cuda graph)`, ..."""
    return list(dict.fromkeys(row_label(r) for r in report["results"]))


def baseline_label(label: str) -> str:
    """The label of the baseline a runner's speedup is measured against (same execution)."""
    _, marked, rest = label.partition(" (")
    return "baseline" + (f" ({rest}" if marked else "")


def speedup_labels(labels: list[str]) -> list[str]:
    """The runners that get a speedup: every one but a baseline, whose own baseline ran in the same report."""
    return [v for v in labels if not v.startswith("baseline") and baseline_label(v) in labels]


def check_report(report, origin) -> dict:
    """A bench report this taperfold can read (any of READABLE_VERSIONS), or one line naming `origin` (its file)."""
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise TaperfoldError(f"{origin}: not a {FORMAT} report (key 'format')")
    if report.get("format_version") not in READABLE_VERSIONS:
        raise TaperfoldError(
            f"{origin}: key 'format_version' is {report.get('format_version')!r}; this taperfold "
            f"reads {FORMAT} versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    return report


def throughput_stats(row: dict) -> dict:
    """The statistics (ms) of the samples a row's tokens_per_s comes from: the timing its `throughput_from` names;
    a version-1 row has one set (synced calls; per token in decode rows)."""
    return row[row["throughput_from"]]["stats_ms"] if "throughput_from" in row else row["stats_ms"]


def csv_rows(report: dict) -> list[dict]:
    rows = []
    for r in report["results"]:
        row = {
            "mode": report["mode"],
            "engine": report["engine"],
            "device": report["device"],
            "dtype": report["dtype"],
            "threads": report["threads"],
            "fused_projections": report.get("fused_projections", ""),
            "phase": r["phase"],
            "variant": r["variant"],
            "execution": r.get("execution", "eager"),
            "batch": r["batch"],
            "seq": r["seq"],
            "new_tokens": r.get("new_tokens", ""),
            "first_run_ms": r["first_run_ms"],
            "throughput_from": r["throughput_from"],
            "tokens_per_s": r["tokens_per_s"],
            "speedup_vs_baseline": "" if r["speedup_vs_baseline"] is None else r["speedup_vs_baseline"],
        }
        for mode in (SYNCED, PIPELINED):
            stats = r[mode]["stats_ms"] if mode in r else {}
            row[f"{mode}_n"] = stats.get("n", "")
            row.update({f"{mode}_{k}_ms": stats.get(k, "") for k in STATS})
            row[f"{mode}_cv_pct"] = stats.get("cv_pct", "")
        row["pipelined_calls"] = sum(r[PIPELINED]["calls"]) if PIPELINED in r else ""
        rows.append({column: row[column] for column in CSV_COLUMNS})
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

    phases, variants = report_phases(report), report_variants(report)
    fig, axes = plt.subplots(len(phases), 2, figsize=(12, 4 * len(phases)), squeeze=False)
    width = 0.8 / len(variants)
    for row, phase in enumerate(phases):
        scale, unit = UNIT[phase]
        results = [r for r in report["results"] if r["phase"] == phase]
        shapes = list(dict.fromkeys((r["batch"], r["seq"]) for r in results))
        by_key = {(r["batch"], r["seq"], row_label(r)): r for r in results}
        labels = [f"B{b} T{s}" for b, s in shapes]
        speedups = speedup_labels(variants)
        for i, v in enumerate(variants):
            xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(shapes))]
            axes[row][0].bar(xs, [by_key[b, s, v]["tokens_per_s"] / scale for b, s in shapes], width, label=v)
            if v in speedups:
                axes[row][1].plot(
                    labels, [by_key[b, s, v]["speedup_vs_baseline"] for b, s in shapes], marker="o", label=v
                )
        axes[row][0].set_xticks(range(len(shapes)), labels)
        axes[row][0].set_ylabel(f"{phase} throughput ({unit})")
        axes[row][0].legend()
        axes[row][1].axhline(1.0, color="grey", linewidth=0.8)
        axes[row][1].set_ylabel(f"{phase} speedup vs baseline")
        if len(variants) > 1:
            axes[row][1].legend()
    fig.suptitle(
        f"taperfold bench: {report['engine']} {report['device']} {report['dtype']}, {report['threads']} threads"
    )
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
