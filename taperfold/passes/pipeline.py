"""A graph's pipeline: the passes taperfold runs on one graph, in the one order every graph runs them (`Step`).

    StampLayersPass -> RestoreNormsPass
    -> FoldConstantsPass -> ObserveNormsPass -> FoldIntoReadersPass -> FoldIntoEmbeddingPass -> FoldIntoProducerPass
    -> MergeNormWeightsPass -> FuseProjectionsPass -> CleanupPass
    -> FuseRMSNormPass -> OrtFusionsPass -> ExpandRMSNormalizationPass

A graph runs the steps its options ask for (`Pipeline`), each an onnx-ir pass, through onnx-ir's PassManager.
`fold_model` (taperfold fold) runs the fold, the merge and the fused projections; `taperfold export` builds each
graph's from its options (export.graph_pipeline): the stamp on a trace of a model's first layers, the norms restored
for a baseline made from the unfolded trace, the fold for the folded graph, then on every graph the fused projections,
the fused norms, ONNX Runtime's fusions, and for the baseline the norms expanded back for its decomposed copy.

Why this order: the stamp makes the whole model's graph, which every later step works on; a baseline's norms are
restored in the unfolded trace as traced (their constant maps are what the fold would take); the folds go forwards
first (into the layers that read a norm, else its embedding table), then backwards (into the layer that produces a
post-norm's input); the projections fuse after the folds, so that they see each layer's final weight; the cleanup then
sorts the graph and holds everything written in standard ops to onnx.checker (the fused projections too); the fused
norms (below opset 23 ONNX Runtime's SimplifiedLayerNormalization, which onnx.checker does not know) and ONNX Runtime's
fusions (contrib ops) come after it; a baseline's decomposed copy at opset 23 is its fused graph expanded, last.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import onnx_ir as ir

from taperfold.passes.cleanup import CleanupPass, check
from taperfold.passes.constants import FoldConstantsPass
from taperfold.passes.fold_embedding import FoldIntoEmbeddingPass
from taperfold.passes.fold_producer import FoldIntoProducerPass
from taperfold.passes.fold_readers import FoldIntoReadersPass
from taperfold.passes.fuse_norm import ExpandRMSNormalizationPass, FuseRMSNormPass
from taperfold.passes.fuse_projections import FuseProjectionsPass
from taperfold.passes.merge_norm_weights import MergeNormWeightsPass
from taperfold.passes.report import FoldReport, ObserveNormsPass, ProjectionReport
from taperfold.passes.restore_norms import RealNorm, RestoreNormsPass
from taperfold.passes.stamp_layers import LayerWeights, StampLayersPass

if TYPE_CHECKING:
    from taperfold.passes.ort_fusions import OrtFusionsPass

P = TypeVar("P", bound=ir.passes.PassBase)


class Step(enum.IntEnum):
    """The steps of a graph's pipeline, in the order they run."""

    STAMP_LAYERS = enum.auto()
    RESTORE_NORMS = enum.auto()
    FOLD_CONSTANTS = enum.auto()
    OBSERVE_NORMS = enum.auto()
    FOLD_INTO_READERS = enum.auto()
    FOLD_INTO_EMBEDDING = enum.auto()
    FOLD_INTO_PRODUCER = enum.auto()
    MERGE_NORM_WEIGHTS = enum.auto()
    FUSE_PROJECTIONS = enum.auto()
    CLEANUP = enum.auto()
    FUSE_NORMS = enum.auto()
    ORT_FUSIONS = enum.auto()
    EXPAND_NORMS = enum.auto()

    @property
    def stage(self) -> str:
        """The stage of an export's timings it counts in: the stamping (the trace's other half) and onnxscript's
        rewriter apart from taperfold's own passes."""
        return {Step.STAMP_LAYERS: "stamp_layers_s", Step.ORT_FUSIONS: "ort_fusions_s"}.get(self, "passes_s")


class Pipeline:
    """The steps one graph (`model`) runs, in `Step` order, and what they report: `fold` (the fold's report, with
    `fold`), `projections` (FuseProjectionsPass's, with `fuse_projections`).

    `stamp_layers`: the whole model from this trace of its first layers; `restore_norms`: these norms restored (the
    baseline made from the unfolded graph); `fold`: the fold, ending with the cleanup, which holds the model to
    onnx.checker's verdict on it now (`merge_norm_weights`: real norms' gains moved into their readers too);
    `fuse_projections`, `fuse_norms` (decomposed RMSNorms as one op), `ort_fusions` (ONNX Runtime's), `expand_norms`
    (each RMSNormalization as the decomposed ops)."""

    def __init__(
        self,
        model: ir.Model,
        *,
        stamp_layers: LayerWeights | None = None,
        restore_norms: dict[str, RealNorm] | None = None,
        fold: bool = False,
        merge_norm_weights: bool = False,
        fuse_projections: bool = False,
        fuse_norms: bool = False,
        ort_fusions: bool = False,
        expand_norms: bool = False,
    ):
        self.model = model
        self.fold = FoldReport(nodes_before=len(model.graph), check_input=check(model)) if fold else None
        self.projections = ProjectionReport() if fuse_projections else None
        steps: dict[Step, ir.passes.PassBase] = {}
        if stamp_layers is not None:
            steps[Step.STAMP_LAYERS] = StampLayersPass(stamp_layers)
        if restore_norms is not None:
            steps[Step.RESTORE_NORMS] = RestoreNormsPass(restore_norms)
        if self.fold is not None:
            steps[Step.FOLD_CONSTANTS] = FoldConstantsPass(self.fold)
            steps[Step.OBSERVE_NORMS] = ObserveNormsPass(self.fold)
            steps[Step.FOLD_INTO_READERS] = FoldIntoReadersPass(self.fold)
            steps[Step.FOLD_INTO_EMBEDDING] = FoldIntoEmbeddingPass(self.fold)
            steps[Step.FOLD_INTO_PRODUCER] = FoldIntoProducerPass(self.fold)
            if merge_norm_weights:
                steps[Step.MERGE_NORM_WEIGHTS] = MergeNormWeightsPass(self.fold)
            steps[Step.CLEANUP] = CleanupPass(self.fold, input_check=self.fold.check_input)
        if self.projections is not None:
            steps[Step.FUSE_PROJECTIONS] = FuseProjectionsPass(self.projections)
        if fuse_norms:
            steps[Step.FUSE_NORMS] = FuseRMSNormPass()
        if ort_fusions:
            from taperfold.passes.ort_fusions import OrtFusionsPass  # onnxscript's rewriter, loaded where it runs

            steps[Step.ORT_FUSIONS] = OrtFusionsPass()
        if expand_norms:
            steps[Step.EXPAND_NORMS] = ExpandRMSNormalizationPass()
        self.steps = dict(sorted(steps.items()))
        self._ran: set[Step] = set()

    def run(
        self, until: Step | None = None, clock: Callable[[str], contextlib.AbstractContextManager] | None = None
    ) -> None:
        """Run the steps not run yet, up to `until` (every one by default); the steps of one `Step.stage` in a row go
        through one PassManager, timed by `clock(stage)` where given."""
        todo = [step for step in self.steps if step not in self._ran and (until is None or step <= until)]
        for stage, steps in itertools.groupby(todo, key=lambda step: step.stage):
            passes = [self.steps[step] for step in steps]
            with clock(stage) if clock is not None else contextlib.nullcontext():
                ir.passes.PassManager(passes)(self.model)
        self._ran.update(todo)

    def get(self, kind: type[P]) -> P | None:
        """The pipeline's pass of that class, None where it has none."""
        return next((found for found in self.steps.values() if isinstance(found, kind)), None)

    def __getitem__(self, kind: type[P]) -> P:
        """The pipeline's pass of that class (KeyError where it has none)."""
        if (found := self.get(kind)) is None:
            raise KeyError(kind.__name__)
        return found

    @property
    def norms_fused(self) -> int:
        """The decomposed RMSNorms FuseRMSNormPass fused."""
        fuse = self.get(FuseRMSNormPass)
        return fuse.fused if fuse else 0

    @property
    def ort_fused(self) -> dict[str, int] | None:
        """The contrib ops ONNX Runtime's fusions made, by type; None: not asked for."""
        fusions = self._ort_fusions()
        return dict(fusions.fused) if fusions else None

    @property
    def ort_fusions_skipped(self) -> str | None:
        """Why ONNX Runtime's fusions left the graph as traced, where they chose to."""
        fusions = self._ort_fusions()
        return fusions.skipped if fusions else None

    def _ort_fusions(self) -> OrtFusionsPass | None:
        if Step.ORT_FUSIONS not in self.steps:  # its module is not loaded unless it runs
            return None
        from taperfold.passes.ort_fusions import OrtFusionsPass

        return self.get(OrtFusionsPass)
