"""What the fold found and did, per norm; JSON-serializable through `to_dict()`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from taperfold.passes._graph import NormMatch

STATUSES = ("folded", "kept", "not_foldable")


@dataclasses.dataclass
class NormEntry:
    name: str  # module path (dynamo metadata) or node name
    kind: str  # "rms" | "ln"
    status: str  # "detected" (before folding), then "folded" | "kept" | "not_foldable"
    reason: str = ""  # why it was kept / is not foldable
    into: str = ""  # for folded norms: "consumers" or "embedding"
    consumers: list[str] = dataclasses.field(default_factory=list)  # node names reading the norm's output
    copied: list[str] = dataclasses.field(default_factory=list)  # "weight -> copy": shared weights untied
    bytes_rewritten: int = 0  # bytes of weights/biases/tables written with the norm folded in
    match: NormMatch | None = dataclasses.field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "match"}


@dataclasses.dataclass
class FoldReport:
    norms: list[NormEntry] = dataclasses.field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    initializers_removed: int = 0
    check_input: str = ""  # onnx.checker on the model as given: "passed" or "failed: ..."
    check_output: str = ""  # and on the folded model
    source: str = ""
    output: str = ""

    def count(self, status: str) -> int:
        return sum(entry.status == status for entry in self.norms)

    def summary(self) -> dict:
        return {
            "norms": len(self.norms),
            **{status: self.count(status) for status in STATUSES},
            "bytes_rewritten": sum(entry.bytes_rewritten for entry in self.norms),
            "initializers_copied": sum(len(entry.copied) for entry in self.norms),
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "initializers_removed": self.initializers_removed,
            "check_input": self.check_input,
            "check_output": self.check_output,
        }

    def to_dict(self) -> dict:
        files = {key: value for key, value in (("source", self.source), ("output", self.output)) if value}
        return {**files, "summary": self.summary(), "norms": [entry.to_dict() for entry in self.norms]}
