"""The manifest of a new export (taperfold.manifest): what `taperfold export` records of its source, of the options
it ran with and of the graphs it wrote, in the order the variant table and GRAPHS give them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from taperfold.artifacts.base import ArtifactRecord
from taperfold.environment import package_versions
from taperfold.exportdir import FOLDED, GRAPHS, INPUT, OUTPUT, PREFILL, STATIC, VARIANT_TABLE
from taperfold.manifest import Manifest, StageTimings, new_manifest
from taperfold.sources import ModelSource, checkpoint_digest
from taperfold.tracing import ExportOptions, static_cache_length

NOTHING_TO_FOLD = "nothing to fold: {path} has no tapered norms (a plain model); wrote the baseline only"


def export_manifest(
    source: ModelSource,
    ckpt_path: Path,
    opts: ExportOptions,
    folder: Path,
    records: list[ArtifactRecord],
    seconds: Mapping[str, float],
) -> Manifest:
    """The manifest of `source` exported into `folder` with `opts`: the graphs' `records`, `seconds` per stage
    (export's StageClock); not written yet."""
    manifest = new_manifest(
        folder,
        checkpoint={"path": str(ckpt_path.resolve()), "sha256": checkpoint_digest(ckpt_path), "step": source.step},
        config=source.config.to_dict(),
        gate=source.gate,
        forced_gate0=source.tapered and source.gate != 0.0,
        export={
            "logits": opts.logits,
            "dtype": opts.dtype,
            "target": opts.target,
            "opset": opts.opset,  # the --opset override, or None: per graph from the table (see artifacts)
            "kv_cache": list(opts.decoders),
            "max_cache": static_cache_length(source.config, opts) if STATIC in opts.decoders else None,
            "fuse_projections": opts.fuse_projections,
            "inputs": [INPUT],
            "outputs": [OUTPUT],
            **({} if opts.onnx else {"onnx": False}),  # --no-onnx: no graph, the folders alone
        },
        versions=package_versions(),
        timings=StageTimings.from_clock(seconds),
        source=source.manifest_source(),
        note=None if source.tapered else NOTHING_TO_FOLD.format(path=ckpt_path),
    )
    for record in sorted(records, key=_artifact_order):
        manifest.add_artifact(record)
    return manifest


def _artifact_order(record: ArtifactRecord) -> tuple[int, int]:
    """Graphs in the manifest in the variant table's order, each variant's in GRAPHS order."""
    variants = [v.name for v in VARIANT_TABLE]
    return variants.index(record.variant or FOLDED), GRAPHS.index(record.graph or PREFILL)
