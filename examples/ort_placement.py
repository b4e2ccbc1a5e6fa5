"""Which execution provider ONNX Runtime places each node of a graph on: the numbers behind
docs/benchmarks.md#ort-decode-and-cuda-graphs (a graph is captured as a CUDA graph only when no node is on the CPU).

    python examples/ort_placement.py out/model.decoder.onnx --device cuda      # on a machine with onnxruntime-gpu
    python examples/ort_placement.py out/model.onnx --json

ONNX Runtime reports placement only in its verbose session log ("Node placements"), written by its C++ logger
to stderr; the session is made in a child process whose stderr is read.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

SESSION = """
import sys, onnxruntime as ort
options = ort.SessionOptions()
options.log_severity_level = 0
providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if sys.argv[2] == "cuda" else ["CPUExecutionProvider"]
ort.InferenceSession(sys.argv[1], options, providers=providers)
"""
PROVIDER = re.compile(r"(?:All nodes placed on|Node\(s\) placed on) \[(\w+)\]\. Number of nodes: (\d+)")
NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s{3}(\S+) \((.*)\)$")


def placements(log: str) -> dict[str, dict]:
    """provider -> {"count": N, "nodes": [(op type, node name), ...]} from ONNX Runtime's verbose session log."""
    found, current = {}, None
    for line in log.splitlines():
        if m := PROVIDER.search(line):
            current = found.setdefault(m.group(1), {"count": int(m.group(2)), "nodes": []})
        elif current is not None and (m := NODE.search(line)):
            current["nodes"].append((m.group(1), m.group(2)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", action="store_true", help="print every provider's nodes as JSON")
    args = parser.parse_args()
    if not args.model.is_file():
        parser.error(f"{args.model}: no such file")
    run = subprocess.run([sys.executable, "-c", SESSION, str(args.model), args.device], capture_output=True, text=True)
    found = placements(run.stderr)
    if run.returncode != 0 or not found:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        parser.exit(2, f"{parser.prog}: error: {args.model}: onnxruntime could not make a session ({last})\n")
    if args.json:
        print(json.dumps(found, indent=2))
        return
    for provider, placed in found.items():
        ops = {}
        for op, _ in placed["nodes"]:
            ops[op] = ops.get(op, 0) + 1
        print(
            f"{provider}: {placed['count']} nodes"
            + (
                f" ({', '.join(f'{o} ×{n}' for o, n in ops.items())})"
                if ops and provider != "CUDAExecutionProvider"
                else ""
            )
        )


if __name__ == "__main__":
    main()
