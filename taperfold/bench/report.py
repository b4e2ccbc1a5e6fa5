"""The benchmark's report, typed: `BenchReport` (its rows `BenchRow`, their timings `Timing`, the run's
`BenchSettings`), written and read back by `to_json` / `from_json` (bench.json, docs/benchmarks.md lists its keys).
The CSV and the plot below and the terminal tables (taperfold.ui.print_bench) are views of the same object."""

from __future__ import annotations

import csv
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taperfold.bench.stats import Stats, summarize
from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_path, read_json_object
from taperfold.jsonfields import Fields, is_count, is_number
from taperfold.runners.base import PIPELINED, SYNCED

FORMAT = "taperfold-bench"
# 2: a row's timings under `synced` (latency), `pipelined` (throughput, prefill) or `generation` (decode), and
#    `throughput_from` naming the one tokens_per_s comes from; 1: one set of synced timings (`times_ms`, `stats_ms`)
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)

GENERATION = "generation"
# What each timing of a row is: the report's `timing` lists those its rows have, and each row says in
# `throughput_from` which of them its tokens_per_s (and speedup) comes from.
TIMING = {
    SYNCED: "latency: each call timed alone, its outputs synchronized before the clock stops",
    PIPELINED: "throughput: the calls of a sample issued back to back between two timestamps, one synchronize at "
    "the end; time / calls",
    GENERATION: "a whole KV-cached generation: the summed times of its steps, each synced (its logits come back to "
    "the host for the next token)",
}
PHASES = ("prefill", "decode")

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


def _is_times(value: object) -> bool:
    """A timing's samples: numbers (ms), or per generation a list of its step times (a decode row's synced calls)."""
    return is_number(value) or (isinstance(value, list) and all(is_number(x) for x in value))


def _stats_from(fields: Fields) -> Stats:
    return Stats(n=fields.count("n"), **{k: fields.number(k) for k in (*STATS, "cv_pct")})


@dataclass
class Timing:
    """One way a row was timed: its samples in ms and their statistics."""

    times_ms: (
        list[float] | list[list[float]]
    )  # one per sample; a decode row's synced: the step times of each generation
    stats_ms: Stats  # a decode row's synced: pooled over every step (per token)
    calls: list[int] | None = None  # pipelined: the calls behind each sample (each sample is time / calls)

    def to_json(self) -> dict[str, Any]:
        calls = {"calls": self.calls} if self.calls is not None else {}
        return {**calls, "times_ms": self.times_ms, "stats_ms": self.stats_ms.to_dict()}

    @classmethod
    def from_json(cls, fields: Fields) -> Timing:
        return cls(
            times_ms=fields.items("times_ms", _is_times, "numbers (or lists of numbers)"),
            stats_ms=_stats_from(fields.child("stats_ms")),
            calls=fields.counts("calls") if fields.has("calls") else None,
        )


@dataclass
class BenchRow:
    """One runner (variant and execution) in one cell (batch, sequence length) and phase."""

    phase: str  # one of PHASES: a prefill call (decode mode: the prompt), or the decode steps after a prompt
    variant: str
    label: str  # the runner: the variant, marked " (cuda graph)" when the row times CUDA-graph replays
    batch: int
    seq: int  # tokens per sequence; a decode row's prompt
    tokens: int  # tokens one sample produces: batch · seq, or batch · new_tokens in a decode row
    first_run_ms: float  # the first call on the cell's input (decode rows: the first generation's steps), apart
    synced: Timing  # latency: each call timed alone
    throughput_from: str  # the timing tokens_per_s (and the speedup) comes from: synced, pipelined or generation
    tokens_per_s: float
    pipelined: Timing | None = None  # throughput: calls issued back to back (prefill mode)
    generation: Timing | None = None  # whole generations, the summed step times (decode rows)
    new_tokens: int | None = None  # decode rows: the steps after the prompt
    execution: str = "eager"  # eager, cuda-graph, compile:MODE
    setup_s: dict[str, float] = field(
        default_factory=dict
    )  # this runner's one-off work in this cell (compile, capture)
    speedup_vs_baseline: float | None = None  # against the baseline's row of the same cell, phase and execution

    def timings(self) -> dict[str, Timing]:
        """The timings this row has, by name, in the order TIMING lists them."""
        present = {SYNCED: self.synced, PIPELINED: self.pipelined, GENERATION: self.generation}
        return {mode: timing for mode, timing in present.items() if timing is not None}

    @property
    def throughput_stats(self) -> Stats:
        """The statistics (ms) of the samples tokens_per_s comes from: the timing `throughput_from` names."""
        return self.timings()[self.throughput_from].stats_ms

    def to_json(self) -> dict[str, Any]:
        head = {
            "phase": self.phase,
            "variant": self.variant,
            "label": self.label,
            "batch": self.batch,
            "seq": self.seq,
            "tokens": self.tokens,
            "first_run_ms": self.first_run_ms,
        }
        steps = {"new_tokens": self.new_tokens} if self.new_tokens is not None else {}
        return {
            **head,
            **steps,
            **{mode: timing.to_json() for mode, timing in self.timings().items()},
            "throughput_from": self.throughput_from,
            "tokens_per_s": self.tokens_per_s,
            "execution": self.execution,
            "setup_s": self.setup_s,
            "speedup_vs_baseline": self.speedup_vs_baseline,
        }

    @classmethod
    def from_json(cls, row: Fields, version: int = FORMAT_VERSION) -> BenchRow:
        """A row of a report of `version`; a version-1 row (one set of synced timings) is upgraded: its throughput
        came from the synced median in prefill and from whole generations (`generation_ms`) in decode."""
        variant = row.text("variant")
        if version == 1:
            synced = Timing(
                row.items("times_ms", _is_times, "numbers (or lists of numbers)"), _stats_from(row.child("stats_ms"))
            )
            generation_ms = row.numbers("generation_ms", None)
            generation = Timing(generation_ms, summarize(generation_ms)) if generation_ms else None
            pipelined, throughput_from = None, GENERATION if generation else SYNCED
        else:
            synced = Timing.from_json(row.child(SYNCED))
            pipelined_json, generation_json = row.optional_child(PIPELINED), row.optional_child(GENERATION)
            pipelined = Timing.from_json(pipelined_json) if pipelined_json else None
            generation = Timing.from_json(generation_json) if generation_json else None
            throughput_from = row.value("throughput_from", lambda v: v in TIMING, f"one of {', '.join(TIMING)}")
            if {PIPELINED: pipelined, GENERATION: generation}.get(throughput_from, synced) is None:
                raise TaperfoldError(
                    f"{row.origin}: key '{row.key('throughput_from')}' names {throughput_from!r}, "
                    f"which the row has no timing of"
                )
        return cls(
            phase=row.value("phase", lambda v: v in PHASES, f"one of {', '.join(PHASES)}"),
            variant=variant,
            label=row.text("label", variant),
            batch=row.count("batch"),
            seq=row.count("seq"),
            tokens=row.count("tokens"),
            first_run_ms=row.number("first_run_ms"),
            synced=synced,
            throughput_from=throughput_from,
            tokens_per_s=row.number("tokens_per_s"),
            pipelined=pipelined,
            generation=generation,
            new_tokens=row.optional_count("new_tokens"),
            execution=row.text("execution", "eager"),
            setup_s=row.numbers_by_name("setup_s", {}),
            speedup_vs_baseline=row.optional_number("speedup_vs_baseline"),
        )


@dataclass
class BenchSettings:
    """What the run was asked for (bench's BenchOptions but dtype and threads, which the report holds as run), and
    the schedule it made of it."""

    engine: str
    variants: list[str]
    batches: list[int]
    seqs: list[int]
    warmup: int
    iters: int
    rounds: int
    mode: str
    prompt: int
    new_tokens: int
    kv_cache: str | None  # --kv-cache as given ("auto": bench's choice); None in a report from before it
    device: str
    engine_options: dict[str, Any]
    seed: int
    fuse_projections: str | bool | None  # --fuse-projections as given (auto, fused, unfused; older: true/false/null)
    warmup_slices: list[int]  # the warm-up calls of each round
    iter_slices: list[int]  # the timed calls of each round
    cv_warn_pct: float  # a timing whose CV is above this is warned about
    precision: str | None = None  # --precision: the quantized artifacts timed (None: the export's dtype)
    against: list[str] = field(default_factory=list)  # --against: contenders built by other tools

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, s: Fields) -> BenchSettings:
        return cls(
            engine=s.text("engine"),
            variants=s.texts("variants"),
            batches=s.counts("batches"),
            seqs=s.counts("seqs"),
            warmup=s.count("warmup"),
            iters=s.count("iters"),
            rounds=s.count("rounds"),
            mode=s.text("mode"),
            prompt=s.count("prompt"),
            new_tokens=s.count("new_tokens"),
            kv_cache=s.optional_text("kv_cache"),
            device=s.text("device"),
            engine_options=s.mapping("engine_options", {}),
            seed=s.count("seed"),
            fuse_projections=s.value(
                "fuse_projections", lambda v: v is None or isinstance(v, (str, bool)), "a string, a bool or null", None
            ),
            warmup_slices=s.counts("warmup_slices"),
            iter_slices=s.counts("iter_slices"),
            cv_warn_pct=s.number("cv_warn_pct"),
            precision=s.optional_text("precision"),
            against=s.texts("against", []),
        )


@dataclass
class BenchReport:
    """One `taperfold bench` run: how it ran, and a row per runner, cell and phase."""

    created: str  # when the run started, ISO 8601 with the UTC offset
    seconds: float  # the run's wall time
    mode: str  # prefill | decode
    engine: str
    device: str
    dtype: str
    threads: int
    settings: BenchSettings
    source: dict[str, Any]  # where the models came from (bench.source.Source.to_dict)
    config: dict[str, Any]  # the model's shape (ModelConfig.to_dict)
    environment: dict[str, Any]  # the machine (taperfold.environment.machine_info)
    results: list[BenchRow]
    kv_cache: str | None = None  # decode: the decoders' cache (growing | static); None in prefill
    cache_length: int | None = None  # a static cache's positions
    kv_cache_basis: str | None = None  # why that cache: "--kv-cache", or the device's default and its measurement
    fused_projections: bool | None = None  # the models ran q/k/v and gate/up as one layer each; None: not recorded
    projection_groups: dict[str, int] = field(default_factory=dict)  # per variant: the groups run as one layer
    compile: bool = False
    compile_mode: str | None = None  # with compile
    cuda_graph: bool = False
    engine_options: dict[str, Any] = field(default_factory=dict)  # the runner options set on the command line
    # contenders other tools built, timed beside the variants (bench --against): name, tool, version, precision,
    # command, folder, build_s
    against: list[dict[str, Any]] = field(default_factory=list)

    # ---- what the rows say together ----------------------------------------------------------------------------

    def phases(self) -> list[str]:
        return list(dict.fromkeys(r.phase for r in self.results))

    def labels(self) -> list[str]:
        """The runners, by label: `folded`, `folded (cuda graph)`, ..."""
        return list(dict.fromkeys(r.label for r in self.results))

    def rows(self, phase: str) -> list[BenchRow]:
        return [r for r in self.results if r.phase == phase]

    @property
    def executions(self) -> list[str]:
        return list(dict.fromkeys(r.execution for r in self.results))

    @property
    def timing(self) -> dict[str, str]:
        """The timings the rows have, in words."""
        return {mode: meaning for mode, meaning in TIMING.items() if any(mode in r.timings() for r in self.results)}

    @property
    def setup_s(self) -> dict[str, dict[str, float]]:
        """Seconds of one-off work per runner label and kind, over every cell (a decode cell's work counted once:
        its prefill and decode rows share it)."""
        totals: dict[str, dict[str, float]] = {}
        seen = set()
        for r in self.results:
            if (r.label, r.batch, r.seq) in seen:
                continue
            seen.add((r.label, r.batch, r.seq))
            for kind, seconds in r.setup_s.items():
                per = totals.setdefault(r.label, {})
                per[kind] = round(per.get(kind, 0.0) + seconds, 6)
        return totals

    @property
    def warnings(self) -> list[str]:
        """A line per row and timing (synced, pipelined) whose CV is above settings.cv_warn_pct."""
        threshold = self.settings.cv_warn_pct
        return [
            f"{r.label} B{r.batch} T{r.seq} {r.phase} ({mode}): CV {timing.stats_ms.cv_pct:.1f} % > {threshold:g} %"
            for r in self.results
            for mode, timing in r.timings().items()
            if mode in (SYNCED, PIPELINED) and timing.stats_ms.cv_pct > threshold
        ]

    # ---- JSON --------------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": self.created,
            "seconds": self.seconds,
            "mode": self.mode,
            "kv_cache": self.kv_cache,
            "cache_length": self.cache_length,
            "kv_cache_basis": self.kv_cache_basis,
            "fused_projections": self.fused_projections,
            "projection_groups": self.projection_groups,
            "engine": self.engine,
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads,
            "compile": self.compile,
            "compile_mode": self.compile_mode,
            "cuda_graph": self.cuda_graph,
            "executions": self.executions,
            "timing": self.timing,
            "setup_s": self.setup_s,
            "engine_options": self.engine_options,
            "source": self.source,
            "config": self.config,
            "settings": self.settings.to_json(),
            "environment": self.environment,
            "results": [r.to_json() for r in self.results],
            "warnings": self.warnings,
            "against": self.against,
        }

    @classmethod
    def from_json(cls, data: object, origin: str | os.PathLike = "bench.json") -> BenchReport:
        """A report of any of READABLE_VERSIONS (version 1 upgraded in memory; `to_json` writes the current one), or
        one line naming `origin` (its file) and the key."""
        version = check_report(data, origin)["format_version"]
        top = Fields(data, str(origin))
        return cls(
            created=top.text("created"),
            seconds=top.number("seconds"),
            mode=top.value("mode", lambda v: v in PHASES, f"one of {', '.join(PHASES)}"),
            engine=top.text("engine"),
            device=top.text("device"),
            dtype=top.text("dtype"),
            threads=top.count("threads"),
            settings=BenchSettings.from_json(top.child("settings")),
            source=top.mapping("source"),
            config=top.mapping("config"),
            environment=top.mapping("environment"),
            results=top.each("results", lambda row: BenchRow.from_json(row, version)),
            kv_cache=top.optional_text("kv_cache"),
            cache_length=top.optional_count("cache_length"),
            kv_cache_basis=top.optional_text("kv_cache_basis"),
            fused_projections=top.optional_flag("fused_projections"),
            projection_groups=top.counts_by_name("projection_groups", {}),
            compile=top.flag("compile", False),
            compile_mode=top.optional_text("compile_mode"),
            cuda_graph=top.flag("cuda_graph", False),
            engine_options=top.mapping("engine_options", {}),
            against=top.items("against", lambda v: isinstance(v, dict), "objects", []),
        )

    @classmethod
    def read(cls, path: str | os.PathLike) -> BenchReport:
        """bench.json (or any --report file) read back; one line naming the file on any problem."""
        return cls.from_json(read_json_object(path), path)


def baseline_label(label: str) -> str:
    """The label of the baseline a runner's speedup is measured against (same execution)."""
    _, marked, rest = label.partition(" (")
    return "baseline" + (f" ({rest}" if marked else "")


def speedup_labels(labels: list[str]) -> list[str]:
    """The runners that get a speedup: every one but a baseline, whose own baseline ran in the same report."""
    return [v for v in labels if not v.startswith("baseline") and baseline_label(v) in labels]


# ---- the JSON as it is, for readers that take it apart themselves (examples/gpu_table3.py) --------------------


def check_report(report: object, origin: str | os.PathLike) -> dict[str, Any]:
    """A bench report this taperfold can read (any of READABLE_VERSIONS), or one line naming `origin` (its file)."""
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise TaperfoldError(f"{origin}: not a {FORMAT} report (key 'format')")
    version = report.get("format_version")
    if not is_count(version) or version not in READABLE_VERSIONS:
        raise TaperfoldError(
            f"{origin}: key 'format_version' is {version!r}; this taperfold "
            f"reads {FORMAT} versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    return report


def throughput_stats(row: dict[str, Any]) -> dict[str, Any]:
    """The statistics (ms) of the samples a JSON row's tokens_per_s comes from: the timing its `throughput_from`
    names; a version-1 row has one set (synced calls; per token in decode rows). (`BenchRow.throughput_stats`
    for a typed row.)"""
    return row[row["throughput_from"]]["stats_ms"] if "throughput_from" in row else row["stats_ms"]


# ---- views: CSV and plot ------------------------------------------------------------------------------------


def csv_rows(report: BenchReport) -> list[dict[str, Any]]:
    """One row per BenchRow, columns CSV_COLUMNS ("" where a row has no such value)."""
    rows = []
    for r in report.results:
        row: dict[str, Any] = {
            "mode": report.mode,
            "engine": report.engine,
            "device": report.device,
            "dtype": report.dtype,
            "threads": report.threads,
            "fused_projections": "" if report.fused_projections is None else report.fused_projections,
            "phase": r.phase,
            "variant": r.variant,
            "execution": r.execution,
            "batch": r.batch,
            "seq": r.seq,
            "new_tokens": "" if r.new_tokens is None else r.new_tokens,
            "first_run_ms": r.first_run_ms,
            "throughput_from": r.throughput_from,
            "tokens_per_s": r.tokens_per_s,
            "speedup_vs_baseline": "" if r.speedup_vs_baseline is None else r.speedup_vs_baseline,
        }
        for mode, timing in ((SYNCED, r.synced), (PIPELINED, r.pipelined)):
            stats = timing.stats_ms.to_dict() if timing is not None else {}
            row[f"{mode}_n"] = stats.get("n", "")
            row.update({f"{mode}_{k}_ms": stats.get(k, "") for k in STATS})
            row[f"{mode}_cv_pct"] = stats.get("cv_pct", "")
        calls = r.pipelined.calls if r.pipelined is not None else None
        row["pipelined_calls"] = sum(calls) if calls is not None else ""
        rows.append({column: row[column] for column in CSV_COLUMNS})
    return rows


def write_csv(path: str | Path, report: BenchReport) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_rows(report))


def require_matplotlib() -> Any:
    """Checked before a long run, so that --plot without matplotlib fails at once, not at the end."""
    try:
        import matplotlib
    except ImportError:
        raise TaperfoldError("--plot needs matplotlib: pip install 'taperfold[plot]'") from None
    matplotlib.use("Agg")  # files only, no display needed
    return matplotlib


def write_plot(path: str | Path, report: BenchReport) -> None:
    """Throughput per shape (grouped bars per variant) and speedup vs baseline, one row per phase."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    phases, variants = report.phases(), report.labels()
    fig, axes = plt.subplots(len(phases), 2, figsize=(12, 4 * len(phases)), squeeze=False)
    width = 0.8 / len(variants)
    for row, phase in enumerate(phases):
        scale, unit = UNIT[phase]
        results = report.rows(phase)
        shapes = list(dict.fromkeys((r.batch, r.seq) for r in results))
        by_key = {(r.batch, r.seq, r.label): r for r in results}
        labels = [f"B{b} T{s}" for b, s in shapes]
        speedups = speedup_labels(variants)
        for i, v in enumerate(variants):
            xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(shapes))]
            axes[row][0].bar(xs, [by_key[b, s, v].tokens_per_s / scale for b, s in shapes], width, label=v)
            if v in speedups:
                axes[row][1].plot(labels, [by_key[b, s, v].speedup_vs_baseline for b, s in shapes], marker="o", label=v)
        axes[row][0].set_xticks(range(len(shapes)), labels)
        axes[row][0].set_ylabel(f"{phase} throughput ({unit})")
        axes[row][0].legend()
        axes[row][1].axhline(1.0, color="grey", linewidth=0.8)
        axes[row][1].set_ylabel(f"{phase} speedup vs baseline")
        if len(variants) > 1:
            axes[row][1].legend()
    fig.suptitle(f"taperfold bench: {report.engine} {report.device} {report.dtype}, {report.threads} threads")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
