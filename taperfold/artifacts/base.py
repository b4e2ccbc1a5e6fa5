"""What an artifact kind is, and the manifest entry every artifact has.

An artifact is one output of an export directory: an ONNX graph of a variant, the TensorRT engine built from one,
and whatever a later stage or a plug-in adds. Each kind says

- what it is built from (`built_from`: the torch variants, the export as a whole, or another kind's artifacts),
- how it is written (`build`, atomically, into the export directory; the ONNX graphs are written by export itself),
- what it records in the manifest (`fields`: its own keys beside the ones every artifact has, ArtifactRecord),
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
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

from taperfold.errors import TaperfoldError
from taperfold.exportdir import PREFILL, Graph, graph_key
from taperfold.jsonfields import is_file_name

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


@dataclass(frozen=True)
class Field:
    """One key of a kind's own in its manifest entries: the JSON types it takes, and whether every entry has it."""

    types: tuple[type, ...]
    required: bool = False
    help: str = ""
    check: Callable[[Any], bool] | None = None  # what a value of those types must be besides (a file name, ...)
    expected: str = ""  # what `check` asks, as an error line says it

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) and bool not in self.types:  # JSON true is no number
            return False
        return isinstance(value, self.types) and (self.check is None or self.check(value))


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
    details: dict = field(default_factory=dict)  # the kind's own fields (ArtifactKind.fields)
    reports: dict = field(default_factory=dict)  # what the stages that made it reported, by name ("fold")

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
        return {**common, **self.details, "reports": self.reports}

    @classmethod
    def from_json(cls, key: str, entry: dict) -> ArtifactRecord:
        """The record of an entry the manifest's schema has checked (taperfold.manifest)."""
        return cls(
            key=key,
            kind=entry["kind"],
            path=entry["path"],
            variant=entry.get("variant"),
            graph=entry.get("graph"),
            precision=entry["precision"],
            bytes=entry.get("bytes", 0),
            external_data=entry.get("external_data"),
            external_data_bytes=entry.get("external_data_bytes", 0),
            built_from=entry.get("built_from"),
            reports=dict(entry.get("reports") or {}),
            details={k: v for k, v in entry.items() if k not in COMMON_KEYS},
        )


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
    def checkpoint(self) -> Path: ...
    @property
    def gate(self) -> float: ...
    @property
    def logits(self) -> str: ...
    @property
    def config_data(self) -> dict: ...
    def config(self) -> Any: ...  # the exported model's shape (taperfold.taper.ModelShape)
    def get(self, key: str, default: Any = None) -> Any: ...  # a top-level key of manifest.json (`source`, ...)
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


class ArtifactKind:
    """One kind of artifact. Subclass it, set the class attributes, override what the kind does, and register an
    instance (taperfold.artifacts.register_kind)."""

    name: ClassVar[str]  # as manifest.json's `kind` spells it
    title: ClassVar[str]  # as reports name it
    built_from: ClassVar[str]  # TORCH | EXPORT | another kind's name
    verified: ClassVar[str] = CHECKED  # LOGITS | CHECKED
    suffix: ClassVar[str] = ""  # what its keys add to the graph's key: `folded.plan`; "" only for the ONNX graphs
    fields: ClassVar[Mapping[str, Field]] = MappingProxyType({})  # its own keys in a manifest entry
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
        for key, spec in self.fields.items():
            if key in COMMON_KEYS:
                errors.append(f"field {key!r} is a key every artifact has")
            if not isinstance(spec, Field):
                errors.append(f"field {key!r} is not declared as a Field")
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

    def check_fields(self, entry: Mapping[str, Any], origin: str, key: str) -> None:
        """The kind's own fields of manifest entry `key` (of file `origin`): one line naming the key when one is
        missing or mistyped."""
        for name, spec in self.fields.items():
            if name not in entry:
                if spec.required:
                    raise TaperfoldError(f"{origin}: missing key '{key}.{name}'")
                continue
            if not spec.accepts(entry[name]):
                names = spec.expected or " or ".join("null" if t is type(None) else t.__name__ for t in spec.types)
                raise TaperfoldError(
                    f"{origin}: key '{key}.{name}': expected {names}, got {type(entry[name]).__name__}"
                )


# The source's tokenizer files a folder holds (genai, OpenVINO IR), by name
TOKENIZER_FIELD = Field(
    (list,),
    help="the source's tokenizer files copied into the folder",
    check=lambda names: all(is_file_name(n) for n in names),
    expected="a list of file names in the folder",
)


def describe_file(folder: Path, name: str) -> tuple[int, str | None, int]:
    """(bytes, its external data file's name or None, that file's bytes) of a file just written into `folder`."""
    path = folder / name
    data = folder / (name + ".data")
    return path.stat().st_size, data.name if data.is_file() else None, data.stat().st_size if data.is_file() else 0


def tokenizer_files(manifest: Export) -> list[Path]:
    """The source's tokenizer files the export recorded (manifest `source.tokenizer_files`), read from the source
    directory; one line naming a file that is gone."""
    names = (manifest.get("source") or {}).get("tokenizer_files") or []
    files = [manifest.checkpoint / name for name in names]
    for path in files:
        if not path.is_file():
            raise TaperfoldError(
                f"{path}: missing ({manifest.path} records it as a tokenizer file of the source the export came from)"
            )
    return files
