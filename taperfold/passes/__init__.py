"""Graph passes that fold g = 0 TaperNorm / TaperLN layers into the linear layers around them.

    detect (DetectTaperNormsPass) -> fold into readers (FoldScaleIntoConsumersPass)
    -> fold into embedding tables (FoldScaleIntoEmbeddingPass) -> cleanup (CleanupPass)
"""

from __future__ import annotations

import os

import onnx_ir as ir

from taperfold.fsutil import write_json_atomic
from taperfold.passes.cleanup import CleanupPass, check
from taperfold.passes.detect import DetectTaperNormsPass
from taperfold.passes.fold import FoldScaleIntoConsumersPass
from taperfold.passes.fold_embedding import FoldScaleIntoEmbeddingPass
from taperfold.passes.io import load_model, save_model
from taperfold.passes.report import FoldReport, NormEntry

__all__ = [
    "CleanupPass",
    "DetectTaperNormsPass",
    "FoldReport",
    "FoldScaleIntoConsumersPass",
    "FoldScaleIntoEmbeddingPass",
    "NormEntry",
    "fold_model",
    "fold_onnx_file",
    "load_model",
    "save_model",
]


def fold_model(model: ir.Model) -> FoldReport:
    """Fold every g = 0 norm of `model` in place; the report says what was folded, kept, and why."""
    report = FoldReport(nodes_before=len(model.graph), check_input=check(model))
    ir.passes.PassManager(
        [
            DetectTaperNormsPass(report),
            FoldScaleIntoConsumersPass(report),
            FoldScaleIntoEmbeddingPass(report),
            CleanupPass(report),
        ]
    )(model)
    return report


def fold_onnx_file(
    src: str | os.PathLike, dst: str | os.PathLike, report_path: str | os.PathLike | None = None
) -> FoldReport:
    """Fold the model at `src` into `dst` (weights in `dst`.data), optionally writing the report as JSON."""
    model = load_model(src)
    report = fold_model(model)
    save_model(model, dst)
    report.source, report.output = str(src), str(dst)
    if report_path is not None:
        write_json_atomic(report_path, report.to_dict())
    return report
