"""Add an artifact kind from outside taperfold: a model card, written from the manifest beside the graphs.

taperfold's outputs are artifact kinds (taperfold.artifacts), one module and one registration each, as families,
norm kinds, engines and sources are. This script declares a kind of its own, `model-card`, a small JSON file that
says what the export holds (the checkpoint, each graph with its file, size and the norms its fold removed), and:

1. registers it (`register_kind` checks the declaration and refuses a wrong one in one line);
2. exports a tiny g = 0 model with it (`ExportOptions(artifacts={"model-card": CardRequest()})`): export writes the
   graphs, then builds the card from the manifest, all in one atomic step;
3. reads it back through the manifest API (`read_manifest(dir).record("model-card")`) and checks it;
4. runs `verify_export`, which checks the card as its kind says (`check`) beside the graphs' logits.

    python examples/plugin_artifact.py          # exit 0: the kind works end to end; 1: it is declared wrong

The kind declares its command-line options too (`--model-card`, `--model-card-note`): once registered, it is asked
for from the command line as a shipped kind is. A package registers it for the command line through an entry point
in the group `taperfold.artifact_kinds`, naming `register` (tests/test_extending.py does it without installing):

    [project.entry-points."taperfold.artifact_kinds"]
    model-card = "plugin_artifact:register"

    taperfold export tiny.pt -o out --model-card --model-card-note "for the docs"

Nothing under taperfold/ names this kind: the manifest records it, verify checks it and the export builds it
because its kind says how.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taperfold.artifacts import register_kind
from taperfold.artifacts.base import (
    CHECKED,
    EXPORT,
    ArtifactKind,
    ArtifactRecord,
    Export,
    ExportRequest,
    Option,
    details_of,
)
from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.fsutil import sha256_file, write_json_atomic
from taperfold.jsonfields import Fields
from taperfold.manifest import read_manifest
from taperfold.models import random_gate0_model
from taperfold.verify import verify_export

CARD = "model-card.json"


@dataclass(frozen=True)
class CardRequest:
    """What a card is asked for with: a note written into it (None: none)."""

    note: str | None = None


@dataclass(frozen=True)
class CardDetails:
    """What the manifest records of a card beside the keys every artifact has: read once when the manifest is read,
    each key through `entry` (one line naming the file and the key when one is wrong), written back as the same keys."""

    sha256: str  # the card's own digest
    graphs: int  # how many graphs the card lists

    @classmethod
    def from_json(cls, entry: Fields) -> CardDetails:
        return cls(sha256=entry.text("sha256"), graphs=entry.count("graphs"))

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "graphs": self.graphs}


class ModelCard(ArtifactKind):
    """What an export holds, as a JSON card: one per export, built from its manifest, checked against it."""

    name = "model-card"
    title = "model card"
    built_from = EXPORT
    verified = CHECKED
    details_type = CardDetails
    options = (
        Option("--model-card", is_flag=True, help="Also write model-card.json: what the export holds (a plug-in)."),
        Option("--model-card-note", metavar="TEXT", help="--model-card: a note written into the card."),
    )
    request_type = CardRequest

    def request(self, values: Mapping[str, Any], export: ExportRequest) -> CardRequest | None:
        if not values["model_card"]:
            if values["model_card_note"] is not None:
                raise TaperfoldError("--model-card-note is written into the card: add --model-card")
            return None
        return CardRequest(note=values["model_card_note"])

    def build(
        self, manifest: Export, request: CardRequest, on_stage: Callable[[str], None] = lambda s: None
    ) -> list[ArtifactRecord]:
        graphs = [
            {
                "key": r.key,
                "file": r.path,
                "megabytes": round((r.bytes + r.external_data_bytes) / 1e6, 2),
                "norms_folded": ((r.reports.get("fold") or {}).get("summary") or {}).get("folded"),
            }
            for r in manifest.records("onnx")
        ]
        card = {
            "checkpoint": str(manifest.checkpoint),
            "dtype": manifest.dtype,
            "gate": manifest.gate,
            "graphs": graphs,
            **({"note": request.note} if request.note is not None else {}),
        }
        path = manifest.directory / CARD
        write_json_atomic(path, card)
        return [
            ArtifactRecord(
                key=self.key(None),
                kind=self.name,
                path=CARD,
                variant=None,
                graph=None,
                precision=manifest.dtype,
                bytes=path.stat().st_size,
                details=CardDetails(sha256=sha256_file(path), graphs=len(graphs)),
            )
        ]

    def check(self, manifest: Export, record: ArtifactRecord) -> list[str]:
        problems = super().check(manifest, record)  # the file is there, with the size recorded
        if problems:
            return problems
        path = manifest.directory / record.path
        if sha256_file(path) != details_of(record, CardDetails).sha256:
            return [f"{record.path}: changed since it was written (sha256)"]
        listed = {g["key"] for g in json.loads(path.read_text())["graphs"]}
        missing = sorted({r.key for r in manifest.records("onnx")} - listed)
        return [f"{record.path}: does not list {', '.join(missing)}"] if missing else []


def register() -> None:
    """What the entry point (group `taperfold.artifact_kinds`) names: taperfold calls it before it offers the
    command line's options, as vLLM calls its general_plugins."""
    register_kind(ModelCard())


def main(kind: ArtifactKind | None = None) -> int:
    kind = kind or ModelCard()
    try:
        register_kind(kind)
    except TaperfoldError as e:
        print(f"plugin_artifact: {e}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="taperfold-plugin-artifact-") as tmp:
        ckpt = save_checkpoint(checkpoint_from_model(random_gate0_model("tiny"), step=0), Path(tmp) / "tiny.pt")
        out = export_checkpoint(ckpt, Path(tmp) / "out", ExportOptions(artifacts={kind.name: CardRequest()})).out_dir
        manifest = read_manifest(out)
        record = manifest.record(kind.key(None))
        card = json.loads(manifest.file(record).read_text())
        print(f"{record.key}: {record.path}, {record.bytes} bytes, {details_of(record, CardDetails).graphs} graphs")
        for graph in card["graphs"]:
            print(
                f"  {graph['key']:<22} {graph['file']:<28} {graph['megabytes']:>6} MB  "
                f"norms folded: {graph['norms_folded'] if graph['norms_folded'] is not None else '-'}"
            )
        report = verify_export(out, threads=1)
        checked = next(p for p in report.pairs if p.candidate == record.key)
        print(f"verify: {checked.name}: {checked.status}; all pairs {'pass' if report.passed else 'FAIL'}")
        if checked.status != "pass" or not report.passed:
            print(f"plugin_artifact: {report.failure_message() or checked.reason}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
