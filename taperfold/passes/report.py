"""What the passes found and did, per norm; written as JSON by `FoldReport.to_json()` (format
"taperfold-fold-report": `fold --report`, `fold --json`, and each folded graph's `reports.fold` in manifest.json),
read back by `FoldReport.from_json()`.

The report only observes: passes record into it, and no pass reads it to decide what to do.
"""

from __future__ import annotations

import dataclasses
import enum

import onnx_ir as ir

from taperfold.errors import TaperfoldError
from taperfold.jsonfields import Fields, is_count

FORMAT = "taperfold-fold-report"
FORMAT_VERSION = 1  # reports before it had no `format` key: read as version 1 (the same keys)


class NormStatus(str, enum.Enum):
    """Every status a norm can end in."""

    FOLDED = "folded"  # a constant-scale (g = 0) norm, removed from the graph
    KEPT = "kept"  # a constant-scale norm left in place; `reason` says what blocked it
    NOT_FOLDABLE = "not_foldable"  # a tapered layer whose gate is not 0: it still computes statistics
    REAL_NORM = "real_norm"  # an ordinary RMSNorm / LayerNorm: never folded, left exactly as it is
    WEIGHTS_MERGED = "weights_merged"  # a real norm whose γ/β moved into its readers (opt-in); the norm stays


@dataclasses.dataclass
class NormEntry:
    name: str  # module path (dynamo metadata) or node name
    kind: str  # "rms" | "ln"
    status: NormStatus
    reason: str = ""  # what to know about it: what blocked a fold, what the norm is
    into: str = ""  # where its arithmetic went: "consumers" (its readers), "embedding" or "producer"
    consumers: list[str] = dataclasses.field(default_factory=list)  # node names reading the norm's output
    copied: list[str] = dataclasses.field(default_factory=list)  # "weight -> copy": shared weights untied
    bytes_rewritten: int = 0  # bytes of weights/biases/tables written with the norm folded in

    @property
    def message(self) -> str:
        """One line a user can act on, e.g. "kept: read by Add '/layers.0/Add' (residual)"."""
        return f"{self.status.value}: {self.reason}" if self.reason else self.status.value

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "status": self.status.value}

    @classmethod
    def from_json(cls, entry: Fields) -> NormEntry:
        statuses = [status.value for status in NormStatus]
        return cls(
            name=entry.text("name"),
            kind=entry.text("kind"),
            status=NormStatus(entry.value("status", lambda v: v in statuses, f"one of {', '.join(statuses)}")),
            reason=entry.text("reason", ""),
            into=entry.text("into", ""),
            consumers=entry.texts("consumers", []),
            copied=entry.texts("copied", []),
            bytes_rewritten=entry.count("bytes_rewritten", 0),
        )


@dataclasses.dataclass
class FusedGroup:
    """Linear layers that read one tensor, now one layer on their concatenated weights followed by a Split."""

    input: str  # the value they all read
    nodes: list[str]  # the layers' node names, in graph order (their outputs, in Split order)
    modules: list[str]  # their module paths, from the exporter's metadata ("" where there is none)
    fused: str  # the node that replaces them
    widths: list[int]  # output channels of each, in Split order
    bias: bool  # their biases were concatenated into one Add (or the Gemm's C)
    bytes_written: int = 0  # bytes of the concatenated weight and bias


@dataclasses.dataclass
class LeftReader:
    """A reader of a value with several linear readers that was not fused with them."""

    input: str
    node: str
    reason: str


@dataclasses.dataclass
class ProjectionReport:
    """What FuseProjectionsPass fused, and which readers of the same tensors it left alone, with why."""

    groups: list[FusedGroup] = dataclasses.field(default_factory=list)
    left: list[LeftReader] = dataclasses.field(default_factory=list)
    linear_before: int = 0  # MatMul and Gemm nodes before the pass
    linear_after: int = 0

    def summary(self) -> dict:
        return {
            "groups": len(self.groups),
            "layers_fused": sum(len(g.nodes) for g in self.groups),
            "left": len(self.left),
            "linear_before": self.linear_before,
            "linear_after": self.linear_after,
            "bytes_written": sum(g.bytes_written for g in self.groups),
        }

    def to_json(self) -> dict:
        return {
            "summary": self.summary(),
            "groups": [dataclasses.asdict(g) for g in self.groups],
            "left": [dataclasses.asdict(r) for r in self.left],
        }

    @classmethod
    def from_json(cls, report: Fields) -> ProjectionReport:
        """What `to_json` wrote (the fold report's `projections`, a graph's in manifest.json); the summary's counts of
        groups and readers are recomputed from the lists."""

        def group(g: Fields) -> FusedGroup:
            return FusedGroup(
                input=g.text("input"),
                nodes=g.texts("nodes"),
                modules=g.texts("modules"),
                fused=g.text("fused"),
                widths=g.counts("widths"),
                bias=g.flag("bias"),
                bytes_written=g.count("bytes_written", 0),
            )

        summary = report.child("summary")
        return cls(
            groups=report.each("groups", group),
            left=report.each("left", lambda r: LeftReader(r.text("input"), r.text("node"), r.text("reason"))),
            linear_before=summary.count("linear_before"),
            linear_after=summary.count("linear_after"),
        )


@dataclasses.dataclass
class FoldReport:
    norms: list[NormEntry] = dataclasses.field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    initializers_removed: int = 0
    constants_folded: int = 0  # nodes computing constants at run time, replaced by their values
    constants_left: list[str] = dataclasses.field(default_factory=list)  # constant-computing nodes left (too large)
    check_input: str = ""  # onnx.checker on the model as given: "passed" or "failed: ..."
    check_output: str = ""  # and on the folded model
    source: str = ""
    output: str = ""
    projections: ProjectionReport | None = None  # FuseProjectionsPass's, when it ran (`fuse_projections`)

    def entry(self, name: str, kind: str, status: NormStatus = NormStatus.KEPT) -> NormEntry:
        """The entry of norm `name`, created with `status` on first sight (entries keep that order)."""
        for entry in self.norms:
            if entry.name == name:
                return entry
        entry = NormEntry(name, kind, status)
        self.norms.append(entry)
        return entry

    def count(self, status: NormStatus) -> int:
        return sum(entry.status == status for entry in self.norms)

    @property
    def changed_weights(self) -> bool:
        """Whether any pass rewrote the model's arithmetic (a fold, a merge or fused projections)."""
        return any(e.status in (NormStatus.FOLDED, NormStatus.WEIGHTS_MERGED) for e in self.norms) or bool(
            self.projections and self.projections.groups
        )

    def summary(self) -> dict:
        return {
            "norms": len(self.norms),
            **{status.value: self.count(status) for status in NormStatus},
            "bytes_rewritten": sum(entry.bytes_rewritten for entry in self.norms),
            "initializers_copied": sum(len(entry.copied) for entry in self.norms),
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "initializers_removed": self.initializers_removed,
            "constants_folded": self.constants_folded,
            "constants_left": len(self.constants_left),
            "check_input": self.check_input,
            "check_output": self.check_output,
        }

    def to_json(self) -> dict:
        files = {key: value for key, value in (("source", self.source), ("output", self.output)) if value}
        projections = {"projections": self.projections.to_json()} if self.projections is not None else {}
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            **files,
            "summary": self.summary(),
            "constants_left": self.constants_left,
            "norms": [entry.to_json() for entry in self.norms],
            **projections,
        }

    @classmethod
    def from_json(cls, data: object, origin: str = "fold report") -> FoldReport:
        """A report `to_json` wrote (one without `format`, from before it, read as version 1), or one line naming
        `origin` (its file, or manifest.json and the artifact) and the key. The summary's counts are recomputed from
        the norms; what only the summary holds (node counts, the checker's verdicts) is read from it."""
        report = Fields(data, origin)
        if report.data.get("format", FORMAT) != FORMAT:
            raise TaperfoldError(f"{origin}: not a {FORMAT} report (key 'format' is {report.data['format']!r})")
        version = report.data.get("format_version", FORMAT_VERSION)
        if not is_count(version) or version != FORMAT_VERSION:
            raise TaperfoldError(
                f"{origin}: key 'format_version' is {version!r}; this taperfold reads {FORMAT} version {FORMAT_VERSION}"
            )
        summary = report.child("summary")
        projections = report.optional_child("projections")
        return cls(
            norms=report.each("norms", NormEntry.from_json),
            nodes_before=summary.count("nodes_before"),
            nodes_after=summary.count("nodes_after"),
            initializers_removed=summary.count("initializers_removed", 0),
            constants_folded=summary.count("constants_folded", 0),
            constants_left=report.texts("constants_left", []),
            check_input=summary.text("check_input", ""),
            check_output=summary.text("check_output", ""),
            source=report.text("source", ""),
            output=report.text("output", ""),
            projections=ProjectionReport.from_json(projections) if projections is not None else None,
        )


class ObserveNormsPass(ir.passes.InPlacePass):
    """Enter every norm `detect_norms` finds into the report, in graph order, as it is before any fold:
    real norms and tapered layers at g ≠ 0 with what they are, candidates as kept until a pass folds them.
    Changes nothing in the model."""

    def __init__(self, report: FoldReport):
        super().__init__()
        self.report = report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from taperfold.passes.detect import GATE_NOT_ZERO, detect_norms, subgraph_candidates

        analysis = detect_norms(model)
        for norm in analysis.real_norms:
            self.report.entry(
                norm.name, norm.kind, NormStatus.REAL_NORM
            ).reason = f"an ordinary norm ({norm.form}) computes per-token statistics; left as it is"
        for layer in analysis.gate_not_zero:
            self.report.entry(layer.name, layer.kind, NormStatus.NOT_FOLDABLE).reason = GATE_NOT_ZERO
        for candidate in analysis.candidates:
            self.report.entry(candidate.name, candidate.kind, NormStatus.KEPT)
        position = {name: i for i, name in enumerate(analysis.order)}
        self.report.norms.sort(key=lambda entry: position.get(entry.name, len(position)))
        for candidate, where in subgraph_candidates(model):  # after the main graph's, in the order found
            self.report.entry(
                candidate.name, candidate.kind, NormStatus.KEPT
            ).reason = f"{where}: the fold rewrites the main graph only"
        return ir.passes.PassResult(model, modified=False)
