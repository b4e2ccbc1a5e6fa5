"""Measure what docs/opsets.md's table rests on: the same checkpoint exported at two opsets (default 20 and
23), every graph run by ONNX Runtime in one interleaved run (all opsets and variants alternate in rounds),
prefill (last-token logits) and KV-cached decode; medians, CV and the ratios between opsets.

    python examples/opset_table.py --out docs/opsets/cpu.json                       # ORT CPU
    python examples/opset_table.py --device cuda --dtype fp16 --out docs/opsets/h100.json   # a GPU machine

The model is a preset at g = 0 with random weights (random c and γ̃: `models.random_gate0_model`), exported
with `taperfold export --kv-cache --opset N` (so the baseline is the fused form taperfold writes, and
baseline-decomposed the plain ops). Prefill timings are one call per sample; decode timings are the
median per-token step time of a --new-tokens generation after a --prompt prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from taperfold.artifacts import ONNX
from taperfold.artifacts.base import details_of
from taperfold.artifacts.onnx_graph import OnnxDetails
from taperfold.bench.harness import Job, Schedule, run_rounds
from taperfold.bench.stats import summarize
from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.engines import ENGINES
from taperfold.environment import machine_info, package_versions
from taperfold.errors import TaperfoldError
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.exportdir import ALL_VARIANTS, GROWING, INPUT, PREFILL
from taperfold.fsutil import write_json_atomic
from taperfold.manifest import read_manifest
from taperfold.models import PRESETS, random_gate0_model


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _norm_counts(details: OnnxDetails) -> dict:
    """What the JSON records of one graph's norms: the fused norm ops it runs, and those export fused."""
    return {"norm_ops": details.norm_ops, "norms_fused_by_taperfold": details.norms_fused_by_taperfold}


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--preset", choices=sorted(PRESETS), default="paper-30m")
parser.add_argument("--arch", choices=["llama", "gpt2"], default="llama")
parser.add_argument("--opsets", type=ints, default=[20, 23])
parser.add_argument("--variants", default="baseline,baseline-decomposed,folded")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
parser.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
parser.add_argument("--batch", type=ints, default=[1, 4])
parser.add_argument("--seq", type=ints, default=[128], help="prefill sequence lengths")
parser.add_argument("--prompt", type=int, default=128, help="decode: prompt length")
parser.add_argument("--new-tokens", type=int, default=32, help="decode: KV-cached steps")
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--iters", type=int, default=30, help="timed calls (prefill) or generations (decode) per graph")
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--threads", type=int, help="ORT intra-op threads (default: torch's thread count)")
parser.add_argument(
    "--work", help="keep the exports here and reuse those already there (default: a temporary directory)"
)
parser.add_argument(
    "--export-only",
    action="store_true",
    help="write the exports into --work and stop: export while something else uses the GPU",
)
parser.add_argument("--out", required=True, help="JSON to write")
args = parser.parse_args()

variants = args.variants.split(",")
unknown = [v for v in variants if v not in ALL_VARIANTS]
if unknown:
    sys.exit(f"unknown variants {unknown}; choose from {ALL_VARIANTS}")
threads = args.threads or torch.get_num_threads()
schedule = Schedule(args.warmup, args.iters, args.rounds)
ort_engine = ENGINES["ort"]
if args.export_only and not args.work:
    parser.error("--export-only needs --work")
if not args.export_only:
    ort_engine.require(args.device)

work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="opset-table-"))
work.mkdir(parents=True, exist_ok=True)
ckpt = work / f"{args.preset}-{args.arch}.pt"
if not ckpt.exists():
    save_checkpoint(
        checkpoint_from_model(random_gate0_model(args.preset, args.arch), step=0, meta={"random_weights": True}), ckpt
    )
exports, graphs = {}, {}
for opset in args.opsets:
    t0 = time.perf_counter()
    out_dir = work / f"opset{opset}-{args.dtype}"
    try:
        if not (out_dir / "manifest.json").exists():  # an earlier --export-only run's export is reused
            export_checkpoint(ckpt, out_dir, ExportOptions(dtype=args.dtype, opset=opset, decoders=(GROWING,)))
        manifest = read_manifest(out_dir)
    except TaperfoldError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    exports[opset] = manifest
    graphs[opset] = {record.key: _norm_counts(details_of(record, OnnxDetails)) for record in manifest.records(ONNX)}
    print(f"exported opset {opset} in {time.perf_counter() - t0:.0f} s -> {out_dir}", file=sys.stderr)
if args.export_only:
    sys.exit(0)

cfg = exports[args.opsets[0]].config()
rng = np.random.default_rng(0)
rows = []


def runners(graph: str) -> dict:
    """(opset, variant) label -> a loaded ORT runner of that graph."""
    out = {}
    for opset, manifest in exports.items():
        for variant in variants:
            if manifest.has_artifact(variant, graph):
                runner = ort_engine.runner(
                    manifest.artifact(variant, graph), device=args.device, threads=threads, graph=graph
                )
                runner.load()
                out[f"opset{opset}/{variant}"] = runner
    return out


def record(mode: str, batch: int, seq: int, label: str, samples_s: list[float], tokens: int) -> None:
    stats = summarize(samples_s)
    opset, variant = label.split("/")
    rows.append(
        {
            "mode": mode,
            "opset": int(opset.removeprefix("opset")),
            "variant": variant,
            "batch": batch,
            "seq": seq,
            "median_ms": stats.median * 1e3,
            "cv_pct": stats.to_dict()["cv_pct"],
            "tokens_per_s": tokens / stats.median,
            "samples": len(samples_s),
        }
    )


prefill = runners(PREFILL)
for batch in args.batch:
    for seq in args.seq:
        ids = rng.integers(0, cfg.vocab_size, (batch, seq), dtype=np.int64)
        prepared = {name: r.prepare({INPUT: ids}) for name, r in prefill.items()}
        # synced calls, each waited for (how docs/opsets.md's figures were taken, before bench also pipelined)
        jobs = {name: Job(lambda r=r, p=prepared[name]: r.timed_run(p)[1]) for name, r in prefill.items()}
        timed = run_rounds(jobs, schedule).synced
        for name, samples in timed.items():
            record("prefill", batch, seq, name, samples, batch * seq)
        print(f"prefill B{batch} T{seq} done", file=sys.stderr)
for r in prefill.values():
    r.close()

decoders = runners(GROWING)
kv_dtype = args.dtype
decode_schedule = Schedule(max(1, args.warmup // 5), max(args.rounds, args.iters // 5), args.rounds)
for batch in args.batch:
    ids = rng.integers(0, cfg.vocab_size, (batch, args.prompt), dtype=np.int64)
    jobs = {
        name: Job(lambda r=r, ids=ids: r.generate(ids, args.new_tokens, cfg, kv_dtype)) for name, r in decoders.items()
    }
    timed = run_rounds(jobs, decode_schedule).synced
    for name, gens in timed.items():
        record("decode", batch, args.prompt, name, [s for g in gens for s in g.step_s], batch)
    print(f"decode B{batch} done", file=sys.stderr)
for r in decoders.values():
    r.close()


def median_of(mode, opset, variant, batch, seq):
    for row in rows:
        if (row["mode"], row["opset"], row["variant"], row["batch"], row["seq"]) == (mode, opset, variant, batch, seq):
            return row["median_ms"]
    return None


low, high = min(args.opsets), max(args.opsets)
ratios = []  # time at the higher opset / time at the lower (< 1: the higher opset is faster)
for row in rows:
    if row["opset"] != low:
        continue
    other = median_of(row["mode"], high, row["variant"], row["batch"], row["seq"])
    base = median_of(row["mode"], row["opset"], "baseline", row["batch"], row["seq"])
    base_high = median_of(row["mode"], high, "baseline", row["batch"], row["seq"])
    ratios.append(
        {
            "mode": row["mode"],
            "variant": row["variant"],
            "batch": row["batch"],
            "seq": row["seq"],
            f"time_{high}_over_{low}": other / row["median_ms"] if other else None,
            f"speedup_vs_baseline_opset{low}": base / row["median_ms"] if base else None,
            f"speedup_vs_baseline_opset{high}": (base_high / other) if base_high and other else None,
        }
    )

report = {
    "format": "taperfold-opset-table",
    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "command": " ".join([Path(sys.executable).name, *sys.argv]),
    "preset": args.preset,
    "arch": args.arch,
    "device": args.device,
    "dtype": args.dtype,
    "threads": threads,
    "opsets": args.opsets,
    "variants": variants,
    "settings": {
        "warmup": args.warmup,
        "iters": args.iters,
        "rounds": args.rounds,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "decode_generations": decode_schedule.iters,
    },
    "graphs": {str(k): v for k, v in graphs.items()},
    "results": rows,
    "ratios": ratios,
    "environment": machine_info(),
    "versions": package_versions(),
}
write_json_atomic(args.out, report)
for r in ratios:
    print(json.dumps(r))
print(f"wrote {args.out}", file=sys.stderr)
