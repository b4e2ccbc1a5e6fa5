"""OpenVINO decode speed of taperfold's stateful IR against optimum-intel's export of the untapered model, on
SmolLM2-135M's shape (docs/benchmarks.md, "OpenVINO against optimum-intel").

    scripts/setup-optimum-intel
    PATH="$PWD/.venv-optimum-intel/bin:$PATH" python examples/openvino_bench.py [--workdir runs/openvino-bench]

Builds the random-weight, tapered Llama of examples/genai_bench.py (nothing downloaded), then runs, each in a fresh
process and printed as it runs:

    taperfold export DIR -o OUT --kv-cache growing --no-baseline --quantize int4,int8   (when OUT has no export)
    taperfold bench OUT --engine ENGINE --mode decode --variants unfolded,folded --against optimum-intel
        [--precision int8 | int4]   the folded and unfolded decoders beside optimum-cli's stateful IR of the
                                    untapered weights, in alternating rounds, one bench per precision

ENGINE is openvino-ir (default: taperfold's stateful IR, which bench converts from the torch variants and
compresses with NNCF as optimum-intel does, once) or openvino (OpenVINO reading the traced ONNX decoders and their
MatMulNBits forms). The bench reports are copied to OUT/bench-ENGINE-PRECISION.json.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from genai_bench import make_directory


def run(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/openvino-bench"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--precisions", default="fp32,int8,int4")
    parser.add_argument("--engine", choices=("openvino-ir", "openvino"), default="openvino-ir")
    args = parser.parse_args()
    if shutil.which("optimum-cli") is None:
        sys.exit("optimum-cli is not on PATH: run scripts/setup-optimum-intel and put .venv-optimum-intel/bin on PATH")
    source, out = args.workdir / "smollm2-135m-shape", args.workdir / "out"
    if not (source / "config.json").is_file():
        make_directory(source)
    taperfold = [sys.executable, "-m", "taperfold"]
    if not (out / "manifest.json").is_file():
        run(*taperfold, "export", str(source), "-o", str(out), "--kv-cache", "growing", "--no-baseline",
            "--quantize", "int4,int8")  # fmt: skip
    for precision in args.precisions.split(","):
        report = out / f"bench-{args.engine}-{precision}.json"
        report.unlink(missing_ok=True)  # a rerun's: bench refuses to overwrite a file inside the export it times
        extra = [] if precision == "fp32" else ["--precision", precision]
        run(*taperfold, "bench", str(out), "--engine", args.engine, "--mode", "decode", "--variants", "unfolded,folded",
            "--against", "optimum-intel", "--batch", "1,4", "--prompt", "128", "--new-tokens", "64", "--warmup", "1",
            "--iters", str(args.rounds), "--rounds", str(args.rounds), "--threads", str(args.threads),
            "--json", str(report), *extra)  # fmt: skip


if __name__ == "__main__":
    main()
