"""Graph passes that fold g = 0 TaperNorm / TaperLN layers into the linear layers around them.

    FoldConstantsPass -> ObserveNormsPass -> FoldIntoReadersPass -> FoldIntoEmbeddingPass
    -> FoldIntoProducerPass [-> MergeNormWeightsPass] [-> FuseProjectionsPass] -> CleanupPass

Forwards first (into the layers that read a norm, else the embedding table it normalizes), then backwards
(a post-norm into the layer that produces its input). FuseProjectionsPass is no fold: it concatenates the
linear layers that read one tensor (q/k/v, gate/up) into one, after the folds so that they see each layer, and
before the cleanup, whose checker then holds it too. That is the fold's part of a graph's pipeline
(passes/pipeline.py: the one order of every pass taperfold runs on a graph, export's too).

Each pass finds its own work with `detect_norms` (a pure analysis) and records what it did in an
optional `FoldReport`, which only observes. `fold_model` composes them; nothing else is needed to run one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from taperfold.fsutil import write_json_atomic
from taperfold.onnx_io import load_model, save_model
from taperfold.passes.cleanup import CleanupPass
from taperfold.passes.constants import FoldConstantsPass
from taperfold.passes.detect import NormAnalysis, detect_norms
from taperfold.passes.fold_embedding import FoldIntoEmbeddingPass
from taperfold.passes.fold_producer import FoldIntoProducerPass
from taperfold.passes.fold_readers import FoldIntoReadersPass
from taperfold.passes.fuse_projections import FuseProjectionsPass
from taperfold.passes.merge_norm_weights import MergeNormWeightsPass
from taperfold.passes.pipeline import Pipeline, Step
from taperfold.passes.report import FoldReport, NormEntry, NormStatus, ObserveNormsPass, ProjectionReport

__all__ = [
    "CleanupPass",
    "FoldConstantsPass",
    "FoldIntoEmbeddingPass",
    "FoldIntoProducerPass",
    "FoldIntoReadersPass",
    "FoldReport",
    "FuseProjectionsPass",
    "MergeNormWeightsPass",
    "NormAnalysis",
    "NormEntry",
    "NormStatus",
    "ObserveNormsPass",
    "Pipeline",
    "ProjectionReport",
    "Step",
    "detect_norms",
    "fold_model",
    "fold_onnx_file",
    "load_model",
    "save_model",
]


def fold_model(model: ir.Model, merge_norm_weights: bool = False, fuse_projections: bool = False) -> FoldReport:
    """Fold every g = 0 norm of `model` in place; the report says what was folded, kept, and why.

    Real norms are never folded. With `merge_norm_weights`, their gains move into the layers that read
    them (reported as "weights_merged"); the norms themselves stay. With `fuse_projections`, the linear layers
    that read one tensor then become one (`report.projections` says which).
    """
    pipeline = Pipeline(model, fold=True, merge_norm_weights=merge_norm_weights, fuse_projections=fuse_projections)
    pipeline.run()
    assert pipeline.fold is not None  # made with the fold
    pipeline.fold.projections = pipeline.projections
    return pipeline.fold


def fold_onnx_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    report_path: str | os.PathLike | None = None,
    merge_norm_weights: bool = False,
    fuse_projections: bool = False,
    before_commit: Callable[[Path], None] | None = None,
) -> FoldReport:
    """Fold the model at `src` into `dst` (weights in `dst`.data), optionally writing the report as JSON.

    When no pass changed any weight, `dst` is the model exactly as loaded (not the constant-folded graph),
    so its outputs are bit-identical to the input's. `before_commit` (fold --verify's check) is given the written
    model under its temporary name: what it raises leaves neither `dst`, its data nor the report.
    """
    model = load_model(src)
    report = fold_model(model, merge_norm_weights=merge_norm_weights, fuse_projections=fuse_projections)
    if not report.changed_weights:
        model = load_model(src)
        report.nodes_after = len(model.graph)
    save_model(model, dst, before_commit)
    report.source, report.output = str(src), str(dst)
    if report_path is not None:
        write_json_atomic(report_path, report.to_json())
    return report
