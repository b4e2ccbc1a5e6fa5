"""TensorRT engines from an export folder: `model.plan` (folded) and, for the benchmark, `baseline.plan`
and `unfolded.plan`, with one optimization profile for `input_ids` [batch, sequence].

Works with TensorRT 10.x and 11.x. TensorRT 11 networks are always strongly typed (its FP16/BF16 builder
flags are gone); on 10.x the network is created with the STRONGLY_TYPED flag so both behave alike: the
ONNX model's dtype (`export --dtype`) decides the precision, as it does in ONNX Runtime. docs/tensorrt.md
lists the API pages and binding sources each call was checked against; this path has not yet run on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from taperfold.errors import TaperfoldError
from taperfold.exportdir import ENGINE_ARTIFACT, FOLDED, INPUT, PLAN_FILES, Manifest, canonical_variant, read_manifest
from taperfold.fsutil import atomic_path
from taperfold.onnx_files import check_onnx_file
from taperfold.opsets import TRT_MIN_VERSION

NOT_INSTALLED = "tensorrt is not installed: pip install 'taperfold[trt]' on a machine with an NVIDIA GPU"
NO_GPU = "no CUDA GPU found: TensorRT engines need an NVIDIA GPU"
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
        return tuple((b, s) for b, s in zip(self.batch, self.sequence))

    def to_dict(self) -> dict:
        return {"input": INPUT, "batch": list(self.batch), "sequence": list(self.sequence)}

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        return cls(batch=d["batch"], sequence=d["sequence"])


def make_profile(max_seq_len: int, batch=None, sequence=None) -> Profile:
    """Defaults: batch 1/1/8, sequence 1/min(128, max_seq_len)/max_seq_len. Flags may pass "1/4/8"."""
    batch = (1, 1, 8) if batch is None else batch
    sequence = (1, min(128, max_seq_len), max_seq_len) if sequence is None else sequence
    profile = Profile(batch=batch, sequence=sequence)
    if profile.sequence[2] > max_seq_len:
        raise TaperfoldError(f"sequence: max {profile.sequence[2]} exceeds the model's max_seq_len {max_seq_len}")
    return profile


# ---- environment -------------------------------------------------------------------------------------


def _gpu() -> dict | None:
    """Name and compute capability of CUDA device 0, or None. torch's view is the one that counts:
    TrtRunner's buffers are torch CUDA tensors, so the TensorRT path needs a CUDA build of torch anyway."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}"}


def _import_tensorrt():
    try:
        import tensorrt
    except (ImportError, OSError):  # OSError: wheel present, its CUDA libraries not
        raise TaperfoldError(NOT_INSTALLED) from None
    return tensorrt


def require_tensorrt():
    """The `tensorrt` module, or a one-line TaperfoldError saying what is missing and how to get it."""
    trt = _import_tensorrt()
    if _gpu() is None:
        raise TaperfoldError(NO_GPU)
    return trt


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
    onnx_path, plan_path, profile: Profile, timing_cache=None, on_stage: Callable[[str], None] = lambda s: None
) -> dict:
    """Parse `onnx_path` (its external data is found beside it), build, write `plan_path` atomically.
    Returns the engine's metadata for the manifest."""
    trt = require_tensorrt()
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    timing_cache = Path(timing_cache) if timing_cache is not None else None
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
    with atomic_path(plan_path) as tmp:
        tmp.write_bytes(plan)
    if timing_cache is not None:
        with atomic_path(timing_cache) as tmp:
            tmp.write_bytes(cache.serialize())
    return {
        "path": plan_path.name,
        "onnx": onnx_path.name,
        "bytes": plan_path.stat().st_size,
        "tensorrt": trt.__version__,
        **_gpu(),
        "strongly_typed": True,
        "profile": profile.to_dict(),
        "build_seconds": round(seconds, 3),
        "timing_cache": timing_cache.name if timing_cache is not None else None,
    }


def _resolve_profile(manifest: Manifest, profile: Profile | None) -> Profile:
    """The given profile, else the one earlier engines in this folder used (so that every variant the
    benchmark compares was built for the same shapes), else the defaults."""
    max_seq_len = manifest.data["config"]["max_seq_len"]
    if profile is None:
        earlier = [e["profile"] for e in manifest.engines.values()]
        profile = Profile.from_dict(earlier[0]) if earlier else make_profile(max_seq_len)
    if profile.sequence[2] > max_seq_len:
        raise TaperfoldError(f"sequence: max {profile.sequence[2]} exceeds the model's max_seq_len {max_seq_len}")
    return profile


def build_engine_for_export(
    out_dir, variants=(FOLDED,), profile: Profile | None = None, on_stage: Callable[[str], None] = lambda s: None
) -> dict:
    """Build the engines of `variants` from an export folder, record them in manifest.json and return its data.

    `manifest["engines"][variant]` holds each engine's metadata; `manifest["artifacts"]["engine"]` points at
    model.plan (the folded model), as the other artifacts point at their ONNX files. One timing cache file
    (`trt.timing-cache`) is shared by all builds in the folder.
    """
    require_tensorrt()
    manifest = read_manifest(out_dir)
    return _build_engines(manifest, variants, _resolve_profile(manifest, profile), on_stage)


def _build_engines(manifest: Manifest, variants, profile: Profile, on_stage: Callable[[str], None]) -> dict:
    """build_engine_for_export's work, on a manifest already read and a profile already resolved."""
    out_dir = manifest.directory
    engines = dict(manifest.engines)
    for variant in variants:
        if variant not in PLAN_FILES or not manifest.has_artifact(variant):
            known = ", ".join(v for v in PLAN_FILES if manifest.has_artifact(v))
            raise TaperfoldError(
                f"{manifest.path}: no ONNX model for variant {variant!r} (engines can be built for: {known})"
            )
        engines[variant] = build_engine(
            manifest.artifact(variant),
            out_dir / PLAN_FILES[variant],
            profile,
            timing_cache=out_dir / TIMING_CACHE,
            on_stage=on_stage,
        )
        engines[variant]["dtype"] = manifest.dtype
    manifest.data["engines"] = engines
    if FOLDED in engines:
        manifest.artifacts[ENGINE_ARTIFACT] = {
            "path": engines[FOLDED]["path"],
            "bytes": engines[FOLDED]["bytes"],
            "external_data": None,
            "external_data_bytes": 0,
            "variant": FOLDED,
            "format": "tensorrt-plan",
        }
    manifest.write()
    return manifest.data


# ---- engines for bench and verify --------------------------------------------------------------------


def ensure_engines(
    out_dir, variants, profile: Profile | None = None, on_stage: Callable[[str], None] = lambda s: None
) -> dict[str, Path]:
    """Paths of the engines of `variants`, building those that are missing or stale (another TensorRT
    version or another profile than asked for)."""
    trt = require_tensorrt()
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    profile = _resolve_profile(manifest, profile)
    engines = manifest.engines
    variants = [canonical_variant(v) for v in variants]

    def fresh(v):
        e = engines.get(v)
        return (
            e is not None
            and (out_dir / e["path"]).is_file()
            and e["tensorrt"] == trt.__version__
            and e["profile"] == profile.to_dict()
        )

    stale = [v for v in variants if not fresh(v)]
    if stale:
        _build_engines(manifest, stale, profile, on_stage)
    return {v: out_dir / PLAN_FILES[v] for v in variants}
