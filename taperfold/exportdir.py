"""The export directory's contract: what `taperfold export` writes and everything else reads.

    DIR/manifest.json          what was exported, from which checkpoint, with which options (format_version 1)
    DIR/baseline.onnx          ordinary RMSNorm / LayerNorm in its fused form: the benchmark's reference
    DIR/baseline.decomposed.onnx  the same RMSNorm as plain ops (what hand-written norms export to)
    DIR/unfolded.onnx          tapered norms at g = 0 as explicit constant multiplies
    DIR/model.onnx             those constants folded into their readers (the "folded" variant)
    DIR/*.decoder.onnx         KV-cached decoders of each variant, the cache growing every step (`export --kv-cache`)
    DIR/*.static.onnx          KV-cached decoders with a static cache: fixed-size buffers written at a position
                               (`export --kv-cache static`)
    DIR/*.plan                 TensorRT engines (`export --trt`, or built by `bench --engine trt`)
    DIR/*.onnx.data            each graph's weights (external data)

`VARIANT_TABLE` names every variant with its files and meaning; `unfused` (the paper's word) is accepted
wherever a user types `unfolded`. Other modules ask this one for file names, dtypes, decoder tensor names and
artifact paths instead of spelling them out (CLI choices and docs/design.md's variant table come from it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from taperfold.errors import TaperfoldError
from taperfold.fsutil import read_json_object, write_json_atomic

MANIFEST = "manifest.json"
FORMAT = "taperfold-export"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Variant:
    """One row of the variant table: what a variant is, and what its files are called."""

    name: str
    stem: str  # its files: STEM.onnx, STEM.decoder.onnx / STEM.static.onnx (--kv-cache), STEM.plan (TensorRT)
    meaning: str
    default: bool = False  # in the set bench and verify take when none is named
    exported: bool = True  # written by `taperfold export` (else a reference built for timing only)
    aliases: tuple[str, ...] = ()  # other spellings a user may type


BASELINE, UNFOLDED, FOLDED = "baseline", "unfolded", "folded"
DECOMPOSED_BASELINE, NONORM = "baseline-decomposed", "nonorm"

# The variants, in report order. The folded model is the deployable one: model.onnx / model.plan.
VARIANT_TABLE = (
    Variant(
        BASELINE,
        "baseline",
        "the same weights with the model's own untapered norms, in their fused form: "
        "the reference every speedup is measured against",
        default=True,
    ),
    Variant(
        UNFOLDED,
        "unfolded",
        "the tapered model at g = 0: each tapered norm an explicit constant map (the paper's Internal-Taper unfused)",
        default=True,
        aliases=("unfused",),
    ),
    Variant(
        FOLDED, "model", "those constant maps folded into the layers that read them: what you deploy", default=True
    ),
    Variant(
        DECOMPOSED_BASELINE,
        "baseline.decomposed",
        "the baseline with RMSNorm as plain ops, as hand-written "
        "norms export (RMS families; a weaker reference, reported apart)",
    ),
    Variant(
        NONORM,
        "nonorm",
        "the tapered norms deleted, weights unscaled: not the same function, the timing a "
        "fold with zero residue matches",
        exported=False,
    ),
)
VARIANTS_BY_NAME = {v.name: v for v in VARIANT_TABLE}
VARIANTS = tuple(v.name for v in VARIANT_TABLE if v.default)  # the default set of bench and verify
ALL_VARIANTS = tuple(v.name for v in VARIANT_TABLE if v.exported)  # every variant `taperfold export` may write
NAMEABLE_VARIANTS = tuple(VARIANTS_BY_NAME)  # what a user may name
ALIASES = {alias: v.name for v in VARIANT_TABLE for alias in v.aliases}
PLAN_FILES = {v.name: f"{v.stem}.plan" for v in VARIANT_TABLE if v.exported}
ENGINE_ARTIFACT = "engine"  # artifacts.engine: the folded model's TensorRT plan

DTYPES = ("fp32", "fp16", "bf16")
LOGITS = ("last", "all")

INPUT = "input_ids"
OUTPUT = "logits"


def canonical_variant(name: str) -> str:
    """`name` as the report and the manifest spell it; `unfused` is the paper's word for `unfolded`."""
    name = ALIASES.get(name, name)
    if name not in NAMEABLE_VARIANTS:
        choices = ", ".join([*NAMEABLE_VARIANTS, *(f"{a} (= {v})" for a, v in ALIASES.items())])
        raise TaperfoldError(f"unknown variant {name!r}; choose from {choices}")
    return name


def canonical_variants(names: list[str]) -> list[str]:
    """Canonical names of `names`, in order, without repeats; one error listing every unknown name."""
    unknown = [n for n in names if n not in NAMEABLE_VARIANTS and n not in ALIASES]
    if not names or unknown:
        aliases = ", ".join(f"{a} (= {v})" for a, v in ALIASES.items())
        raise TaperfoldError(f"unknown {unknown or names}; choose from {', '.join(NAMEABLE_VARIANTS)}, or {aliases}")
    return list(dict.fromkeys(ALIASES.get(n, n) for n in names))


# The KV caches a decoder may have: growing (past + new every step, the shapes change each step) and static
# (buffers of a fixed length written at a position: every step has the same shapes). Each is a graph of its own,
# named by its suffix. Wherever a graph is named, `decoder` is False (the prefill graph), True (the growing
# decoder, what `--kv-cache` meant before static caches) or one of KV_CACHES.
GROWING, STATIC = "growing", "static"
KV_CACHES = (GROWING, STATIC)
_DECODER_SUFFIX = {GROWING: "decoder", STATIC: "static"}


def cache_of(decoder: bool | str) -> str | None:
    """The KV cache of the graph `decoder` names: None (prefill), GROWING or STATIC."""
    if decoder is False or decoder is None:
        return None
    if decoder is True:
        return GROWING
    if decoder not in KV_CACHES:
        raise ValueError(f"a decoder's cache is one of {KV_CACHES}, got {decoder!r}")
    return decoder


def artifact_key(variant: str, decoder: bool | str = False) -> str:
    """The key of `variant`'s graph in manifest.json's `artifacts`: `folded`, `unfolded.decoder`, `folded.static`..."""
    cache = cache_of(decoder)
    return canonical_variant(variant) + (f".{_DECODER_SUFFIX[cache]}" if cache else "")


def onnx_file(variant: str, decoder: bool | str = False) -> str:
    """`model.onnx`, `unfolded.decoder.onnx`, `model.static.onnx`...: the file name export writes for a variant."""
    cache = cache_of(decoder)
    stem = VARIANTS_BY_NAME[canonical_variant(variant)].stem
    return f"{stem}.{_DECODER_SUFFIX[cache]}.onnx" if cache else f"{stem}.onnx"


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def numpy_dtype(name: str):
    """The numpy type of `name`; bf16 has none (numpy has no bfloat16), so feeding it raises a TaperfoldError."""
    import numpy as np

    if name == "bf16":
        raise TaperfoldError("numpy has no bfloat16: bf16 tensors cannot be fed from the host")
    return {"fp32": np.float32, "fp16": np.float16}[name]


PAST = "past_key_values."  # the prefix of a decoder's cache inputs
# A static decoder's positions of the new tokens (int64 [sequence]), as transformers' StaticCache names them; where
# its keys and values are written in the cache, and how far each query sees
CACHE_POSITION = "cache_position"
# What the torch runner's static decoder also returns: the greedy token of the last position, [batch, 1] int64,
# computed on the device (fed back as the next step's input_ids without a trip to the host)
NEXT_TOKEN = "next_token"


def decoder_io_names(n_layers: int, decoder: bool | str = True) -> tuple[list[str], list[str]]:
    """Input and output names of a KV-cached decoder, as optimum and onnxruntime-genai name them: `input_ids`,
    (`cache_position` for a static cache), `past_key_values.{i}.key|value` → `logits`, `present.{i}.key|value`. A
    static cache's present is its past, written at the positions: onnxruntime-genai's past_present_share_buffer
    binds the two to one buffer (shape [batch, kv_heads, cache length, head_dim])."""
    past = [f"{PAST}{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    positions = [CACHE_POSITION] if cache_of(decoder) == STATIC else []
    return [INPUT, *positions, *past], [OUTPUT, *present]


def shared_cache_buffers(n_layers: int) -> dict[str, str]:
    """A static decoder's outputs that may share their input's buffer: present name -> past name."""
    inputs, outputs = decoder_io_names(n_layers, STATIC)
    return dict(zip(outputs[1:], inputs[2:]))


# ---- manifest.json -----------------------------------------------------------------------------------


# Keys every format_version 1 manifest has (dotted paths); others are optional.
_REQUIRED = (
    "checkpoint.path",
    "checkpoint.sha256",
    "config",
    "gate",
    "forced_gate0",
    "export.logits",
    "export.dtype",
    "artifacts",
)
_FOLDED_ARTIFACTS = ("artifacts.unfolded.path", "artifacts.folded.path")
_BASELINE_ONLY = ("artifacts.baseline.path",)  # the export of a plain (untapered) model: nothing to fold


@dataclass
class Manifest:
    """manifest.json of one export directory. `data` is the JSON object itself (kept whole, so keys this
    class does not model survive a rewrite); the fields are the parts other modules read."""

    directory: Path
    data: dict
    checkpoint: Path = field(init=False)
    checkpoint_sha256: str = field(init=False)
    gate: float = field(init=False)
    forced_gate0: bool = field(init=False)
    logits: str = field(init=False)
    dtype: str = field(init=False)

    def __post_init__(self):
        self.checkpoint = Path(self.data["checkpoint"]["path"])
        self.checkpoint_sha256 = str(self.data["checkpoint"]["sha256"])
        self.gate = self.data["gate"]
        self.forced_gate0 = bool(self.data["forced_gate0"])
        self.logits = self.data["export"]["logits"]
        self.dtype = self.data["export"]["dtype"]

    @property
    def path(self) -> Path:
        return self.directory / MANIFEST

    @property
    def artifacts(self) -> dict:
        return self.data["artifacts"]

    @property
    def engines(self) -> dict:
        """TensorRT engines built in this directory: variant -> build metadata (path, profile, tensorrt...)."""
        return self.data.get("engines") or {}

    def config(self):
        """The exported model's shape, read by the kind of source that wrote it (taperfold.sources)."""
        from taperfold.sources import config_from_dict

        try:
            return config_from_dict(self.data["config"])
        except (TypeError, ValueError) as e:
            raise TaperfoldError(f"{self.path}: key 'config': {e}") from None

    def has_artifact(self, variant: str, decoder: bool | str = False) -> bool:
        return artifact_key(variant, decoder) in self.artifacts

    @property
    def max_cache(self) -> int | None:
        """The cache length of the static decoders (None: the export has none)."""
        return self.data["export"].get("max_cache")

    @property
    def fused_projections(self) -> bool:
        """Whether export fused each group of sibling projections (q/k/v, gate/up) into one MatMul and a Split."""
        return bool(self.data["export"].get("fuse_projections"))

    def artifact(self, variant: str, decoder: bool | str = False) -> Path:
        """Path of `variant`'s graph (its growing-cache decoder with `decoder=True`, its static one with
        `decoder="static"`); a one-line error naming manifest.json and the key when the manifest does not list it,
        or the file it lists is gone."""
        key = artifact_key(variant, decoder)
        cache = cache_of(decoder)
        hint = None if cache is None else "re-export with --kv-cache" + (" static" if cache == STATIC else "")
        return self._file(key, hint)

    def engine_plan(self, variant: str = FOLDED) -> Path:
        """Path of the TensorRT engine built for `variant`."""
        entry = self.engines.get(canonical_variant(variant))
        path = self.directory / entry["path"] if isinstance(entry, dict) and "path" in entry else None
        if path is None or not path.is_file():
            raise TaperfoldError(
                f"{self.directory}: no TensorRT engine for {variant!r}; build it with "
                f"`taperfold export CKPT --trt -o {self.directory}` (bench builds the others on "
                "demand)"
            )
        return path

    def _file(self, key: str, hint: str | None) -> Path:
        entry = self.artifacts.get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise TaperfoldError(f"{self.path}: missing key 'artifacts.{key}.path'" + (f": {hint}" if hint else ""))
        path = self.directory / entry["path"]
        if not path.is_file():
            raise TaperfoldError(f"{path}: missing ({MANIFEST} lists it as artifacts.{key})")
        return path

    def write(self) -> None:
        write_json_atomic(self.path, self.data)


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
    artifacts = data.get("artifacts")
    baseline_only = isinstance(artifacts, dict) and not {UNFOLDED, FOLDED} & set(artifacts)
    for key in (*_REQUIRED, *(_BASELINE_ONLY if baseline_only else _FOLDED_ARTIFACTS)):
        node = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise TaperfoldError(f"{path}: missing key '{key}'")
            node = node[part]
    logits, dtype = data["export"]["logits"], data["export"]["dtype"]
    if logits not in LOGITS:
        raise TaperfoldError(f"{path}: key 'export.logits' must be 'last' or 'all', got {logits!r}")
    if dtype not in DTYPES:
        raise TaperfoldError(f"{path}: key 'export.dtype' must be fp32, fp16 or bf16, got {dtype!r}")
    return Manifest(export_dir, data)


def describe_artifacts(folder: Path) -> dict:
    """The `artifacts` entry of a manifest: every ONNX graph in `folder`, keyed by variant."""
    out = {}
    for variant in ALL_VARIANTS:
        for decoder in (False, *KV_CACHES):
            path = folder / onnx_file(variant, decoder)
            if not path.is_file():
                continue
            data = path.with_name(path.name + ".data")
            out[artifact_key(variant, decoder)] = {
                "path": path.name,
                "bytes": path.stat().st_size,
                "external_data": data.name if data.exists() else None,
                "external_data_bytes": data.stat().st_size if data.exists() else 0,
            }
    return out


def new_manifest(
    *,
    checkpoint: dict,
    config: dict,
    gate: float,
    forced_gate0: bool,
    export: dict,
    versions: dict,
    artifacts: dict,
    fold_report: dict | None,
    decoder_fold_report: dict | None,
    static_fold_report: dict | None,
    timings: dict,
) -> dict:
    """A format_version 1 manifest object (docs/design.md lists its keys)."""
    return {
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
        "artifacts": artifacts,
        "fold_report": fold_report,
        "decoder_fold_report": decoder_fold_report,
        "static_fold_report": static_fold_report,
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }
