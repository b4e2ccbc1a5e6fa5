"""Run each deployment artifact over every model family taperfold ships, verify included, and write what happened.

scripts/support_table.py's sibling: where that one asks how far the fold reaches (export and verify of the ONNX
graphs over every causal-LM type of transformers), this one asks whether each deployment artifact works for each
family taperfold registers (`taperfold.families.supported_model_types()`), or is refused in one line before the work.
Per family a tiny random model is built offline (support_table's configs: a window shorter than the context, MoE
experts, biases, q/k norms as the family's config class has them), tapered through the user path, then per artifact,
each in a child process with a time limit:

    taperfold train --from PLAIN --steps STEPS --batch-size 2 --data CORPUS -o TAPERED
    taperfold export TAPERED -o OUT --no-baseline ARTIFACT'S FLAGS
    taperfold verify OUT --json

A cell is PASS (verify passes every pair, the artifact's own among them), refused (export exit 2: the one line it
printed), FAIL (verify exit 1: the worst pair) or error (anything else: a traceback, a timeout, an export that exits
0 and a verify that cannot run it). The JSON is rewritten after every family and --resume goes on from it:

    .venv/bin/python scripts/deployment_table.py --json runs/deployment.json --markdown runs/deployment.md --jobs 2
    .venv/bin/python scripts/deployment_table.py --types mistral,gemma3_text --artifacts openvino --markdown -
    .venv/bin/python scripts/deployment_table.py --json runs/deployment.json --resume --types gemma3_text --steps 150

STEPS is 30 unless --steps says otherwise, and each row records its own. A quantized cell needs a model whose
next-token distribution decides something: int4 moves these tiny models' logits by some 0.1, and a model still
near-uniform after its steps (top-1 probability near 1/vocab) flips its top-1 on that noise, unfolded and folded
alike, which verify then fails (docs/deployment.md, the table's notes). With --resume, the types --types names are run
again and their rows replaced; the other rows are kept.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support_table import SCRATCH, _done_rows, _reason, _taperfold, _write

# Training steps of each family's tiny model before it is tapered to g = 0 (the whole table's run used these)
DEFAULT_STEPS = 30

# Each deployment artifact: the export flags that ask for it (the growing-cache decoder comes with each, so that
# verify's KV-cached decode cases, which reach past a sliding window, run on it)
ARTIFACTS = {
    "genai-builder": ("--genai", "--genai-route", "builder"),
    "genai-traced": ("--genai", "--genai-route", "traced"),
    "openvino": ("--openvino", "--kv-cache", "growing"),
    "ort-fusions": ("--kv-cache", "growing", "--ort-fusions"),
    "int4": ("--kv-cache", "growing", "--quantize", "int4"),
    "static": ("--kv-cache", "static"),
}


def run_family(model_type: str, artifacts: list[str], root: Path, corpus: Path, steps: int) -> dict:
    """One family: its tiny model tapered by `steps` of training, then each artifact exported and verified."""
    row: dict = {"model_type": model_type, "steps": steps, "cells": {}, "seconds": {}}
    plain, tapered = root / "plain", root / "tapered"
    support = Path(__file__).resolve().parent / "support_table.py"
    build = subprocess.run(
        [sys.executable, str(support), "--save-plain", model_type, str(plain)], capture_output=True, text=True
    )
    if build.returncode != 0:
        row["stopped"] = f"build: {_reason(build.stderr, build.returncode)}"
        return row
    code, _, stderr = _taperfold(
        "train", "--from", plain, "--steps", steps, "--batch-size", "2", "--data", corpus, "-o", tapered
    )
    if code != 0:
        row["stopped"] = f"train: {_reason(stderr, code)}"
        return row
    for artifact in artifacts:
        start = time.perf_counter()
        row["cells"][artifact] = run_artifact(tapered, root / artifact, ARTIFACTS[artifact])
        row["seconds"][artifact] = round(time.perf_counter() - start, 1)
        subprocess.run(["rm", "-rf", str(root / artifact)], check=False)
    return row


def run_artifact(tapered: Path, out: Path, flags: tuple[str, ...]) -> dict:
    """What exporting and verifying one artifact gave: {"result": PASS | refused | FAIL | error, "reason": ...}."""
    code, _, stderr = _taperfold("export", tapered, "-o", out, "--no-baseline", *flags)
    if code == 2:
        return {"result": "refused", "reason": _reason(stderr, code)}
    if code != 0:
        return {"result": "error", "reason": f"export: {_reason(stderr, code)}"}
    code, _, stderr = _taperfold("verify", out, "--json")
    if code == 0:
        return {"result": "PASS", "reason": ""}
    return {"result": "FAIL" if code == 1 else "error", "reason": f"verify: {_reason(stderr, code)}"}


def markdown(rows: list[dict], artifacts: list[str], version: str) -> str:
    steps_of = [r.get("steps", DEFAULT_STEPS) for r in rows]  # rows of runs before --steps: the default
    usual = max(steps_of, key=steps_of.count, default=DEFAULT_STEPS)
    lines = [
        f"Generated by `scripts/deployment_table.py` with transformers {version}: each family's tiny random model "
        f"tapered by {usual} steps of `train --from` (where a row says otherwise, by its steps), then per artifact "
        "`export --no-baseline` with its flags and `verify`. "
        "PASS: verify passes every pair, the artifact's own among them; refused: export's one line (numbered below), "
        "nothing written; FAIL: export wrote it and verify fails a pair.",
        "",
        "| model_type | " + " | ".join(artifacts) + " |",
        "| --- |" + " --- |" * len(artifacts),
    ]
    reasons: list[str] = []
    for r in rows:
        if "stopped" in r:
            lines.append(f"| {r['model_type']} | " + " | ".join(["–"] * len(artifacts)) + " |")
            reasons.append(f"{r['model_type']}: stopped at {r['stopped']}")
            continue
        cells = []
        for artifact in artifacts:
            cell = r["cells"].get(artifact)
            if cell is None:
                cells.append("–")
            elif cell["result"] == "PASS":
                cells.append("PASS")
            else:
                reason = SCRATCH.sub("", cell["reason"]).replace("|", "\\|")
                if reason not in reasons:
                    reasons.append(reason)
                cells.append(f"{cell['result']} ({reasons.index(reason) + 1})")
        steps = r.get("steps", DEFAULT_STEPS)
        trained = "" if steps == usual else f" ({steps} steps)"
        lines.append(f"| {r['model_type']}{trained} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{i}. {reason}" for i, reason in enumerate(reasons, 1)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--types", help="comma-separated causal-LM model types (default: those of the families taperfold ships)"
    )
    parser.add_argument("--artifacts", help=f"comma-separated, of {', '.join(ARTIFACTS)} (default: all)")
    parser.add_argument("--json", dest="json_path", help="write the rows as JSON here ('-': stdout)")
    parser.add_argument("--markdown", help="write the Markdown table here ('-': stdout)")
    parser.add_argument("--resume", action="store_true", help="keep the rows --json already holds; run the rest")
    parser.add_argument("--jobs", type=int, default=1, help="families run at once (each runs one command at a time)")
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps of each tiny model (default {DEFAULT_STEPS})"
    )
    args = parser.parse_args()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from taperfold.families import supported_model_types

    types = args.types.split(",") if args.types else supported_model_types()
    artifacts = args.artifacts.split(",") if args.artifacts else list(ARTIFACTS)
    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    for name, given, known in (("--types", types, causal), ("--artifacts", artifacts, list(ARTIFACTS))):
        unknown = [t for t in given if t not in known]
        if unknown:
            parser.error(f"{name}: {unknown[0]!r} is not one of {', '.join(known)}")
    if args.steps < 1:
        parser.error(f"--steps: {args.steps} is not a number of steps (1 or more)")
    rows = _done_rows(args.json_path, transformers.__version__, parser) if args.resume else []
    if args.types:  # named again: run again, the earlier row replaced
        rows = [r for r in rows if r["model_type"] not in types]
    done = {r["model_type"] for r in rows}
    todo = [t for t in types if t not in done]
    with tempfile.TemporaryDirectory(prefix="taperfold-support-") as scratch:
        corpus = Path(scratch) / "corpus.txt"
        corpus.write_bytes(Path(json.__file__).read_bytes() * 8)  # a standard-library file as text: offline

        def one(model_type: str) -> dict:
            root = Path(scratch) / model_type
            root.mkdir()
            start = time.perf_counter()
            row = run_family(model_type, artifacts, root, corpus, args.steps)
            row["total_seconds"] = round(time.perf_counter() - start, 1)
            subprocess.run(["rm", "-rf", str(root)], check=False)
            return row

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for future in as_completed([pool.submit(one, t) for t in todo]):
                row = future.result()
                rows.append(row)
                summary = row.get("stopped") or ", ".join(f"{a} {c['result']}" for a, c in row["cells"].items())
                print(f"[{len(rows)}/{len(types)}] {row['model_type']}: {summary}", file=sys.stderr, flush=True)
                if args.json_path and args.json_path != "-":  # kept after every family: the run takes an hour
                    _write(args.json_path, _json(rows, artifacts, transformers.__version__))
    rows.sort(key=lambda r: r["model_type"])
    if args.json_path:
        _write(args.json_path, _json(rows, artifacts, transformers.__version__))
    if args.markdown:
        _write(args.markdown, markdown(rows, artifacts, transformers.__version__))


def _json(rows: list[dict], artifacts: list[str], version: str) -> str:
    return json.dumps({"transformers": version, "artifacts": artifacts, "rows": rows}, indent=1) + "\n"


if __name__ == "__main__":
    main()
