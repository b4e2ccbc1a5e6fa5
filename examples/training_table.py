"""Markdown table of validation losses from `taperfold train --json` lines (examples/train_*.sh output).

    python examples/training_table.py runs/variants.jsonl
Groups by (arch, taper, aux); mean ± std over seeds; gap relative to the same arch's baseline mean.
"""

import json
import statistics
import sys
from collections import defaultdict

NAMES = {
    ("none", False): "Baseline",
    ("internal", True): "Internal-Taper (+aux)",
    ("all", True): "All-Taper (+aux)",
    ("internal", False): "Internal-Taper",
    ("all", False): "All-Taper",
}


def main(path: str) -> None:
    runs = defaultdict(list)
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                runs[(r["arch"], r["taper"], r["aux"])].append(r)
    print("| arch | variant | seeds | validation loss | vs baseline | train time (s, median) |")
    print("|---|---|---|---|---|---|")
    for arch in sorted({k[0] for k in runs}):
        base = statistics.mean(r["val_loss"] for r in runs[(arch, "none", False)])
        for (taper, aux), name in NAMES.items():
            group = runs.get((arch, taper, aux))
            if not group:
                continue
            losses = [r["val_loss"] for r in group]
            mean = statistics.mean(losses)
            spread = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
            gap = "" if taper == "none" else f"{100 * (mean / base - 1):+.2f} %"
            seconds = statistics.median(r["seconds"] for r in group)
            print(f"| {arch} | {name} | {len(losses)} | {mean:.4f}{spread} | {gap} | {seconds:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
