"""vLLM serving speed of taperfold's folded checkpoint against stock vLLM on the untapered weights (docs/benchmarks.md).

    python examples/vllm_bench.py [--workdir runs/vllm-bench] [--dtype fp32|bf16] [--rounds 3]

Builds (or reuses) examples/genai_bench.py's random-weight Llama of SmolLM2-135M's shape, tapered at g = 0 with random
c and γ̃ (nothing downloaded), then runs, each in a fresh process and printed as it runs:

    taperfold export DIR -o OUT --vllm --no-baseline --overwrite --dtype DTYPE
    taperfold verify OUT --engine vllm
    taperfold bench OUT --engine vllm --mode serve --concurrency 1,8,32 --against vllm --prompt 128 --new-tokens 64
    taperfold bench OUT --engine vllm --mode decode --batch 1,4 --against vllm --prompt 128 --new-tokens 64

`--against vllm` is stock vLLM serving the source's untapered weights (its norms real) at the same dtype, in the same
rounds, its order alternated with the folded checkpoint's. The reports (OUT/bench-serve.json, OUT/bench-decode.json,
OUT/verify.json) are what docs/benchmarks.md records (serving and decode, fp32 and bf16).
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) is 1 unless set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from genai_bench import make_directory


def run(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/vllm-bench"))
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the checkpoint's and the servers'")
    parser.add_argument("--rounds", type=int, default=3, help="every round starts each server again")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--skip-decode", action="store_true", help="the serving benchmark only")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    source, out = args.workdir / "smollm2-135m-shape", args.workdir / f"out-{args.dtype}"
    if not source.is_dir():
        make_directory(source)
    taperfold = [sys.executable, "-m", "taperfold.cli"]
    lengths = ["--prompt", "128", "--new-tokens", "64", "--rounds", str(args.rounds)]
    run(
        *taperfold,
        "export",
        str(source),
        "-o",
        str(out),
        "--vllm",
        "--no-baseline",
        "--overwrite",
        "--dtype",
        args.dtype,
    )
    run(*taperfold, "verify", str(out), "--engine", "vllm")
    run(
        *taperfold, "bench", str(out), "--engine", "vllm", "--mode", "serve", "--concurrency", args.concurrency,
        "--against", "vllm", *lengths,
    )  # fmt: skip
    if not args.skip_decode:  # the folded checkpoint (vLLM's only variant) against stock vLLM
        run(
            *taperfold, "bench", str(out), "--engine", "vllm", "--mode", "decode", "--batch", "1,4", "--against",
            "vllm", *lengths,
        )  # fmt: skip


if __name__ == "__main__":
    main()
