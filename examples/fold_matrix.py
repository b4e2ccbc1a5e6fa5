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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the pass tests' tiny models, measured here
from fold_models import FAMILIES, constant_norms, export, tiny_model

SHAPES = {"input_ids": [1, 8], "attention_mask": [1, 8]}  # the shape exported with


def run_cell(family: str, exporter: str, opset: int, models: tuple, work: Path) -> dict:
    original, tapered, tapered_count = models
    row = {"family": family, "exporter": exporter, "opset": opset, "tapered": tapered_count}
    t0 = time.perf_counter()
    for name, model in (("tapered", tapered), ("original", original)):
        try:
            src = export(model, work / f"{name}.onnx", exporter, opset)
        except Exception as e:  # noqa: BLE001 - an exporter that cannot export this family at this opset: recorded
            row["error"] = f"export failed: {first_line(e)[:120]}"
            return row
        report = fold_onnx_file(src, work / f"{name}.folded.onnx")
        if name == "tapered":
            row.update(
                folded=report.count(NormStatus.FOLDED),
                kept=report.count(NormStatus.KEPT),
                kept_reasons=sorted({e.reason for e in report.norms if e.status == NormStatus.KEPT}),
            )
        else:
            row.update(
                real=report.count(NormStatus.REAL_NORM),
                real_claimed=report.count(NormStatus.FOLDED),
                changed=report.changed_weights,
            )
        try:
            check = check_fold(src, work / f"{name}.folded.onnx", SHAPES)
        except Exception as e:  # noqa: BLE001 - ONNX Runtime cannot run the exported model itself: recorded
            row[f"{name}_check_error"] = first_line(e)[:160]
            continue
        if name == "tapered":
            row.update(max_rel=max(o.metrics.max_rel for o in check.outputs if o.metrics), passed=check.passed)
        else:
            row["bit_identical"] = all(o.metrics.max_abs == 0 for o in check.outputs if o.metrics)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| family | exporter | opset | norms tapered | folded | kept | real norms untouched (control) "
        "| max rel (folded vs unfolded) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['family']} | {r['exporter']} | {r['opset']} | {r['tapered']} | – | – | – "
                f"| {r['error'].replace('|', '/')} |"
            )
            continue
        if r["real_claimed"] or r.get("changed"):
            control = f"{r['real']}, CHANGED ({r['real_claimed']} claimed folded)"
        elif "bit_identical" in r:
            control = f"{r['real']}, " + ("bit-identical" if r["bit_identical"] else "outputs differ")
        else:
            control = f"{r['real']}, file unchanged (ORT cannot run the export)"
        error = (
            f"{r['max_rel']:.1e}"
            if "max_rel" in r
            else "ORT cannot run the export: " + (r.get("tapered_check_error", "")[:90].replace("|", "/"))
        )
        lines.append(
            f"| {r['family']} | {r['exporter']} | {r['opset']} | {r['tapered']} | {r['folded']} "
            f"| {r['kept']} | {control} | {error} |"
        )
    reasons = sorted({(r["family"], reason) for r in rows for reason in r.get("kept_reasons", [])})
    if reasons:
        lines += ["", "Kept norms, with the fold report's reason (first of each family):", ""]
        seen = set()
        for family, reason in reasons:
            if family not in seen:
                seen.add(family)
                lines.append(f"- {family}: {reason}")
    return "\n".join(lines) + "\n"


def _json_rows(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix == ".json":
        return [json.dumps(row) for row in json.loads(text)]
    return [line for line in text.splitlines() if line.startswith('{"family"')]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--exporters", default="dynamo,legacy")
    parser.add_argument("--opsets", default="18,20,23")
    parser.add_argument("--markdown", type=Path, help="Write the table here.")
    parser.add_argument("--json", type=Path, help="Write every row here.")
    parser.add_argument(
        "--rows",
        type=Path,
        nargs="*",
        default=[],
        help="Only build the table from rows written before (--json files or the JSON lines on stderr).",
    )
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.rows for line in _json_rows(path)]
    cells = {(r["family"], r["exporter"], r["opset"]): r for r in rows}  # a later run of a cell wins
    order = {f: i for i, f in enumerate(FAMILIES)}
    rows = sorted(cells.values(), key=lambda r: (order.get(r["family"], 99), r["exporter"], r["opset"]))
    for family in [] if args.rows else args.families.split(","):
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
    bad = [
        r
        for r in rows
        if "error" not in r
        and (not r.get("passed", True) or r["real_claimed"] or r.get("changed") or not r.get("bit_identical", True))
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
