"""Export time with the three-layer trace against a trace of every layer and against onnxruntime-genai's builder, on
SmolLM2-135M's shape, and the decode speed of the two folded growing decoders (docs/benchmarks.md, "Export time:
three layers traced").

Builds the random-weight tapered Llama of SmolLM2-135M's shape that examples/genai_bench.py builds (30 layers), then
per round exports it with growing and static decoders twice, `taperfold export` as it is and with
`--trace-every-layer`, and builds its untapered weights with the builder (fp32, CPU: what `bench --against
genai-builder` runs), alternating, each in a fresh process (wall time: process start to exit). Then times the two
exports' `model.decoder.onnx` in ONNX Runtime (CPU, `--threads` threads): a 128-token prompt, then 64 greedy steps of
one token, batch 1, the two sessions alternated over `--decode-rounds` rounds (latency of each step, waited for; the
median step). Writes everything to `--json`.

    python examples/stamped_export.py --json docs/cpu/stamped-export/export-135m.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from genai_bench import SHAPE, make_directory

from taperfold.sources import open_source

FORMS = {"three layers traced": (), "every layer traced": ("--trace-every-layer",)}
BUILDER = "onnxruntime-genai builder, fp32, untapered weights"


def export(source: Path, out: Path, flags: tuple[str, ...]) -> dict:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "taperfold.cli", "export", str(source), "-o", str(out), "--kv-cache", "growing,static",
         "--overwrite", *flags],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - start
    manifest = json.loads((out / "manifest.json").read_text())
    return {"wall_s": round(wall, 1), "timings": manifest["timings"]}


def build(plain: Path, out: Path) -> dict:
    """The builder on the untapered weights, fp32 for the CPU, as `bench --against genai-builder` runs it."""
    from taperfold.artifacts.genai_builder import builder_command

    shutil.rmtree(out, ignore_errors=True)
    command = builder_command(plain, out, "fp32", out.with_name(out.name + "-cache"))
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return {"wall_s": round(time.perf_counter() - start, 1)}


def decode_steps(path: Path, threads: int, rounds: int, other: Path) -> tuple[list[float], list[float]]:
    """Median step latency (ms) of each round, for `path` and `other`, alternated."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    sessions = [ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for p in (path, other)]
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, SHAPE["vocab_size"], (1, 128))
    kv = SHAPE["num_key_value_heads"], SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    medians: list[list[float]] = [[], []]
    for _ in range(rounds + 1):  # the first round warms up
        for i, session in enumerate(sessions):
            empty = np.zeros((1, kv[0], 0, kv[1]), np.float32)
            past = {
                f"past_key_values.{n}.{w}": empty for n in range(SHAPE["num_hidden_layers"]) for w in ("key", "value")
            }
            ids, steps = prompt, []
            for _ in range(65):
                start = time.perf_counter()
                logits, *present = session.run(None, {"input_ids": ids, **past})
                steps.append(time.perf_counter() - start)
                past = dict(zip(past, present, strict=True))
                ids = logits.argmax(-1).reshape(1, 1)
            medians[i].append(1000 * statistics.median(steps[1:]))
    return medians[0][1:], medians[1][1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="export rounds (each: both forms)")
    parser.add_argument("--decode-rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stamped-export-"))
    try:
        source = work / "smollm2-135m-shape"
        make_directory(source)
        plain = work / "untapered"
        open_source(source).write_plain_directory(plain)
        exports: dict[str, list[dict]] = {form: [] for form in [*FORMS, BUILDER]}
        for round_ in range(args.rounds):
            for form, flags in FORMS.items():
                exports[form].append(export(source, work / form.replace(" ", "-"), flags))
                print(f"round {round_ + 1} {form}: {exports[form][-1]}", flush=True)
            exports[BUILDER].append(build(plain, work / "builder"))
            print(f"round {round_ + 1} {BUILDER}: {exports[BUILDER][-1]}", flush=True)
        paths = [work / form.replace(" ", "-") / "model.decoder.onnx" for form in FORMS]
        stamped, whole = decode_steps(paths[0], args.threads, args.decode_rounds, paths[1])
        result = {
            "model": "tapered Llama of SmolLM2-135M's shape, random weights (examples/genai_bench.py)",
            "command": "taperfold export DIR -o OUT --kv-cache growing,static [--trace-every-layer]",
            "builder_command": "python -m onnxruntime_genai.models.builder -i UNTAPERED -o OUT -p fp32 -e cpu -c CACHE",
            "versions": {name: version(name) for name in ("torch", "onnxruntime", "onnxruntime-genai")},
            "exports": exports,
            "decode": {
                "what": "folded growing decoder, ONNX Runtime CPU, batch 1, prompt 128, 64 steps of one token: "
                "median step latency (ms) per round, the two alternated",
                "threads": args.threads,
                "three layers traced_ms": [round(x, 2) for x in stamped],
                "every layer traced_ms": [round(x, 2) for x in whole],
                "ratio_of_medians": round(statistics.median(whole) / statistics.median(stamped), 3),
            },
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["decode"], indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
