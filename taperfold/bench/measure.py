"""One benchmark run: load every variant up front, then measure each cell in alternating rounds."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import numpy as np
import torch

from taperfold.bench.decode import generate
from taperfold.bench.engines import Source, default_dtype, model_config, open_runners
from taperfold.bench.harness import Schedule, run_rounds
from taperfold.bench.stats import summarize
from taperfold.environment import machine_info
from taperfold.errors import TaperfoldError
from taperfold.models import ModelConfig
from taperfold.runners.base import Runner

FORMAT = "taperfold-bench"
FORMAT_VERSION = 1


def cv_threshold_pct(device: str) -> float:
    """trtexec warns above 1 % on a dedicated GPU; a shared CPU drifts more, so 5 % there."""
    return 1.0 if device.startswith("cuda") else 5.0


@dataclass
class BenchOptions:
    engine: str = "ort"
    variants: list[str] = field(default_factory=lambda: ["baseline", "unfused", "folded"])
    batches: list[int] = field(default_factory=lambda: [1, 4])
    seqs: list[int] = field(default_factory=lambda: [128, 256, 512])
    warmup: int = 10
    iters: int = 50
    rounds: int = 5
    mode: str = "prefill"  # prefill | decode
    prompt: int = 128  # decode: prompt length
    new_tokens: int = 32  # decode: decode steps after the prompt
    dtype: str | None = None  # None: fp32 for torch, the export's dtype for ort / trt
    device: str = "cpu"
    threads: int | None = None  # None: torch's default (the physical cores), used for every engine
    compile: bool = False
    seed: int = 0

    @property
    def schedule(self) -> Schedule:
        return Schedule(self.warmup, self.iters, self.rounds)


def cells(opts: BenchOptions) -> list[tuple[int, int]]:
    """(batch, tokens per sequence) in the order measured: prompt length in decode mode."""
    lengths = [opts.prompt] if opts.mode == "decode" else opts.seqs
    return [(b, s) for b in opts.batches for s in lengths]


def _check(opts: BenchOptions, cfg, dtype: str) -> None:
    longest = opts.prompt + opts.new_tokens if opts.mode == "decode" else max(opts.seqs)
    what = f"--prompt {opts.prompt} + --new-tokens {opts.new_tokens}" if opts.mode == "decode" else f"--seq {longest}"
    if longest > cfg.max_seq_len:
        raise TaperfoldError(f"{what} exceeds the model's context (max_seq_len {cfg.max_seq_len})")
    if opts.mode == "decode" and opts.engine != "torch" and dtype == "bf16":
        raise TaperfoldError("--mode decode with a bf16 export: numpy has no bfloat16 to feed the KV cache; "
                             "use --engine torch --dtype bf16")


@dataclass
class LoadedBench:
    source: Source
    opts: BenchOptions
    cfg: ModelConfig
    dtype: str
    threads: int
    runners: dict[str, Runner]


@contextlib.contextmanager
def load_bench(source: Source, opts: BenchOptions) -> Iterator[LoadedBench]:
    """Check the options against the model, fix the thread count, and load every variant up front."""
    cfg = model_config(source)
    dtype = opts.dtype or default_dtype(opts.engine, source)
    _check(opts, cfg, dtype)
    threads = opts.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    runners = open_runners(opts.engine, source, opts.variants, decoder=opts.mode == "decode", device=opts.device,
                           dtype=dtype, threads=threads, compile=opts.compile)
    try:
        yield LoadedBench(source, opts, cfg, dtype, threads, runners)
    finally:
        for runner in runners.values():
            runner.close()


def run_bench(bench: LoadedBench, on_call=lambda: None) -> dict:
    """Measure every variant in every cell; return the report (docs/benchmarks.md lists its keys)."""
    opts, cfg, runners = bench.opts, bench.cfg, bench.runners
    schedule = opts.schedule
    rng = np.random.default_rng(opts.seed)
    results = []
    started = time.time()
    for batch, seq in cells(opts):
        ids = rng.integers(0, cfg.vocab_size, (batch, seq), dtype=np.int64)
        if opts.mode == "decode":
            kv_dtype = "fp32" if opts.engine == "torch" else bench.dtype  # the torch runner casts to its dtype
            jobs = {name: (lambda r=r: generate(r, ids, opts.new_tokens, cfg, kv_dtype)) for name, r in runners.items()}
            results += _decode_rows(run_rounds(jobs, schedule, on_call), batch, seq, opts.new_tokens)
        else:
            prepared = {name: r.prepare({"input_ids": ids}) for name, r in runners.items()}
            jobs = {name: (lambda r=r, p=prepared[name]: r.timed_run(p)[1]) for name, r in runners.items()}
            samples = run_rounds(jobs, schedule, on_call)
            results += [_row("prefill", name, batch, seq, samples.first[name], samples.timed[name])
                        for name in runners]
    _add_speedups(results)
    threshold = cv_threshold_pct(opts.device)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "mode": opts.mode,
        "engine": opts.engine,
        "device": opts.device,
        "dtype": bench.dtype,
        "threads": bench.threads,
        "compile": opts.compile,
        "source": bench.source.to_dict(),
        "config": cfg.to_dict(),
        "settings": {**{k: v for k, v in asdict(opts).items() if k not in ("dtype", "threads")},
                     "warmup_slices": schedule.warmup_slices, "iter_slices": schedule.iter_slices,
                     "cv_warn_pct": threshold},
        "environment": machine_info(),
        "results": results,
        "warnings": [_cv_warning(r, threshold) for r in results if r["stats_ms"]["cv_pct"] > threshold],
    }


def _ms(seconds) -> list:
    return [round(s * 1e3, 6) for s in seconds]


def _row(phase: str, variant: str, batch: int, seq: int, first_s: float, times_s: list[float]) -> dict:
    stats = summarize(times_s)
    return {"phase": phase, "variant": variant, "batch": batch, "seq": seq, "tokens": batch * seq,
            "first_run_ms": round(first_s * 1e3, 6), "times_ms": _ms(times_s),
            "stats_ms": stats.scaled(1e3).to_dict(), "tokens_per_s": batch * seq / stats.median}


def _decode_rows(samples, batch: int, prompt: int, steps: int) -> list[dict]:
    rows = []
    for name, gens in samples.timed.items():
        first = samples.first[name]
        rows.append(_row("prefill", name, batch, prompt, first.prefill_s, [g.prefill_s for g in gens]))
        totals = [sum(g.step_s) for g in gens]
        per_token = summarize([s for g in gens for s in g.step_s])
        rows.append({"phase": "decode", "variant": name, "batch": batch, "seq": prompt, "new_tokens": steps,
                     "tokens": batch * steps, "first_run_ms": round(sum(first.step_s) * 1e3, 6),
                     "times_ms": [_ms(g.step_s) for g in gens], "generation_ms": _ms(totals),
                     "stats_ms": per_token.scaled(1e3).to_dict(),
                     "tokens_per_s": batch * steps / float(np.median(totals))})
    return rows


def _add_speedups(rows: list[dict]) -> None:
    """speedup = variant throughput / baseline throughput in the same cell and phase (None without a baseline)."""
    base = {(r["phase"], r["batch"], r["seq"]): r["tokens_per_s"] for r in rows if r["variant"] == "baseline"}
    for r in rows:
        ref = base.get((r["phase"], r["batch"], r["seq"]))
        r["speedup_vs_baseline"] = r["tokens_per_s"] / ref if ref else None


def _cv_warning(row: dict, threshold: float) -> str:
    return (f"{row['variant']} B{row['batch']} T{row['seq']} {row['phase']}: CV {row['stats_ms']['cv_pct']:.1f} % "
            f"> {threshold:g} %")
