"""manifest.json: what an export directory holds, read through one typed API and checked against its schema.

    format, format_version (2), created
    checkpoint: {path, sha256, step}        the source; verify refuses a checkpoint whose sha256 changed
    config                                  the model's shape, as the kind of source that wrote it reads it
    gate, exported_gate, forced_gate0
    export: {logits, dtype, target, opset, kv_cache, max_cache, fuse_projections, inputs, outputs}
    versions
    timings: {STAGE_s..., build_s: {KIND: s}, total_s}         StageTimings
    source: {format, family, ..., special_tokens, tokenizer_files}   ManifestSource (a Hugging Face source only)
    note                                    a plain model's: nothing to fold
    artifacts: {KEY: {kind, path, variant, graph, precision, bytes, external_data, external_data_bytes, built_from,
                      ...the kind's own keys (its details_type), reports: {NAME: report}}}

Every artifact is a record of a registered kind (taperfold.artifacts): `add_artifact` records one, `artifact(...)`
finds one's file, `report(key, name)` reads what a stage reported about it (the fold report sits with the folded
graph it made). The schema is checked on read, each problem one line naming the file and the key, and every path an
entry names must stay inside the directory. The typed parts (`source`, `timings`, `note`, each artifact's details)
are read once, when the manifest is read, and written back as the same keys; keys this module does not model are
kept when the manifest is rewritten. Manifests of format_version 1 (taperfold before artifact kinds) are read by
upgrading them in memory (`_upgrade_v1`); one written by a newer taperfold is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from taperfold.artifacts import ONNX, TENSORRT_PLAN, artifact_kind, is_registered
from taperfold.artifacts.base import COMMON_KEYS, ArtifactRecord, UnknownDetails
from taperfold.errors import TaperfoldError
from taperfold.exportdir import (
    BASELINE,
    DTYPES,
    FOLDED,
    GRAPHS,
    GROWING,
    KV_CACHES,
    LOGITS,
    NAMEABLE_VARIANTS,
    PREFILL,
    STATIC,
    UNFOLDED,
    Graph,
    canonical_variant,
    graph_key,
    parse_graph_key,
)
from taperfold.fsutil import check_inside, read_json_object, write_json_atomic
from taperfold.jsonfields import Fields
from taperfold.manifest_source import ManifestSource

MANIFEST = "manifest.json"
FORMAT = "taperfold-export"
# 2: every artifact a record of a registered kind, reports kept with the artifact they describe, TensorRT engines
#    recorded once (as artifacts); 1: ONNX graphs by variant and cache, `engines` and `artifacts.engine` for TensorRT,
#    fold_report / decoder_fold_report / static_fold_report at the top
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MAX_CACHE = 1 << 24  # a static cache longer than any context a model has


@dataclass(frozen=True)
class StageTimings:
    """manifest `timings`: where an export's time went. `stages`: seconds per stage as export's StageClock measured
    them, in the order they ran (torch_export_s, passes_s and write_s always; stamp_layers_s and ort_fusions_s where
    they ran); `build_s`: seconds per artifact kind built (`Manifest.build`); `total_s`: the export's wall time
    (None until the export ends, and in a manifest from before it was recorded)."""

    stages: dict[str, float] = field(default_factory=dict)
    build_s: dict[str, float] = field(default_factory=dict)
    total_s: float | None = None

    @property
    def torch_export_s(self) -> float:
        return self.stages.get("torch_export_s", 0.0)

    @property
    def passes_s(self) -> float:
        return self.stages.get("passes_s", 0.0)

    @property
    def write_s(self) -> float:
        return self.stages.get("write_s", 0.0)

    @property
    def stamp_layers_s(self) -> float | None:
        """Stamping out the layers not traced (None: every layer was traced)."""
        return self.stages.get("stamp_layers_s")

    @property
    def ort_fusions_s(self) -> float | None:
        """ONNX Runtime's fusions (None: --ort-fusions did not run)."""
        return self.stages.get("ort_fusions_s")

    @property
    def counted_s(self) -> float:
        """The seconds the stages and the builds account for (of `total_s`)."""
        return sum(self.stages.values()) + sum(self.build_s.values())

    @classmethod
    def from_clock(cls, seconds: Mapping[str, float]) -> StageTimings:
        return cls(stages={stage: round(s, 3) for stage, s in seconds.items()})

    def with_build(self, kind: str, seconds: float) -> StageTimings:
        """These timings with `seconds` more spent building `kind`."""
        return replace(self, build_s={**self.build_s, kind: round(self.build_s.get(kind, 0.0) + seconds, 3)})

    def with_total(self, seconds: float) -> StageTimings:
        return replace(self, total_s=round(seconds, 3))

    @classmethod
    def from_json(cls, timings: Fields | None) -> StageTimings:
        """Read from `timings` (None: the manifest has none, as version-1 ones may not)."""
        if timings is None:
            return cls()
        stages = {name: timings.number(name) for name in timings.data if name not in ("build_s", "total_s")}
        return cls(stages, timings.numbers_by_name("build_s", None), timings.optional_number("total_s"))

    def to_json(self) -> dict[str, Any]:
        return {
            **self.stages,
            **({"build_s": self.build_s} if self.build_s else {}),
            **({"total_s": self.total_s} if self.total_s is not None else {}),
        }


class Manifest:
    """manifest.json of one export directory, checked. Artifacts are `ArtifactRecord`s; everything else is read
    through the attributes and properties below (the JSON object keeps keys this class does not model)."""

    def __init__(
        self,
        directory: Path,
        data: dict,
        records: dict[str, ArtifactRecord],
        source: ManifestSource | None = None,
        timings: StageTimings | None = None,
        note: str | None = None,
    ):
        self.directory = directory
        self._data = data  # the JSON object less its artifacts; the typed parts below replace their keys on write
        self._records = records
        self.source = source  # what the export recorded of its source (None: a taperfold checkpoint's export)
        self.timings = timings or StageTimings()
        self.note = note  # what export said of the model (a plain model: nothing to fold)

    # ---- what was exported ----

    @property
    def path(self) -> Path:
        return self.directory / MANIFEST

    @property
    def checkpoint(self) -> Path:
        return Path(self._data["checkpoint"]["path"])

    @property
    def checkpoint_sha256(self) -> str:
        return self._data["checkpoint"]["sha256"]

    @property
    def gate(self) -> float:
        return self._data["gate"]

    @property
    def forced_gate0(self) -> bool:
        return self._data["forced_gate0"]

    @property
    def logits(self) -> str:
        return self._data["export"]["logits"]

    @property
    def dtype(self) -> str:
        return self._data["export"]["dtype"]

    @property
    def onnx(self) -> bool:
        """Whether the export wrote ONNX graphs (False: `export --no-onnx`, its folders alone)."""
        return self._data["export"].get("onnx", True)

    @property
    def max_cache(self) -> int | None:
        """The cache length of the static decoders (None: the export has none)."""
        return self._data["export"].get("max_cache")

    @property
    def fused_projections(self) -> bool:
        """Whether export fused each group of sibling projections (q/k/v, gate/up) into one MatMul and a Split."""
        return bool(self._data["export"].get("fuse_projections"))

    @property
    def config_data(self) -> dict:
        return self._data["config"]

    def config(self):
        """The exported model's shape, read by the kind of source that wrote it (taperfold.sources)."""
        from taperfold.sources import config_from_dict

        try:
            return config_from_dict(self._data["config"])
        except (TypeError, ValueError) as e:
            raise TaperfoldError(f"{self.path}: key 'config': {e}") from None

    # ---- artifacts ----

    def records(self, kind: str | None = None) -> list[ArtifactRecord]:
        """Every artifact (of `kind`), in the order they were added."""
        return [r for r in self._records.values() if kind is None or r.kind == kind]

    def record(self, key: str) -> ArtifactRecord:
        if key not in self._records:
            hint = "" if self.onnx else f": {NO_GRAPHS_HINT}"
            raise TaperfoldError(f"{self.path}: missing key 'artifacts.{key}'{hint}")
        return self._records[key]

    def find(
        self, variant: str, graph: Graph = PREFILL, kind: str = ONNX, precision: str | None = None
    ) -> ArtifactRecord | None:
        """The artifact of `kind` for `variant`'s `graph` (in the export's dtype unless `precision`), or None."""
        variant = canonical_variant(variant)
        for record in self._records.values():
            if (record.kind, record.variant, record.graph) == (kind, variant, graph) and record.precision == (
                precision or self.dtype
            ):
                return record
        return None

    def has_artifact(self, variant: str, graph: Graph = PREFILL, kind: str = ONNX) -> bool:
        return self.find(variant, graph, kind) is not None

    def artifact(self, variant: str, graph: Graph = PREFILL, kind: str = ONNX, precision: str | None = None) -> Path:
        """The file of `variant`'s `graph` of `kind`: a one-line error naming manifest.json and what to run when the
        manifest does not list it, or the file it lists is gone."""
        record = self.find(variant, graph, kind, precision)
        if record is None:
            key = artifact_kind(kind).key(canonical_variant(variant), graph, precision)
            hint = _MISSING_HINT.get((kind, graph), "")
            if precision not in (None, self.dtype) and self.find(variant, graph, kind) is not None:
                hint = f"re-export with --quantize {precision}"  # the graph is there, its quantized form is not
            if kind == ONNX and not self.onnx:
                hint = NO_GRAPHS_HINT
            raise TaperfoldError(f"{self.path}: missing key 'artifacts.{key}'" + (f": {hint}" if hint else ""))
        return self.file(record)

    def file(self, record: ArtifactRecord) -> Path:
        """The file `record` names, or one line saying it is gone."""
        path = self.directory / record.path
        if not path.is_file():
            raise TaperfoldError(f"{path}: missing ({MANIFEST} lists it as artifacts.{record.key})")
        return path

    def add_artifact(self, record: ArtifactRecord) -> None:
        """Record `record` (replacing one with its key): its entry must fit the schema, its details read back as its
        kind's (a copy: the record given is not kept)."""
        self._records[record.key] = _record(self.path, record.key, record.to_json())

    def build(
        self, kind: str, request: Any = None, on_stage: Callable[[str], None] = lambda s: None
    ) -> list[ArtifactRecord]:
        """Build the artifacts of `kind` that `request` asks for (an instance of the kind's `request_type`, e.g.
        TensorrtRequest(profile=...); None: its defaults) from what this export holds, as the kind does it, record
        them, add the seconds it took to `timings.build_s.KIND` and rewrite manifest.json."""
        artifact = artifact_kind(kind)
        if request is None:
            try:
                request = artifact.request_type()
            except TypeError as e:  # a request type with fields it has no default for
                raise TaperfoldError(f"artifact kind {kind!r} needs a {artifact.request_type.__name__}: {e}") from None
        if not isinstance(request, artifact.request_type):
            raise TaperfoldError(
                f"artifact kind {kind!r} takes a {artifact.request_type.__name__} request, not {type(request).__name__}"
            )
        check_inside(self.path, self.directory)  # before the work: the manifest will be rewritten after it
        started = time.perf_counter()
        records = artifact.build(self, request, on_stage)
        for record in records:
            self.add_artifact(record)
        self.timings = self.timings.with_build(kind, time.perf_counter() - started)
        self.write()
        return records

    def report(self, key: str, name: str) -> dict | None:
        """What a stage reported about artifact `key` (e.g. "fold": the passes that made the folded graph)."""
        record = self._records.get(key)
        return None if record is None else record.reports.get(name)

    # ---- on disk ----

    def to_json(self) -> dict:
        """The manifest as JSON: each typed part where its key was read (or, new, at the end)."""
        data = dict(self._data)
        if self.source is not None:
            data["source"] = self.source.to_json()
        if "timings" in data or self.timings != StageTimings():
            data["timings"] = self.timings.to_json()
        if self.note is not None:
            data["note"] = self.note
        return {**data, "artifacts": {key: r.to_json() for key, r in self._records.items()}}

    def write(self) -> None:
        """Rewrite manifest.json atomically (at the current format version), in the directory itself: a manifest.json
        planted as a link is refused, never written through."""
        write_json_atomic(self.path, {**self.to_json(), "format_version": FORMAT_VERSION}, within=self.directory)


_MISSING_HINT = {(ONNX, GROWING): "re-export with --kv-cache", (ONNX, STATIC): "re-export with --kv-cache static"}


def new_manifest(
    directory: Path,
    *,
    checkpoint: dict,
    config: dict,
    gate: float,
    forced_gate0: bool,
    export: dict,
    versions: dict,
    timings: StageTimings,
    source: ManifestSource | None = None,
    note: str | None = None,
) -> Manifest:
    """The manifest of a new export, without artifacts yet (export adds them as it writes them)."""
    data = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": checkpoint,
        "config": config,
        "gate": gate,
        "exported_gate": 0.0,
        "forced_gate0": forced_gate0,
        "export": export,
        "versions": versions,
        "timings": timings.to_json(),
        **({"source": source.to_json()} if source is not None else {}),
        **({"note": note} if note is not None else {}),
    }
    _check_top(directory / MANIFEST, data)
    return Manifest(directory, data, {}, source, timings, note)


NO_GRAPHS_HINT = "exported with --no-onnx, it holds no ONNX graph (export again without it, or run its folders)"


def is_export_dir(path: Path) -> bool:
    """Whether `path` holds a taperfold export, which a new export may replace whole."""
    try:
        return read_json_object(path / MANIFEST).get("format") == FORMAT
    except TaperfoldError:
        return False


def read_manifest(export_dir: str | Path) -> Manifest:
    """Read and check DIR/manifest.json; every problem is one line naming the file and the key."""
    export_dir = Path(export_dir)
    if not export_dir.exists():
        raise TaperfoldError(f"{export_dir}: no such directory (run `taperfold export` first)")
    if not export_dir.is_dir():
        raise TaperfoldError(f"{export_dir}: not a directory; pass the folder `taperfold export` wrote")
    path = export_dir / MANIFEST
    if not path.is_file():
        raise TaperfoldError(f"{path}: missing; is {export_dir} a taperfold export directory?")
    data = read_json_object(path)
    if data.get("format") != FORMAT:
        raise TaperfoldError(f"{path}: not a taperfold export manifest (key 'format' is not '{FORMAT}')")
    version = data.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        newer = type(version) is int and version > FORMAT_VERSION
        raise TaperfoldError(
            f"{path}: key 'format_version' is {version!r}"
            + ("; written by a newer taperfold" if newer else "")
            + f"; this taperfold reads versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    if version == 1:
        _check_v1(path, data)
        data = _upgrade_v1(data)
    _check_top(path, data)
    # the typed parts, each read (and so checked) once by its type
    top = Fields(data, str(path))
    source = ManifestSource.from_json(top.child("source")) if top.has("source") else None
    timings = StageTimings.from_json(top.child("timings") if top.has("timings") else None)
    note = top.optional_text("note")
    records = {key: _record(path, key, entry) for key, entry in _mapping(path, data, "artifacts").items()}
    if not _wrote_graphs(path, data):
        if not records:
            raise TaperfoldError(f"{path}: key 'artifacts' is empty (an export with 'onnx': false lists its folders)")
    elif not any(r.kind == ONNX and r.variant in (BASELINE, UNFOLDED, FOLDED) for r in records.values()):
        raise TaperfoldError(f"{path}: key 'artifacts' lists no ONNX graph of the baseline, unfolded or folded model")
    data = {k: v for k, v in data.items() if k != "artifacts"}
    return Manifest(export_dir, data, records, source, timings, note)


def _wrote_graphs(path: Path, data: dict) -> bool:
    """Whether the export wrote ONNX graphs: key 'export.onnx', false for `export --no-onnx` (absent: true)."""
    export = data.get("export")
    onnx = export.get("onnx", True) if isinstance(export, dict) else True
    if not isinstance(onnx, bool):
        raise TaperfoldError(f"{path}: key 'export.onnx' must be true or false, got {onnx!r}")
    return onnx


def _record(path: Path, key: str, entry: Any) -> ArtifactRecord:
    """The record of manifest entry `key`: the keys every artifact has checked, then its kind's own read by the kind's
    details_type (one line naming the key where one is wrong), or kept as they are for a kind not registered here."""
    _check_entry(path, key, entry)
    kind = entry["kind"]
    fields = Fields(entry, str(path), f"artifacts.{key}")
    details = (artifact_kind(kind).details_type if is_registered(kind) else UnknownDetails).from_json(fields)
    unmodeled = {k: v for k, v in entry.items() if k not in COMMON_KEYS and k not in fields.read}
    return ArtifactRecord(
        key=key,
        kind=kind,
        path=entry["path"],
        variant=entry.get("variant"),
        graph=entry.get("graph"),
        precision=entry["precision"],
        bytes=entry.get("bytes", 0),
        external_data=entry.get("external_data"),
        external_data_bytes=entry.get("external_data_bytes", 0),
        built_from=entry.get("built_from"),
        details=details,
        reports=dict(entry.get("reports") or {}),
        unmodeled=unmodeled,
    )


# ---- the schema ----------------------------------------------------------------------------------------------


def _where(path: Path, key: str) -> str:
    return f"{path}: key '{key}'"


def _mapping(path: Path, data: dict, key: str) -> dict:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise TaperfoldError(f"{path}: missing key '{key}'")
        node = node[part]
    if not isinstance(node, dict):
        raise TaperfoldError(f"{_where(path, key)}: expected an object, got {type(node).__name__}")
    return node


def _typed(path: Path, data: dict, key: str, check: Callable[[Any], bool], expected: str, required: bool = True):
    """The value at dotted `key` of `data`, checked; one line naming the file and the key when it is not there (and
    `required`) or fails `check`."""
    parent, _, name = key.rpartition(".")
    node: Any = data
    for part in parent.split(".") if parent else ():
        if not isinstance(node, dict) or part not in node:
            if required:
                raise TaperfoldError(f"{path}: missing key '{key}'")
            return None
        node = node[part]
    if not isinstance(node, dict):
        raise TaperfoldError(f"{_where(path, parent)}: expected an object, got {type(node).__name__}")
    return _field(path, node, name, key, check, expected, required)


def _field(
    path: Path, node: dict, name: str, key: str, check: Callable[[Any], bool], expected: str, required: bool = True
):
    """`node[name]`, checked (`key` names it in errors)."""
    if name not in node:
        if required:
            raise TaperfoldError(f"{path}: missing key '{key}'")
        return None
    value = node[name]
    if not check(value):
        raise TaperfoldError(f"{_where(path, key)}: expected {expected}, got {value!r}"[:300])
    return value


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _check_top(path: Path, data: dict) -> None:
    """The keys of a manifest other than its artifacts."""
    _typed(path, data, "checkpoint.path", lambda v: isinstance(v, str) and v != "", "a path")
    _typed(path, data, "checkpoint.sha256", lambda v: isinstance(v, str), "a string")
    _typed(path, data, "checkpoint.step", lambda v: v is None or _is_int(v), "an integer or null", required=False)
    _mapping(path, data, "config")
    _typed(path, data, "gate", _is_number, "a number")
    _typed(path, data, "forced_gate0", lambda v: isinstance(v, bool), "true or false")
    _typed(path, data, "export.logits", lambda v: v in LOGITS, " or ".join(map(repr, LOGITS)))
    _typed(path, data, "export.dtype", lambda v: v in DTYPES, ", ".join(DTYPES))
    _typed(
        path,
        data,
        "export.kv_cache",
        lambda v: isinstance(v, list) and all(c in KV_CACHES for c in v),
        f"a list of {', '.join(KV_CACHES)}",
        required=False,
    )
    _typed(
        path,
        data,
        "export.max_cache",
        lambda v: v is None or (_is_int(v) and 1 <= v <= MAX_CACHE),
        f"null or an integer from 1 to {MAX_CACHE}",
        required=False,
    )
    _typed(path, data, "export.fuse_projections", lambda v: isinstance(v, bool), "true or false", required=False)


def _inside(name: Any) -> bool:
    """A relative path that stays inside the export directory (no '..', not absolute, no backslashes)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    pure = PurePosixPath(name)
    return not pure.is_absolute() and ".." not in pure.parts and name == str(pure)


def _check_entry(path: Path, key: str, entry: Any) -> None:
    """One artifact entry: the keys every artifact has, then its kind's own (when the kind is registered here)."""
    where = f"artifacts.{key}"
    if not isinstance(entry, dict):
        raise TaperfoldError(f"{_where(path, where)}: expected an object, got {type(entry).__name__}")

    def typed(name: str, check: Callable[[Any], bool], expected: str, required: bool = True):
        return _field(path, entry, name, f"{where}.{name}", check, expected, required)

    typed("kind", lambda v: isinstance(v, str) and v != "", "a kind's name")
    typed("path", _inside, "a file name inside the export directory")
    typed(
        "external_data",
        lambda v: v is None or _inside(v),
        "null or a file name inside the export directory",
        required=False,
    )
    typed("variant", lambda v: v is None or v in NAMEABLE_VARIANTS, "null or a variant's name", required=False)
    typed("graph", lambda v: v is None or v in GRAPHS, f"null or one of {', '.join(GRAPHS)}", required=False)
    typed("precision", lambda v: isinstance(v, str) and v != "", "a precision (fp32, fp16, int4, ...)")
    for name in ("bytes", "external_data_bytes"):
        typed(name, lambda v: _is_int(v) and v >= 0, "a byte count", required=False)
    typed("built_from", lambda v: v is None or isinstance(v, str), "null or an artifact's key", required=False)
    typed("reports", lambda v: isinstance(v, dict), "an object", required=False)


# ---- format_version 1 ----------------------------------------------------------------------------------------


def _check_v1(path: Path, data: dict) -> None:
    """What every version-1 manifest had: the checks taperfold made of them when it wrote them."""
    artifacts = _mapping(path, data, "artifacts")
    baseline_only = not {UNFOLDED, FOLDED} & set(artifacts)
    for key in (BASELINE,) if baseline_only else (UNFOLDED, FOLDED):
        _typed(path, data, f"artifacts.{key}.path", lambda v: isinstance(v, str), "a file name")
    _typed(path, data, "engines", lambda v: isinstance(v, dict), "an object", required=False)


def _upgrade_v1(data: dict) -> dict:
    """A version-1 manifest as version 2: each graph entry gets its kind, variant, graph and precision, the fold
    reports move to the folded graphs they describe, and each TensorRT engine (`engines.VARIANT`, and
    `artifacts.engine` for the folded one) becomes one artifact of kind tensorrt-plan."""
    dtype = data["export"]["dtype"]
    reports = {
        GROWING: data.get("decoder_fold_report"),
        STATIC: data.get("static_fold_report"),
        PREFILL: data.get("fold_report"),
    }
    artifacts = {}
    for key, entry in data["artifacts"].items():
        parsed = parse_graph_key(key)
        if parsed is None:  # `engine`: recorded again below, from `engines`
            continue
        variant, graph = parsed
        fold = reports[graph] if variant == FOLDED else None
        artifacts[key] = {
            **entry,
            "kind": ONNX,
            "variant": variant,
            "graph": graph,
            "precision": dtype,
            "built_from": graph_key(UNFOLDED, graph) if variant == FOLDED else None,
            "reports": {"fold": fold} if fold else {},
        }
    for variant, engine in (data.get("engines") or {}).items():
        if not isinstance(engine, dict):
            continue
        details = {k: v for k, v in engine.items() if k not in (*COMMON_KEYS, "dtype")}
        artifacts[f"{variant}.plan"] = {
            **details,
            "kind": TENSORRT_PLAN,
            "path": engine.get("path"),
            "variant": variant,
            "graph": PREFILL,
            "precision": engine.get("dtype", dtype),
            "bytes": engine.get("bytes", 0),
            "external_data": None,
            "external_data_bytes": 0,
            "built_from": variant,
            "reports": {},
        }
    export = dict(data["export"])
    if isinstance(export.get("kv_cache"), bool):  # before static caches: true meant the growing decoder
        export["kv_cache"] = [GROWING] if export["kv_cache"] else []
    dropped = ("fold_report", "decoder_fold_report", "static_fold_report", "engines")
    return {
        **{k: v for k, v in data.items() if k not in dropped},
        "format_version": FORMAT_VERSION,
        "export": export,
        "artifacts": artifacts,
    }
