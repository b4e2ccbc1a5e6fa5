"""Export and fold timings for docs/benchmarks.md (issue: export time split and fold-pass throughput).

    python examples/bench_export.py [--repeats 3] [--presets tiny,paper-30m,gpt2-124m] [--workdir runs/bench-export]

For each preset: a random-weight checkpoint at g = 0 (random c and γ̃, so nothing is a multiply by one),
then `taperfold export` (baseline, unfolded, folded) timed by stage — torch export, passes, writing —
and `taperfold fold` of the written unfolded.onnx (lazy load, fold, save) timed as a whole.
Throughput = weight bytes of the model / pass seconds; "rewritten" counts only the weights the fold
changed. Medians over --repeats runs; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import onnx

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.models import num_parameters, random_gate0_model
from taperfold.passes import fold_onnx_file

ARCH = {"tiny": "llama", "paper-30m": "llama", "gpt2-124m": "gpt2"}


def weight_bytes(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for init in model.graph.initializer:
        size = 1
        for d in init.dims:
            size *= d
        total += size * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
    return total


def measure(preset: str, repeats: int, workdir: Path) -> dict:
    model = random_gate0_model(preset, ARCH[preset])
    ckpt = save_checkpoint(checkpoint_from_model(model, 0), workdir / f"{preset}.safetensors")
    params = num_parameters(model)
    del model
    runs = []
    for i in range(repeats):
        out = workdir / f"{preset}-{i}"
        t0 = time.perf_counter()
        result = export_checkpoint(ckpt, out, ExportOptions())
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = fold_onnx_file(out / "unfolded.onnx", out / "refolded.onnx")
        fold_file = time.perf_counter() - t0
        runs.append(
            {
                **result.timings,
                "total_s": total,
                "fold_file_s": fold_file,
                "rewritten": report.summary()["bytes_rewritten"],
            }
        )
    weights = weight_bytes(out / "unfolded.onnx")
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "preset": preset,
        "arch": ARCH[preset],
        "params": params,
        "weight_bytes": weights,
        **med,
        "pass_gbps": weights / med["passes_s"] / 1e9,
        "rewritten_gbps": med["rewritten"] / med["passes_s"] / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--presets", default="tiny,paper-30m,gpt2-124m")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="taperfold-bench-export-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [measure(p, args.repeats, workdir) for p in args.presets.split(",")]
    print(
        f"median of {args.repeats} runs; fp32; `taperfold export` = 2 torch exports (baseline, unfolded) + the fold\n"
    )
    print(
        "| preset | params | weights (MB) | export total (s) | torch export (s) | passes (s) | writing (s) "
        "| fold pass GB/s (all weights) | GB/s (rewritten) | `taperfold fold` file→file (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['preset']} ({r['arch']}) | {r['params'] / 1e6:.1f}M | {r['weight_bytes'] / 1e6:.0f} "
            f"| {r['total_s']:.1f} | {r['torch_export_s']:.1f} | {r['passes_s']:.3f} | {r['write_s']:.2f} "
            f"| {r['pass_gbps']:.2f} | {r['rewritten_gbps']:.2f} | {r['fold_file_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
