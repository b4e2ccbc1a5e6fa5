"""manifest.json: what an export directory holds, read through one typed API and checked against its schema.

    format, format_version (2), created
    checkpoint: {path, sha256, step}        the source; verify refuses a checkpoint whose sha256 changed
    config                                  the model's shape, as the kind of source that wrote it reads it
    gate, exported_gate, forced_gate0
    export: {logits, dtype, target, opset, kv_cache, max_cache, fuse_projections, inputs, outputs}
    versions, timings
    artifacts: {KEY: {kind, path, variant, graph, precision, bytes, external_data, external_data_bytes, built_from,
                      ...the kind's own fields, reports: {NAME: report}}}

Every artifact is a record of a registered kind (taperfold.artifacts): `add_artifact` records one, `artifact(...)`
finds one's file, `report(key, name)` reads what a stage reported about it (the fold report sits with the folded
graph it made). The schema is checked on read, each problem one line naming the file and the key, and every path an
entry names must stay inside the directory. Keys this module does not model are kept when the manifest is
rewritten. Manifests of format_version 1 (taperfold before artifact kinds) are read by upgrading them in memory
(`_upgrade_v1`); one written by a newer taperfold is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from taperfold.artifacts import ONNX, TENSORRT_PLAN, artifact_kind, is_registered
from taperfold.artifacts.base import COMMON_KEYS, ArtifactRecord
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
from taperfold.jsonfields import is_file_name

MANIFEST = "manifest.json"
FORMAT = "taperfold-export"
# 2: every artifact a record of a registered kind, reports kept with the artifact they describe, TensorRT engines
#    recorded once (as artifacts); 1: ONNX graphs by variant and cache, `engines` and `artifacts.engine` for TensorRT,
#    fold_report / decoder_fold_report / static_fold_report at the top
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MAX_CACHE = 1 << 24  # a static cache longer than any context a model has


class Manifest:
    """manifest.json of one export directory, checked. Artifacts are `ArtifactRecord`s; everything else is read
    through the properties below (the JSON object keeps keys this class does not model)."""

    def __init__(self, directory: Path, data: dict, records: dict[str, ArtifactRecord]):
        self.directory = directory
        self._data = data
        self._records = records

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

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level key this class does not model (`note`, `source`, `timings`, ...)."""
        return self._data.get(key, default)

    # ---- artifacts ----

    def records(self, kind: str | None = None) -> list[ArtifactRecord]:
        """Every artifact (of `kind`), in the order they were added."""
        return [r for r in self._records.values() if kind is None or r.kind == kind]

    def record(self, key: str) -> ArtifactRecord:
        if key not in self._records:
            raise TaperfoldError(f"{self.path}: missing key 'artifacts.{key}'")
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
            raise TaperfoldError(f"{self.path}: missing key 'artifacts.{key}'" + (f": {hint}" if hint else ""))
        return self.file(record)

    def file(self, record: ArtifactRecord) -> Path:
        """The file `record` names, or one line saying it is gone."""
        path = self.directory / record.path
        if not path.is_file():
            raise TaperfoldError(f"{path}: missing ({MANIFEST} lists it as artifacts.{record.key})")
        return path

    def add_artifact(self, record: ArtifactRecord) -> None:
        """Record `record` (replacing one with its key): its kind must be registered and its entry fit the schema."""
        entry = record.to_json()
        _check_entry(self.path, record.key, entry)
        self._records[record.key] = ArtifactRecord.from_json(record.key, entry)

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
        spent = self._data.setdefault("timings", {}).setdefault("build_s", {})
        spent[kind] = round(spent.get(kind, 0.0) + time.perf_counter() - started, 3)
        self.write()
        return records

    def record_time(self, stage: str, seconds: float) -> None:
        """Set `timings.STAGE` to `seconds` (written with the next write())."""
        self._data.setdefault("timings", {})[stage] = round(seconds, 3)

    def report(self, key: str, name: str) -> dict | None:
        """What a stage reported about artifact `key` (e.g. "fold": the passes that made the folded graph)."""
        record = self._records.get(key)
        return None if record is None else record.reports.get(name)

    # ---- on disk ----

    def to_json(self) -> dict:
        return {**self._data, "artifacts": {key: r.to_json() for key, r in self._records.items()}}

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
    timings: dict,
    extra: dict | None = None,
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
        "timings": {k: round(v, 3) for k, v in timings.items()},
        **(extra or {}),
    }
    _check_top(directory / MANIFEST, data)
    return Manifest(directory, data, {})


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
    artifacts = _mapping(path, data, "artifacts")
    records = {}
    for key, entry in artifacts.items():
        _check_entry(path, key, entry)
        records[key] = ArtifactRecord.from_json(key, entry)
    if not any(r.kind == ONNX and r.variant in (BASELINE, UNFOLDED, FOLDED) for r in records.values()):
        raise TaperfoldError(f"{path}: key 'artifacts' lists no ONNX graph of the baseline, unfolded or folded model")
    return Manifest(export_dir, {k: v for k, v in data.items() if k != "artifacts"}, records)


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
    # what the export recorded of its source, which the folders built later from it read
    _typed(path, data, "source", lambda v: isinstance(v, dict), "an object", required=False)
    _typed(path, data, "source.format", lambda v: isinstance(v, str), "a string", required=False)
    _typed(
        path,
        data,
        "source.tokenizer_files",
        lambda v: isinstance(v, list) and all(is_file_name(n) for n in v),
        "a list of file names (no directory part)",
        required=False,
    )
    _typed(
        path,
        data,
        "source.special_tokens",
        lambda v: isinstance(v, dict) and all(_is_token_ids(ids) for ids in v.values()),
        "an object of token ids",
        required=False,
    )


def _is_token_ids(value: Any) -> bool:
    ids = value if isinstance(value, list) else [value]
    return all(_is_int(i) and i >= 0 for i in ids)


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

    kind = typed("kind", lambda v: isinstance(v, str) and v != "", "a kind's name")
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
    if is_registered(kind):
        artifact_kind(kind).check_fields(entry, str(path), where)


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
