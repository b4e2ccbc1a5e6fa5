"""TensorRT engines (kind `tensorrt-plan`), built from an export's ONNX graphs: `model.plan` (folded) and, for the
benchmark, `baseline.plan` and `unfolded.plan`, with one optimization profile for `input_ids` [batch, sequence].
Recorded as artifacts `VARIANT.plan` (built_from: the graph's key); verify holds each to the checkpoint.

Works with TensorRT 10.x and 11.x. TensorRT 11 networks are always strongly typed (its FP16/BF16 builder
flags are gone); on 10.x the network is created with the STRONGLY_TYPED flag so both behave alike: the
ONNX model's dtype (`export --dtype`) decides the precision, as it does in ONNX Runtime. docs/tensorrt.md
lists the API pages and binding sources each call was checked against; this path has not yet run on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taperfold import trt_support
from taperfold.artifacts import ONNX, TENSORRT_PLAN, artifact_kind, register_kind
from taperfold.artifacts.base import LOGITS, ArtifactKind, ArtifactRecord, Export, ExportRequest, Option, details_of
from taperfold.errors import TaperfoldError
from taperfold.exportdir import ALIASES, FOLDED, INPUT, PREFILL, VARIANTS_BY_NAME, Graph, canonical_variant
from taperfold.fsutil import atomic_path, check_inside
from taperfold.jsonfields import Fields
from taperfold.onnx_files import check_onnx_file
from taperfold.opsets import TRT_MIN_VERSION

TIMING_CACHE = "trt.timing-cache"


# ---- profile (pure Python) ---------------------------------------------------------------------------


def _triple(value, what: str) -> tuple[int, int, int]:
    """(min, opt, max) from a 3-sequence or a string "1/4/8" or "1,4,8"."""
    parts = value.replace(",", "/").split("/") if isinstance(value, str) else list(value)
    try:
        out = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise TaperfoldError(f"{what}: expected three integers min/opt/max, got {value!r}") from None
    if len(out) != 3:
        raise TaperfoldError(f"{what}: expected three integers min/opt/max, got {value!r}")
    lo, opt, hi = out
    if not 1 <= lo <= opt <= hi:
        raise TaperfoldError(f"{what}: need 1 <= min <= opt <= max, got min {lo}, opt {opt}, max {hi}")
    return out


@dataclass(frozen=True)
class Profile:
    """One TensorRT optimization profile for `input_ids`: (min, opt, max) of batch and of sequence."""

    batch: tuple[int, int, int]
    sequence: tuple[int, int, int]

    def __post_init__(self):
        object.__setattr__(self, "batch", _triple(self.batch, "batch"))
        object.__setattr__(self, "sequence", _triple(self.sequence, "sequence"))

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(min, opt, max) shapes of `input_ids`, as `IOptimizationProfile.set_shape` takes them."""
        (b0, b1, b2), (s0, s1, s2) = self.batch, self.sequence
        return (b0, s0), (b1, s1), (b2, s2)

    def to_dict(self) -> dict:
        return {"input": INPUT, "batch": list(self.batch), "sequence": list(self.sequence)}

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        return cls(batch=d["batch"], sequence=d["sequence"])


@dataclass(frozen=True)
class TensorrtDetails:
    """A TensorRT engine's own keys in the manifest. None where an older entry has no such key; `timing_cache` is
    written as null where the build shared none."""

    tensorrt: str  # the TensorRT version that built it (a plan runs on no other)
    profile: Profile  # the optimization profile of input_ids it was built for
    onnx: str | None = None  # the ONNX graph it was built from
    gpu: str | None = None  # the GPU it was built on
    compute_capability: str | None = None
    strongly_typed: bool | None = None  # the ONNX dtype decides each layer's precision
    build_seconds: float | None = None
    timing_cache: str | None = None  # the timing cache file the builds in this folder share

    @classmethod
    def from_json(cls, entry: Fields) -> TensorrtDetails:
        version = entry.text("tensorrt")
        shape = entry.child("profile")
        try:
            profile = Profile(_triple(shape.counts("batch"), "batch"), _triple(shape.counts("sequence"), "sequence"))
        except TaperfoldError as e:  # "batch: need 1 <= min <= opt <= max, ..."
            what, _, why = str(e).partition(": ")
            raise TaperfoldError(f"{entry.origin}: key '{shape.key(what)}': {why}") from None
        return cls(
            tensorrt=version,
            profile=profile,
            onnx=entry.optional_text("onnx"),
            gpu=entry.optional_text("gpu"),
            compute_capability=entry.optional_text("compute_capability"),
            strongly_typed=entry.optional_flag("strongly_typed"),
            build_seconds=entry.optional_number("build_seconds"),
            timing_cache=entry.optional_text("timing_cache"),
        )

    def to_json(self) -> dict[str, Any]:
        keys = {
            "onnx": self.onnx,
            "tensorrt": self.tensorrt,
            "gpu": self.gpu,
            "compute_capability": self.compute_capability,
            "strongly_typed": self.strongly_typed,
            "profile": self.profile.to_dict(),
            "build_seconds": self.build_seconds,
            "timing_cache": self.timing_cache,
        }
        return {k: v for k, v in keys.items() if v is not None or k == "timing_cache"}


def make_profile(max_seq_len: int, batch=None, sequence=None) -> Profile:
    """Defaults: batch 1/1/8, sequence 1/min(128, max_seq_len)/max_seq_len. Flags may pass "1/4/8"."""
    batch = (1, 1, 8) if batch is None else batch
    sequence = (1, min(128, max_seq_len), max_seq_len) if sequence is None else sequence
    profile = Profile(batch=batch, sequence=sequence)
    if profile.sequence[2] > max_seq_len:
        raise TaperfoldError(f"sequence: max {profile.sequence[2]} exceeds the model's max_seq_len {max_seq_len}")
    return profile


# ---- environment -------------------------------------------------------------------------------------


def _major(trt) -> int:
    return int(trt.__version__.split(".")[0])


def _network_flags(trt) -> int:
    """TensorRT 11: 0 (always strongly typed; its STRONGLY_TYPED flag is deprecated and ignored).
    TensorRT 10: opt in to strong typing, so the ONNX dtype decides precision as on 11."""
    major = _major(trt)
    if major >= 11:
        return 0
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if major < 10 or flag is None:
        raise TaperfoldError(f"TensorRT {trt.__version__} is too old: taperfold needs TensorRT 10 or 11")
    return 1 << int(flag)


# ---- build -------------------------------------------------------------------------------------------


def _parser_error(parser, onnx_path: Path) -> str:
    n = parser.num_errors
    if n == 0:
        return f"{onnx_path}: TensorRT's ONNX parser failed without reporting an error"
    err = parser.get_error(0)
    desc = " ".join(str(err.desc()).split())  # one line, whatever the parser put in it
    more = f" (and {n - 1} more)" if n > 1 else ""
    return f"{onnx_path}: TensorRT cannot parse it: node {err.node()}: {desc}{more}"


def _too_old_for_the_table(trt) -> str:
    """Why a parse may have failed when this TensorRT is older than the one the opset table assumes."""
    version = tuple(int(part) for part in trt.__version__.split(".")[:2])
    if version >= TRT_MIN_VERSION:
        return ""
    return (
        f"; TensorRT {trt.__version__} is older than {'.'.join(map(str, TRT_MIN_VERSION))}, whose parser the "
        "--target trt graphs assume (docs/opsets.md): upgrade it, or export with --opset 20"
    )


def _attach_timing_cache(config, path: Path | None):
    """Load the cache file if there is one; a cache from another TensorRT or GPU is replaced by an empty one."""
    blob = path.read_bytes() if path is not None and path.is_file() else b""
    cache = config.create_timing_cache(blob)
    if not config.set_timing_cache(cache, False) and blob:
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    return cache


def build_engine(
    onnx_path,
    plan_path,
    profile: Profile,
    timing_cache=None,
    on_stage: Callable[[str], None] = lambda s: None,
    within=None,
) -> TensorrtDetails:
    """Parse `onnx_path` (its external data is found beside it), build, write `plan_path` atomically.
    `within`: the export directory the plan and timing cache are files of (a link planted there is refused before the
    build, never written through). Returns what the manifest records of the engine."""
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    timing_cache = Path(timing_cache) if timing_cache is not None else None
    if within is not None:
        for path in (plan_path, timing_cache):
            if path is not None:
                check_inside(path, within)
    trt = trt_support.require_tensorrt()
    check_onnx_file(onnx_path)  # the parser reads external data wherever a location points: only beside the model
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    on_stage(f"TensorRT: parsing {onnx_path.name}")
    if not parser.parse_from_file(str(onnx_path)):
        raise TaperfoldError(_parser_error(parser, onnx_path) + _too_old_for_the_table(trt))

    config = builder.create_builder_config()
    opt_profile = builder.create_optimization_profile()
    opt_profile.set_shape(INPUT, *profile.shapes())
    config.add_optimization_profile(opt_profile)
    cache = _attach_timing_cache(config, timing_cache)

    on_stage(f"TensorRT: building {plan_path.name}")
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - t0
    if plan is None:
        raise TaperfoldError(f"{onnx_path}: TensorRT could not build an engine (its log above says why)")
    with atomic_path(plan_path, within=within) as tmp:
        tmp.write_bytes(plan)
    if timing_cache is not None:
        with atomic_path(timing_cache, within=within) as tmp:
            tmp.write_bytes(cache.serialize())
    gpu = trt_support.gpu() or {}
    return TensorrtDetails(
        tensorrt=trt.__version__,
        profile=profile,
        onnx=onnx_path.name,
        gpu=gpu.get("gpu"),
        compute_capability=gpu.get("compute_capability"),
        strongly_typed=True,
        build_seconds=round(seconds, 3),
        timing_cache=timing_cache.name if timing_cache is not None else None,
    )


def _resolve_profile(manifest: Export, profile: Profile | None) -> Profile:
    """The given profile, else the one earlier engines in this folder used (so that every variant the
    benchmark compares was built for the same shapes), else the defaults."""
    max_seq_len = manifest.config_data["max_seq_len"]
    if profile is None:
        earlier = [details_of(r, TensorrtDetails).profile for r in manifest.records(TENSORRT_PLAN)]
        profile = earlier[0] if earlier else make_profile(max_seq_len)
    if profile.sequence[2] > max_seq_len:
        raise TaperfoldError(f"sequence: max {profile.sequence[2]} exceeds the model's max_seq_len {max_seq_len}")
    return profile


@dataclass(frozen=True)
class TensorrtRequest:
    """Engines of `variants` for `profile` (None: one of `batch` and `sequence`, "MIN/OPT/MAX" each, the rest
    make_profile's defaults; neither: the folder's earlier engines' profile, else make_profile's)."""

    variants: tuple[str, ...] = (FOLDED,)
    profile: Profile | None = None
    batch: str | None = None
    sequence: str | None = None

    def __post_init__(self) -> None:
        for what in ("batch", "sequence"):  # three integers each, refused in one line before any work
            if getattr(self, what) is not None:
                _triple(getattr(self, what), what)


class TensorrtPlan(ArtifactKind):
    name = TENSORRT_PLAN
    title = "TensorRT engine"
    built_from = ONNX
    verified = LOGITS
    suffix = "plan"
    target = "trt"  # `export --trt` traces the graphs for TensorRT unless --target says otherwise
    options = (
        Option(
            "--trt",
            is_flag=True,
            help="Also build a TensorRT engine (model.plan) from model.onnx (needs a GPU).",
        ),
        Option("--trt-batch", metavar="MIN/OPT/MAX", help="TensorRT profile batch sizes.  [default: 1/1/8]"),
        Option(
            "--trt-seq", metavar="MIN/OPT/MAX", help="TensorRT profile sequence lengths.  [default: 1/128/max_seq_len]"
        ),
    )
    request_type = TensorrtRequest
    details_type = TensorrtDetails

    def request(self, values: Mapping[str, Any], export: ExportRequest) -> TensorrtRequest | None:
        """--trt: the folded model's engine, for --trt-batch and --trt-seq."""
        if not values["trt"]:
            return None
        return TensorrtRequest(batch=values["trt_batch"], sequence=values["trt_seq"])

    def build(
        self, manifest: Export, request: TensorrtRequest, on_stage: Callable[[str], None] = lambda s: None
    ) -> list[ArtifactRecord]:
        """The engines `request` asks for, one timing cache (`trt.timing-cache`) shared by all builds in the
        folder."""
        trt_support.require_tensorrt()  # before the profile is read: built from Python, no check_request ran
        variants = [ALIASES.get(v, v) for v in request.variants]
        profile = request.profile
        if profile is None and (request.batch or request.sequence):
            profile = make_profile(manifest.config_data["max_seq_len"], request.batch, request.sequence)
        profile = _resolve_profile(manifest, profile)
        records = []
        for variant in variants:
            graph = manifest.find(variant, PREFILL, ONNX) if variant in VARIANTS_BY_NAME else None
            if graph is None or not VARIANTS_BY_NAME[variant].exported:
                known = ", ".join(r.variant or "" for r in manifest.records(ONNX) if r.graph == PREFILL)
                raise TaperfoldError(
                    f"{manifest.path}: no ONNX model for variant {variant!r} (engines can be built for: {known})"
                )
            plan = f"{VARIANTS_BY_NAME[variant].stem}.plan"
            details = build_engine(
                manifest.file(graph),
                manifest.directory / plan,
                profile,
                timing_cache=manifest.directory / TIMING_CACHE,
                on_stage=on_stage,
                within=manifest.directory,
            )
            records.append(
                ArtifactRecord(
                    key=self.key(variant, PREFILL),
                    kind=self.name,
                    path=plan,
                    variant=variant,
                    graph=PREFILL,
                    precision=graph.precision,
                    bytes=(manifest.directory / plan).stat().st_size,
                    built_from=graph.key,
                    details=details,
                )
            )
        return records

    def check_request(self, request: TensorrtRequest, export: ExportRequest) -> None:
        """TensorRT installed, before the export's work (its profile was checked when the request was made)."""
        trt_support.require_tensorrt()

    def files(
        self, manifest: Export, variants: list[str], graph: Graph, precision: str | None = None
    ) -> dict[str, Path]:
        """The engines of `variants`, built from their ONNX graphs when missing or stale."""
        if precision not in (None, manifest.dtype):
            raise TaperfoldError(
                f"TensorRT engines are built from the {manifest.dtype} graphs (the ONNX dtype decides their "
                f"precision), not {precision} ones"
            )
        if graph != PREFILL:
            raise TaperfoldError(f"TensorRT engines are built for prefill graphs only, not {graph} decoders")
        for variant in variants:
            if not VARIANTS_BY_NAME[variant].exported:
                raise TaperfoldError(f"--engine trt builds no engine for the reference variant {variant!r}")
        for variant in variants:  # the engines are built from these: name a missing one
            manifest.artifact(variant)
        return ensure_engines(manifest, variants)

    def projection_groups(self, manifest: Export, record: ArtifactRecord) -> int | None:
        """Those of the ONNX graph it was built from."""
        if record.built_from is None:
            return None
        graph = manifest.record(record.built_from)
        return artifact_kind(graph.kind).projection_groups(manifest, graph)

    def is_fresh(self, manifest: Export, record: ArtifactRecord, profile: Profile, version: str) -> bool:
        """Whether `record`'s engine can be run as it is: its file is there, built by this TensorRT for `profile`."""
        details = details_of(record, TensorrtDetails)
        return (manifest.directory / record.path).is_file() and (details.tensorrt, details.profile) == (
            version,
            profile,
        )


TENSORRT = TensorrtPlan()
register_kind(TENSORRT)


# ---- engines for bench and verify --------------------------------------------------------------------


def ensure_engines(
    manifest: Export, variants, profile: Profile | None = None, on_stage: Callable[[str], None] = lambda s: None
) -> dict[str, Path]:
    """Paths of the engines of `variants`, building (and recording) those that are missing or stale (another
    TensorRT version or another profile than asked for)."""
    trt = trt_support.require_tensorrt()
    profile = _resolve_profile(manifest, profile)
    variants = [canonical_variant(v) for v in variants]
    stale = []
    for variant in variants:
        record = manifest.find(variant, PREFILL, TENSORRT_PLAN)
        if record is None or not TENSORRT.is_fresh(manifest, record, profile, trt.__version__):
            stale.append(variant)
    if stale:
        manifest.build(TENSORRT_PLAN, TensorrtRequest(tuple(stale), profile), on_stage)
    return {v: manifest.artifact(v, PREFILL, TENSORRT_PLAN) for v in variants}
