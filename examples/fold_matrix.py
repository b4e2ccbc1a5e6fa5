"""Which transformers families fold, per exporter and opset: the table in docs/folding.md.

For every family, a tiny model is built from a config (nothing is downloaded) and exported twice by
torch.onnx: once with its norms replaced by their g = 0 constant maps (what a TaperNorm model is at
g = 0), once as is (real norms: the negative control). Both are folded with `fold_onnx_file`, and both
graphs of each pair are run in ONNX Runtime on the same tokens (`check_fold`).

    .venv/bin/python examples/fold_matrix.py --markdown fold-matrix.md --json fold-matrix.json
    .venv/bin/python examples/fold_matrix.py --families gpt2,llama --exporters legacy --opsets 18

Columns: norms tapered (replaced in torch), folded / kept (the fold report on the tapered export),
real untouched (real norms the report names in the original's export; "bit-identical" when its folded
output equals the input's exactly and nothing was folded), max rel (folded vs unfolded logits).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from taperfold.errors import first_line
from taperfold.passes import NormStatus, fold_onnx_file
from taperfold.passes.check_fold import check_fold
from taperfold.passes.testing import FAMILIES, constant_norms, export, tiny_model

SHAPES = {"input_ids": [2, 7], "attention_mask": [2, 7]}


def run_cell(family: str, exporter: str, opset: int, models: tuple, work: Path) -> dict:
    original, tapered, tapered_count = models
    row = {"family": family, "exporter": exporter, "opset": opset, "tapered": tapered_count}
    try:
        t0 = time.perf_counter()
        src = export(tapered, work / "tapered.onnx", exporter, opset)
        report = fold_onnx_file(src, work / "tapered.folded.onnx")
        check = check_fold(src, work / "tapered.folded.onnx", SHAPES)
        row.update(folded=report.count(NormStatus.FOLDED), kept=report.count(NormStatus.KEPT),
                   kept_reasons=sorted({e.reason for e in report.norms if e.status == NormStatus.KEPT}),
                   max_rel=max(o.metrics.max_rel for o in check.outputs if o.metrics), passed=check.passed)
        src = export(original, work / "original.onnx", exporter, opset)
        report = fold_onnx_file(src, work / "original.folded.onnx")
        check = check_fold(src, work / "original.folded.onnx", SHAPES)
        row.update(real=report.count(NormStatus.REAL_NORM), real_claimed=report.count(NormStatus.FOLDED),
                   bit_identical=all(o.metrics.max_abs == 0 for o in check.outputs if o.metrics),
                   seconds=round(time.perf_counter() - t0, 1))
    except Exception as e:  # an exporter that cannot export this family at this opset: recorded, not fatal
        row["error"] = first_line(e)[:160]
    return row


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "",
             "| family | exporter | opset | norms tapered | folded | kept | real norms untouched (control) "
             "| max rel (folded vs unfolded) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['exporter']} | {r['opset']} | {r['tapered']} | – | – | – "
                         f"| export failed: {r['error'].replace('|', '/')} |")
            continue
        control = f"{r['real']}, " + ("bit-identical" if r["bit_identical"] and not r["real_claimed"] else
                                      f"CHANGED ({r['real_claimed']} claimed folded)")
        lines.append(f"| {r['family']} | {r['exporter']} | {r['opset']} | {r['tapered']} | {r['folded']} "
                     f"| {r['kept']} | {control} | {r['max_rel']:.1e} |")
    reasons = sorted({(r["family"], reason) for r in rows for reason in r.get("kept_reasons", [])})
    if reasons:
        lines += ["", "Kept norms, with the fold report's reason (first of each family):", ""]
        seen = set()
        for family, reason in reasons:
            if family not in seen:
                seen.add(family)
                lines.append(f"- {family}: {reason}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--exporters", default="dynamo,legacy")
    parser.add_argument("--opsets", default="18,20,23")
    parser.add_argument("--markdown", type=Path, help="Write the table here.")
    parser.add_argument("--json", type=Path, help="Write every row here.")
    args = parser.parse_args()
    rows = []
    for family in args.families.split(","):
        original = tiny_model(family)
        tapered, names = constant_norms(original)
        for exporter in args.exporters.split(","):
            for opset in map(int, args.opsets.split(",")):
                with tempfile.TemporaryDirectory() as work:
                    row = run_cell(family, exporter, opset, (original, tapered, len(names)), Path(work))
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    command = "python examples/fold_matrix.py " + " ".join(sys.argv[1:])
    table = markdown(rows, command.strip())
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if "error" not in r and (not r["passed"] or r["real_claimed"] or not r["bit_identical"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
