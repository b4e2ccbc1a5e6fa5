"""What an artifact kind is, and the manifest entry every artifact has.

An artifact is one output of an export directory: an ONNX graph of a variant, the TensorRT engine built from one,
and whatever a later stage or a plug-in adds. Each kind says

- what it is built from (`built_from`: the torch variants, the export as a whole, or another kind's artifacts),
- how it is written (`build`, atomically, into the export directory; the ONNX graphs are written by export itself),
- what it records in the manifest (`details_type`: a frozen dataclass of its own keys beside the ones every artifact
  has, ArtifactRecord.details; read once when the manifest is read, each wrong key one line naming it),
- how it is verified (`verified`: LOGITS, run by an engine and held to its variant's torch model, or CHECKED by
  its own `check`),
- which engines run it (the engines whose `runs` names it: taperfold.engines),
- how it is asked for: its `taperfold export` options (`options`: `Option`s, no click here; the command line adds
  every registered kind's) and its request (`request_type`: a frozen dataclass that `request` makes once from the
  options' values and `check_request`, `plan`, `needed_graphs` and `build` read).

A build request goes: `request(values, export)` (the command line: None, not asked for) -> `check_request` (one line
before any work) -> `plan` (decisions that need the source, made once: the genai route) -> `needed_graphs` (what
the export must write for it) -> `build` (after the graphs are written; also on demand, `Manifest.build`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from taperfold.errors import TaperfoldError
from taperfold.exportdir import PREFILL, Graph, graph_key
from taperfold.jsonfields import Fields, is_file_name

if TYPE_CHECKING:
    from taperfold.manifest_source import ManifestSource

# What a kind is built from, besides another kind's artifacts (named by that kind's name)
TORCH = "torch"  # the torch variants of the checkpoint: written by `taperfold export` itself
EXPORT = "export"  # the export directory as a whole (its manifest): one artifact per export
# How a kind is verified
LOGITS = "logits"  # an engine runs it; verify holds its logits to its variant's torch model
CHECKED = "checked"  # the kind's own `check` (a file no engine runs: a model card, a weights file)

# Keys every manifest entry has; a kind's own fields may not reuse them
COMMON_KEYS = (
    "kind",
    "path",
    "variant",
    "graph",
    "precision",
    "bytes",
    "external_data",
    "external_data_bytes",
    "built_from",
    "reports",
)
_NAME = re.compile(r"[a-z][a-z0-9-]*\Z")


@dataclass(frozen=True)
class Option:
    """One `taperfold export` option a kind reads, declared without click (taperfold.cli makes the click option):
    `flag` as typed (`--quantize`), its value under `key` (default: the flag's words joined by '_': `quantize`) in
    the values every kind's `request` receives. A value given on the command line goes through `parse` once (one
    line, TaperfoldError, when it is wrong) before any kind reads it; an option not given has `default`."""

    flag: str
    help: str
    key: str = ""
    is_flag: bool = False
    type: type = str  # str | int | float: what the command line converts the text to (`choices`: one of them)
    choices: tuple[str, ...] = ()
    default: Any = None
    show_default: bool = False
    metavar: str | None = None
    parse: Callable[[Any], Any] | None = None  # the given value -> the value `request` reads (not called on None)

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.flag.lstrip("-").replace("-", "_"))
        if self.is_flag and self.default is None:
            object.__setattr__(self, "default", False)

    def value(self, given: Any) -> Any:
        """What `request` reads of this option given `given` on the command line (None: not given)."""
        if given is None or (self.is_flag and given is False):
            return self.default
        return self.parse(given) if self.parse is not None else given


@dataclass(frozen=True)
class NoRequest:
    """The request of a kind that takes no settings: it is asked for, or not."""


def _quiet(stage: str) -> None:
    """An on_stage that shows nothing."""


class ArtifactDetails(Protocol):
    """A kind's own keys of a manifest entry, typed (`ArtifactKind.details_type`, a frozen dataclass): made by the
    kind's `build` (or export), read once when the manifest is read (`from_json(entry)`, a classmethod: each key
    through `entry`, a taperfold.jsonfields.Fields, so a wrong one is one line naming the file and the key), and
    written back as the same keys (`to_json`)."""

    @classmethod
    def from_json(cls, entry: Fields) -> ArtifactDetails: ...
    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class NoDetails:
    """The details of a kind with no keys of its own."""

    @classmethod
    def from_json(cls, entry: Fields) -> NoDetails:
        return cls()

    def to_json(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class UnknownDetails:
    """The own keys of an entry whose kind is not registered here (a plug-in not installed): kept as they were read,
    by key, and written back unchanged."""

    values: Mapping[str, Any]

    @classmethod
    def from_json(cls, entry: Fields) -> UnknownDetails:
        values = {k: v for k, v in entry.data.items() if k not in COMMON_KEYS}
        entry.read.update(values)
        return cls(values)

    def to_json(self) -> dict[str, Any]:
        return dict(self.values)


@dataclass
class ArtifactRecord:
    """One entry of manifest.json's `artifacts`, keyed by `key`."""

    key: str
    kind: str
    path: str  # relative to the export directory (taperfold.manifest keeps it inside)
    variant: str | None  # None: an artifact of the export as a whole
    graph: Graph | None
    precision: str  # fp32 | fp16 | bf16 (the export's dtype), or a quantized form
    bytes: int
    external_data: str | None = None  # the weights file beside it (ONNX external data), relative like `path`
    external_data_bytes: int = 0
    built_from: str | None = None  # the key of the artifact it was built from; None: the torch model or the export
    details: ArtifactDetails = field(default_factory=NoDetails)  # the kind's own keys (ArtifactKind.details_type)
    reports: dict = field(default_factory=dict)  # what the stages that made it reported, by name ("fold")
    # keys of the entry neither every artifact's nor its kind's (a newer taperfold's): kept as read, written back
    unmodeled: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        common = {
            "kind": self.kind,
            "path": self.path,
            "variant": self.variant,
            "graph": self.graph,
            "precision": self.precision,
            "bytes": self.bytes,
            "external_data": self.external_data,
            "external_data_bytes": self.external_data_bytes,
            "built_from": self.built_from,
        }
        return {**common, **self.details.to_json(), **self.unmodeled, "reports": self.reports}


class Export(Protocol):
    """What a kind reads of an export directory and its manifest (taperfold.manifest.Manifest is one; the manifest
    in turn checks its entries against the kinds, so the kinds name this rather than the class)."""

    @property
    def directory(self) -> Path: ...
    @property
    def path(self) -> Path: ...
    @property
    def dtype(self) -> str: ...
    @property
    def onnx(self) -> bool: ...  # the ONNX graphs were written (False: --no-onnx)
    @property
    def checkpoint(self) -> Path: ...
    @property
    def gate(self) -> float: ...
    @property
    def logits(self) -> str: ...
    @property
    def config_data(self) -> dict: ...
    def config(self) -> Any: ...  # the exported model's shape (taperfold.taper.ModelShape)
    @property
    def source(self) -> ManifestSource | None: ...  # what the export recorded of its source (manifest `source`)
    def records(self, kind: str | None = None) -> list[ArtifactRecord]: ...
    def record(self, key: str) -> ArtifactRecord: ...
    def find(
        self, variant: str, graph: Graph = PREFILL, kind: str = ..., precision: str | None = None
    ) -> ArtifactRecord | None: ...
    def artifact(self, variant: str, graph: Graph = PREFILL, kind: str = ..., precision: str | None = None) -> Path: ...
    def file(self, record: ArtifactRecord) -> Path: ...
    def report(self, key: str, name: str) -> dict | None: ...
    def build(self, kind: str, request: Any = None, on_stage: Callable[[str], None] = ...) -> list[ArtifactRecord]: ...


class ExportRequest(Protocol):
    """What a kind may check of the export a build request comes with (taperfold.export.ExportOptions)."""

    @property
    def dtype(self) -> str: ...
    @property
    def logits(self) -> str: ...
    @property
    def onnx(self) -> bool: ...  # the ONNX graphs are written (False: --no-onnx)


class ArtifactKind:
    """One kind of artifact. Subclass it, set the class attributes, override what the kind does, and register an
    instance (taperfold.artifacts.register_kind)."""

    name: ClassVar[str]  # as manifest.json's `kind` spells it
    title: ClassVar[str]  # as reports name it
    built_from: ClassVar[str]  # TORCH | EXPORT | another kind's name
    verified: ClassVar[str] = CHECKED  # LOGITS | CHECKED
    suffix: ClassVar[str] = ""  # what its keys add to the graph's key: `folded.plan`; "" only for the ONNX graphs
    details_type: ClassVar[type[ArtifactDetails]] = NoDetails  # its own keys in a manifest entry: a frozen dataclass
    needs_graphs: ClassVar[tuple[Graph, ...]] = ()  # decoders an export asked for this kind also writes (--genai)
    # how it is asked for: its `taperfold export` options (shared ones, such as --quantize, are declared once, by the
    # kind that owns them, and read by any kind), and the frozen dataclass `request` makes of their values
    options: ClassVar[tuple[Option, ...]] = ()
    request_type: ClassVar[type] = NoRequest
    # what `taperfold export` traces the graphs for when this kind is asked for and --target is not given (None: ort)
    target: ClassVar[str | None] = None
    # the only variants an export ever holds of this kind (vLLM's checkpoint: the folded model's), which `bench` times
    # by default and alone on an engine that runs it; None: any variant the export traced
    variants: ClassVar[tuple[str, ...] | None] = None

    # ---- naming ----

    def key(self, variant: str | None, graph: Graph | None = PREFILL, precision: str | None = None) -> str:
        """The manifest key of the artifact of `variant`'s `graph` (`precision`: set only for a precision other than
        the export's dtype), or of the export as a whole (`variant` None: the kind's name)."""
        if variant is None:
            return self.name
        parts = [graph_key(variant, graph or PREFILL), precision, self.suffix]
        return ".".join(part for part in parts if part)

    # ---- asking for it ----

    def request(self, values: Mapping[str, Any], export: ExportRequest) -> Any | None:
        """This kind's request made from `values` (every registered kind's options by key, each parsed once:
        `Option.value`) for an export with `export`'s settings, or None where the values do not ask for it. One line
        (TaperfoldError) for values it refuses. The default: asked for (`request_type()`) when one of its own
        flags is set."""
        if any(option.is_flag and values.get(option.key) for option in self.options):
            return self.request_type()
        return None

    def check_request(self, request: Any, export: ExportRequest) -> None:
        """Refuse, in one line, a request (an export's `artifacts`), or an export, that `build` would refuse after
        the export's work; nothing by default."""

    def plan(self, request: Any, source: Any, tapered: Any, dtype: str) -> Any:
        """`request` with what it leaves open decided for `source` (a taperfold.sources model source) exported in
        `dtype`, `tapered` its tapered torch model at g = 0 (None for a plain source), before the export's work:
        `build` reads the decision and does not make it again. One line here refuses the request. The default:
        nothing to decide."""
        return request

    def needed_graphs(self, request: Any) -> tuple[Graph, ...]:
        """The decoders a planned request needs the export to write: `needs_graphs` unless the kind knows better."""
        return self.needs_graphs

    # ---- building ----

    def build(self, manifest: Export, request: Any, on_stage: Callable[[str], None] = _quiet) -> list[ArtifactRecord]:
        """Write the artifacts `request` (a `request_type`) asks for into `manifest`'s directory (each file
        atomically) and return their records; the caller adds them to the manifest. Kinds built from the torch
        variants are written by export instead."""
        raise TaperfoldError(f"artifact kind {self.name!r} is written by `taperfold export`, not built afterwards")

    # ---- running ----

    def files(
        self, manifest: Export, variants: list[str], graph: Graph, precision: str | None = None
    ) -> dict[str, Path]:
        """{variant: file} of this kind's artifacts of `graph` in `precision` (default: the export's dtype), for an
        engine that runs them (one line naming manifest.json's key when one is missing)."""
        return {variant: manifest.artifact(variant, graph, self.name, precision) for variant in variants}

    def projection_groups(self, manifest: Export, record: ArtifactRecord) -> int | None:
        """How many groups of sibling projections (q/k/v, gate/up) `record`'s artifact runs as one layer each, or None
        where this kind cannot tell (bench then says nothing about projection fusion)."""
        return None

    # ---- verification ----

    def check(self, manifest: Export, record: ArtifactRecord) -> list[str]:
        """What is wrong with `record`'s artifact (empty: nothing). The default: its files are where the manifest
        says, with the sizes it records; a CHECKED kind adds what its content must hold."""
        problems = []
        for name, size in ((record.path, record.bytes), (record.external_data, record.external_data_bytes)):
            if name is None:
                continue
            path = manifest.directory / name
            if not path.is_file():
                problems.append(f"{name}: missing")
            elif size and path.stat().st_size != size:
                problems.append(f"{name}: {path.stat().st_size} bytes, the manifest records {size}")
        return problems

    # ---- the declaration ----

    def declaration_errors(self, known_kinds: Collection[str]) -> list[str]:
        """What is wrong with how this kind is declared (empty: nothing); `register_kind` refuses a kind with any."""
        errors = []
        name = getattr(self, "name", None)
        if not isinstance(name, str) or not _NAME.match(name):
            errors.append(f"name {name!r} is not lowercase letters, digits and '-' starting with a letter")
        if not isinstance(getattr(self, "title", None), str) or not self.title:
            errors.append("title is not set")
        built_from = getattr(self, "built_from", None)
        if built_from not in (TORCH, EXPORT) and built_from not in known_kinds:
            errors.append(f"built_from {built_from!r} is neither {TORCH!r}, {EXPORT!r} nor a registered kind")
        if self.verified not in (LOGITS, CHECKED):
            errors.append(f"verified {self.verified!r} is neither {LOGITS!r} nor {CHECKED!r}")
        if built_from != TORCH and not self.suffix and built_from != EXPORT:
            errors.append("suffix is empty: an artifact built from another needs a key of its own (e.g. 'plan')")
        if self.suffix and not _NAME.match(self.suffix):
            errors.append(f"suffix {self.suffix!r} is not lowercase letters, digits and '-'")
        errors += _details_errors(self.details_type)
        if built_from != TORCH and type(self).build is ArtifactKind.build:
            errors.append("build() is not implemented: nothing would write its artifacts")
        for option in self.options:
            if not isinstance(option, Option):
                errors.append(f"option {option!r} is not declared as an Option")
            elif not option.flag.startswith("--") or not _NAME.match(option.flag[2:]):
                errors.append(f"option {option.flag!r} is not '--' and lowercase letters, digits and '-'")
        if not (isinstance(self.request_type, type) and dataclasses.is_dataclass(self.request_type)):
            errors.append(f"request_type {self.request_type!r} is not a dataclass")
        elif not self.request_type.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            errors.append(f"request_type {self.request_type.__name__} is not frozen (@dataclass(frozen=True))")
        return errors


def _details_errors(details_type: Any) -> list[str]:
    """What is wrong with a kind's `details_type`: not a frozen dataclass that reads and writes its keys, or a field
    named as a key every artifact has."""
    name = getattr(details_type, "__name__", repr(details_type))
    if not (isinstance(details_type, type) and dataclasses.is_dataclass(details_type)):
        return [f"details_type {name} is not a dataclass"]
    errors = []
    if not details_type.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        errors.append(f"details_type {name} is not frozen (@dataclass(frozen=True))")
    for method in ("from_json", "to_json"):
        if not callable(getattr(details_type, method, None)):
            errors.append(f"details_type {name} has no {method}()")
    for spec in dataclasses.fields(details_type):
        if spec.name in COMMON_KEYS:
            errors.append(f"details_type {name}: field {spec.name!r} is a key every artifact has")
    return errors


D = TypeVar("D")


def details_of(record: ArtifactRecord, details_type: type[D]) -> D:
    """`record`'s details as `details_type`, its kind's (a record the manifest read, or its kind made); one line
    where the record is of another kind."""
    if not isinstance(record.details, details_type):
        raise TaperfoldError(
            f"artifacts.{record.key}: a {record.kind} artifact, whose details are no {details_type.__name__}"
        )
    return record.details


def tokenizer_names(entry: Fields) -> tuple[str, ...]:
    """The `tokenizer` key of a folder's entry (genai, OpenVINO IR, vLLM): the tokenizer files copied into the
    folder, by name (empty where an older entry has none)."""
    return tuple(entry.items("tokenizer", is_file_name, "file names in the folder", default=None))


def describe_file(folder: Path, name: str) -> tuple[int, str | None, int]:
    """(bytes, its external data file's name or None, that file's bytes) of a file just written into `folder`."""
    path = folder / name
    data = folder / (name + ".data")
    return path.stat().st_size, data.name if data.is_file() else None, data.stat().st_size if data.is_file() else 0


def tokenizer_files(manifest: Export) -> list[Path]:
    """The source's tokenizer files the export recorded (manifest `source.tokenizer_files`), read from the source
    directory; one line naming a file that is gone."""
    names = (manifest.source.tokenizer_files or ()) if manifest.source is not None else ()
    files = [manifest.checkpoint / name for name in names]
    for path in files:
        if not path.is_file():
            raise TaperfoldError(
                f"{path}: missing ({manifest.path} records it as a tokenizer file of the source the export came from)"
            )
    return files
