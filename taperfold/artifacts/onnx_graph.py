"""The ONNX graphs of an export: one per variant and graph (prefill, growing and static decoders), written by
`taperfold export` (taperfold.export) and run by ONNX Runtime; TensorRT engines are built from them."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from taperfold.artifacts import ONNX, register_kind
from taperfold.artifacts.base import LOGITS, TORCH, ArtifactKind, ArtifactRecord, Export, Field, describe_file
from taperfold.errors import TaperfoldError
from taperfold.exportdir import Graph, graph_key, onnx_file


class OnnxGraph(ArtifactKind):
    name = ONNX
    title = "ONNX graph"
    built_from = TORCH
    verified = LOGITS
    fields = MappingProxyType(
        {
            "opset": Field((int,), help="the graph's default-domain opset"),
            "opset_source": Field((str,), help="table (taperfold.opsets) or override (--opset)"),
            "opset_reason": Field((str, type(None)), help="why the table chose it"),
            "norm_ops": Field((dict,), help="fused norm ops the graph runs, by op type"),
            "norms_fused_by_taperfold": Field((int,), help="decomposed RMSNorms fused into one op by export"),
            "projections": Field((dict, type(None)), help="FuseProjectionsPass's report; null when not asked for"),
        }
    )

    def write(
        self, model_ir, folder: Path, variant: str, graph: Graph, precision: str, details: dict
    ) -> ArtifactRecord:
        """Save `model_ir` as `variant`'s `graph` (its weights in FILE.data beside it) into `folder`, which export
        replaces whole once everything is written; the record of it."""
        import onnx_ir as ir

        name = onnx_file(variant, graph)
        ir.save(model_ir, folder / name, external_data=name + ".data")
        size, data, data_size = describe_file(folder, name)
        return ArtifactRecord(
            key=graph_key(variant, graph),
            kind=self.name,
            path=name,
            variant=variant,
            graph=graph,
            precision=precision,
            bytes=size,
            external_data=data,
            external_data_bytes=data_size,
            details=details,
        )

    def projection_groups(self, manifest: Export, record: ArtifactRecord) -> int:
        """The groups export fused (`projections.summary.groups`; 0 where it fused none)."""
        projections = record.details.get("projections")
        if not projections:
            return 0
        summary = projections.get("summary") if isinstance(projections, dict) else None
        groups = summary.get("groups") if isinstance(summary, dict) else None
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 0:
            raise TaperfoldError(
                f"{manifest.path}: key 'artifacts.{record.key}.projections.summary.groups' must be a count, "
                f"got {groups!r}"
            )
        return groups


ONNX_GRAPH = OnnxGraph()
register_kind(ONNX_GRAPH)
