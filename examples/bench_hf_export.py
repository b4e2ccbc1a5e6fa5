"""Export time, peak memory and fold-pass throughput for Hugging Face directories (docs/benchmarks.md).

    python examples/bench_hf_export.py [--models gpt2-tiny,llama-tiny,gpt2-124m,llama-124m] [--repeats 1]
                                       [--workdir runs/bench-hf-export]

For each model: a random-weight transformers model built from a config (nothing downloaded), tapered
(Internal-Taper) with random c and γ̃ at g = 0, written as a tapered save_pretrained directory; then
`taperfold export DIR` (baseline + unfolded + folded, fp32) runs in a fresh Python process, which reports
its stage timings and its peak resident memory (ru_maxrss: imports, the model, the exporter, the passes).
Fold-pass throughput = the model's weight bytes / pass seconds, as in examples/bench_export.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_export import weight_bytes  # examples/ is on sys.path when this script runs

MODELS = {
    # GPT-2 small's shape; tiny: the test suite's shape
    "gpt2-tiny": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=32)),
    "gpt2-124m": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    # a Llama of similar size: d 768, 12 layers, SwiGLU 2560, vocab 32000, tied embeddings
    "llama-tiny": (
        "LlamaConfig",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=256,
            max_position_embeddings=32,
        ),
    ),
    "llama-124m": (
        "LlamaConfig",
        dict(
            hidden_size=768,
            intermediate_size=2560,
            num_hidden_layers=12,
            num_attention_heads=12,
            vocab_size=32000,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
    ),
}


def make_directory(name: str, folder: Path) -> int:
    import torch
    import transformers

    from taperfold.hf import save_hf_directory, taper_model

    cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kwargs)).eval()
    tapering = taper_model(model, "internal")
    with torch.no_grad():
        for norm in tapering.norms.values():
            norm.weight_tilde.uniform_(0.5, 1.5)
            norm.c.uniform_(0.05, 0.5)
            norm.calibrated.fill_(True)
    tapering.set_gate(0.0)
    save_hf_directory(model, folder)
    return sum(p.numel() for p in model.parameters())


def child(directory: str, out: str) -> None:
    """One export in this process; prints timings and peak RSS as JSON."""
    import resource
    import time

    from taperfold.export import ExportOptions, export_checkpoint

    t0 = time.perf_counter()
    result = export_checkpoint(directory, out, ExportOptions())
    total = time.perf_counter() - t0
    summary = result.manifest.report("folded", "fold")["summary"]
    print(
        json.dumps(
            {
                **result.timings,
                "total_s": total,
                "rewritten": summary["bytes_rewritten"],
                "folded": summary["folded"],
                "norms": summary["norms"],
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def measure(name: str, repeats: int, workdir: Path) -> dict:
    directory = workdir / name
    params = make_directory(name, directory)
    runs = []
    for i in range(repeats):
        out = workdir / f"{name}-export-{i}"
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(directory), str(out)], capture_output=True, text=True, check=True
        )
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    weights = weight_bytes(out / "unfolded.onnx")
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "model": name,
        "params": params,
        "weight_bytes": weights,
        **med,
        "pass_gbps": weights / med["passes_s"] / 1e9,
        "rewritten_gbps": med["rewritten"] / med["passes_s"] / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="taperfold-bench-hf-export-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [measure(m, args.repeats, workdir) for m in args.models.split(",")]
    print(json.dumps(rows, indent=1))
    print(
        f"\nmedian of {args.repeats} run(s); fp32; `taperfold export DIR` = 2 torch exports (baseline, unfolded) "
        "+ the fold, in a fresh process\n"
    )
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    print(
        "| model | params | weights (MB) | export total (s) | torch export (s) | passes (s) | writing (s) "
        "| peak RSS (MB) | norms folded | fold pass GB/s (all weights) | GB/s (rewritten) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params'] / 1e6:.3g}M | {r['weight_bytes'] / 1e6:.3g} | {r['total_s']:.1f} "
            f"| {r['torch_export_s']:.1f} | {r['passes_s']:.3f} | {r['write_s']:.2f} | {r['peak_rss_mb']:.0f} "
            f"| {r['folded']:.0f} of {r['norms']:.0f} | {r['pass_gbps']:.3g} | {r['rewritten_gbps']:.3g} |"
        )


if __name__ == "__main__":
    main()
