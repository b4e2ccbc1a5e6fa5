"""Fused vs unfused projections of the folded model, on this CPU: ONNX Runtime and eager PyTorch (docs/benchmarks.md).

    python examples/fuse_projections_bench.py [--presets tiny,paper-30m] [--batch 1,4] [--seq 32,128]
        [--rounds 5] [--iters 20] [--threads 1] [--workdir DIR]

For each preset (llama, random weights at g = 0): `taperfold export` twice, with and without
--no-fuse-projections (folded graphs only), and the torch `folded` variant built with and without
fuse_projections. Each cell times the two alternately in --rounds rounds of --iters calls after one warm-up
call per round; the figure is the median call time over all rounds, the CV over the rounds' medians. Last-token
logits, fp32, random token ids; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from taperfold.artifacts.base import details_of
from taperfold.artifacts.onnx_graph import OnnxDetails
from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.exportdir import FOLDED
from taperfold.manifest import read_manifest
from taperfold.models import random_gate0_model
from taperfold.sources import open_source
from taperfold.variants import build_variants

KINDS = ("unfused", "fused")


def alternate(calls: dict, rounds: int, iters: int) -> dict:
    """{name: (median ms per call, CV % of the rounds' medians)}, the callables timed in turn, round by round."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            call()  # warm-up
            samples = []
            for _ in range(iters):
                t0 = time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)
            times[name].append(samples)
    out = {}
    for name, per_round in times.items():
        medians = [statistics.median(r) for r in per_round]
        out[name] = (
            1e3 * statistics.median([t for r in per_round for t in r]),
            100 * statistics.pstdev(medians) / statistics.mean(medians),
        )
    return out


def measure(preset: str, args, workdir: Path) -> list[dict]:
    model = random_gate0_model(preset, "llama")
    ckpt = save_checkpoint(checkpoint_from_model(model, 0), workdir / f"{preset}.safetensors")
    del model
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    sessions, groups = {}, {}
    for kind in KINDS:
        out = workdir / f"{preset}-{kind}"
        export_checkpoint(ckpt, out, ExportOptions(baseline=False, fuse_projections=kind == "fused"))
        manifest = read_manifest(out)
        projections = details_of(manifest.find(FOLDED), OnnxDetails).projections
        groups[kind] = projections["summary"]["groups"] if projections else 0
        sessions[kind] = ort.InferenceSession(
            str(manifest.artifact(FOLDED)), options, providers=["CPUExecutionProvider"]
        )
    torch.set_num_threads(args.threads)
    source = open_source(ckpt)
    models = {
        kind: build_variants(source, [FOLDED], torch.float32, fuse_projections=kind == "fused")[FOLDED]
        for kind in KINDS
    }
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batch:
        for seq in args.seq:
            ids = rng.integers(0, source.config.vocab_size, (batch, seq), dtype=np.int64)
            tensor = torch.from_numpy(ids)
            ort_calls = {kind: (lambda s=s, ids=ids: s.run(None, {"input_ids": ids})) for kind, s in sessions.items()}
            torch_calls = {kind: (lambda m=m, tensor=tensor: m(tensor, logits="last")) for kind, m in models.items()}
            with torch.no_grad():
                for engine, calls in (("ort", ort_calls), ("torch", torch_calls)):
                    timed = alternate(calls, args.rounds, args.iters)
                    rows.append(
                        {
                            "preset": preset,
                            "engine": engine,
                            "batch": batch,
                            "seq": seq,
                            "groups": groups["fused"],
                            **{kind: timed[kind] for kind in KINDS},
                        }
                    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda text: [int(part) for part in text.split(",")]  # noqa: E731
    ap.add_argument("--presets", default="tiny,paper-30m")
    ap.add_argument("--batch", type=ints, default=[1, 4])
    ap.add_argument("--seq", type=ints, default=[32, 128])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="taperfold-fuse-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [row for preset in args.presets.split(",") for row in measure(preset, args, workdir)]
    print(
        f"folded model, last-token logits, fp32, CPU, {args.threads} thread(s); median ms per call over "
        f"{args.rounds} alternating rounds of {args.iters} calls (CV % of the round medians)\n"
    )
    print("| preset | engine | batch | seq | groups fused | unfused (ms) | fused (ms) | fused speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        (unfused, cv_u), (fused, cv_f) = r["unfused"], r["fused"]
        print(
            f"| {r['preset']} | {r['engine']} | {r['batch']} | {r['seq']} | {r['groups']} "
            f"| {unfused:.3f} ({cv_u:.1f} %) | {fused:.3f} ({cv_f:.1f} %) | {unfused / fused:.3f} |"
        )


if __name__ == "__main__":
    main()
