"""The ONNX graphs of an export: one per variant and graph (prefill, growing and static decoders), written by
`taperfold export` (taperfold.export) and run by ONNX Runtime; TensorRT engines are built from them.

Their weight-quantized forms (int4, int8: taperfold.quantize) are graphs of this kind too, built from the export's
own (`export --quantize`, or `read_manifest(dir).build("onnx", OnnxRequest(precisions=("int4",)))`):
`model.int4.onnx`, keyed `folded.int4`, `built_from` the graph they quantize. Engines run them as they run the others,
by precision.

The kind owns --quantize and --block-size, which the genai and OpenVINO kinds read too (for their own quantized
folders): declared here once, parsed once (`QUANTIZE.parse`: the precisions), read by every kind's `request`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taperfold.artifacts import ONNX, register_kind
from taperfold.artifacts.base import (
    LOGITS,
    TORCH,
    ArtifactKind,
    ArtifactRecord,
    Export,
    ExportRequest,
    Option,
    describe_file,
    details_of,
)
from taperfold.errors import TaperfoldError
from taperfold.exportdir import VARIANTS, Graph, canonical_variant, graph_key, onnx_file
from taperfold.jsonfields import Fields, is_count
from taperfold.quantize import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, Quantization, parse_precisions

QUANTIZED_FROM = "fp32"  # the dtype quantized graphs are made from (MatMulNBits takes fp32 activations on the CPU)

QUANTIZE = Option(
    "--quantize",
    metavar="int4|int8",
    parse=parse_precisions,  # -> ("int4", "int8"): every kind reads the precisions, none parses the text again
    default=(),
    help="Also write weight-quantized forms of every graph (MatMulNBits by ONNX Runtime's quantizer: model.int4.onnx, "
    "...) and, with --genai or --openvino, of each folder; int4, int8 or int4,int8 (docs/deployment.md).",
)
BLOCK_SIZE = Option(
    "--block-size",
    type=int,
    default=DEFAULT_BLOCK_SIZE,
    show_default=True,
    help=f"--quantize: weights per scale, along the input axis ({', '.join(map(str, BLOCK_SIZES))}); --openvino's "
    "int4 groups are NNCF's 128 unless this is given.",
)


@dataclass(frozen=True)
class OnnxDetails:
    """An ONNX graph's own keys in the manifest: how export made it. None where the graph did not get the key (an
    older export's, an option not given); written back as read, None left out, except `projections`, whose null says
    the option was not asked for (an older entry without the key gains that null: the same meaning)."""

    opset: int | None = None  # the graph's default-domain opset
    opset_source: str | None = None  # table (taperfold.opsets) or override (--opset)
    opset_reason: str | None = None  # why the table chose it
    norm_ops: dict[str, int] | None = None  # fused norm ops the graph runs, by op type
    norms_fused_by_taperfold: int | None = None  # decomposed RMSNorms fused into one op by export
    projections: dict | None = None  # FuseProjectionsPass's report (taperfold.passes.report); None: not asked for
    ort_fusions: dict[str, int] | None = None  # ONNX Runtime's contrib ops --ort-fusions made, by type; None: not run
    ort_fusions_skipped: str | None = None  # why --ort-fusions left the graph as traced (a cropped cache)
    eager_attention: str | None = None  # why it was traced with the model's eager attention (MatMul, Softmax)
    traced_layers: int | None = None  # layers traced, the others stamped out from them (None: every layer traced)

    @classmethod
    def from_json(cls, entry: Fields) -> OnnxDetails:
        def counts(v: Any) -> bool:
            return isinstance(v, dict) and all(is_count(n) for n in v.values())

        return cls(
            opset=entry.optional_count("opset"),
            opset_source=entry.optional_text("opset_source"),
            opset_reason=entry.optional_text("opset_reason"),
            norm_ops=entry.value("norm_ops", counts, "an object of op counts", None),
            norms_fused_by_taperfold=entry.optional_count("norms_fused_by_taperfold"),
            projections=entry.value(
                "projections", lambda v: v is None or isinstance(v, dict), "null or an object", None
            ),
            ort_fusions=entry.value(
                "ort_fusions", lambda v: v is None or counts(v), "null or an object of op counts", None
            ),
            ort_fusions_skipped=entry.optional_text("ort_fusions_skipped"),
            eager_attention=entry.optional_text("eager_attention"),
            traced_layers=entry.optional_count("traced_layers"),
        )

    def to_json(self) -> dict[str, Any]:
        keys = {
            "opset": self.opset,
            "opset_source": self.opset_source,
            "opset_reason": self.opset_reason,
            "norm_ops": self.norm_ops,
            "norms_fused_by_taperfold": self.norms_fused_by_taperfold,
            "projections": self.projections,
            "ort_fusions": self.ort_fusions,
            "ort_fusions_skipped": self.ort_fusions_skipped,
            "eager_attention": self.eager_attention,
            "traced_layers": self.traced_layers,
        }
        return {k: v for k, v in keys.items() if v is not None or k == "projections"}


@dataclass(frozen=True)
class OnnxRequest:
    """Weight-quantized forms of the export's graphs: each of `precisions` (int4, int8) with `block_size` weights
    per scale (taperfold.quantize), of `variants` (None: baseline, unfolded, folded) and `graphs` (None: every one
    each has). Refused in one line when made with a precision or a block size the quantizer does not take."""

    precisions: tuple[str, ...]
    block_size: int = DEFAULT_BLOCK_SIZE
    variants: tuple[str, ...] | None = None
    graphs: tuple[Graph, ...] | None = None

    def __post_init__(self) -> None:
        _ = self.quantizations  # each precision and the block size checked

    @property
    def quantizations(self) -> list[Quantization]:
        return [Quantization(p, self.block_size) for p in self.precisions]


class OnnxGraph(ArtifactKind):
    name = ONNX
    title = "ONNX graph"
    built_from = TORCH
    verified = LOGITS
    options = (QUANTIZE, BLOCK_SIZE)
    request_type = OnnxRequest
    details_type = OnnxDetails

    def write(
        self, model_ir, folder: Path, variant: str, graph: Graph, precision: str, details: OnnxDetails
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

    def request(self, values: Mapping[str, Any], export: ExportRequest) -> OnnxRequest | None:
        """--quantize's precisions with --block-size; --block-size alone is refused (it sets --quantize's blocks).
        None under --no-onnx: there is no graph to quantize, and --quantize is the folders' (--openvino's) alone."""
        if not export.onnx:
            return None
        if not values["quantize"]:
            if values["block_size"] != DEFAULT_BLOCK_SIZE:
                raise TaperfoldError("--block-size sets --quantize's blocks: add --quantize int4 or int8")
            return None
        return OnnxRequest(values["quantize"], values["block_size"])

    def check_request(self, request: OnnxRequest, export: ExportRequest) -> None:
        _check_quantizable(export.dtype, "--quantize")

    def build(
        self, manifest: Export, request: OnnxRequest, on_stage: Callable[[str], None] = lambda s: None
    ) -> list[ArtifactRecord]:
        """The graphs of the request's variants and graphs weight-quantized to each of its precisions
        (taperfold.quantize), each file written atomically."""
        from taperfold.quantize import quantize_graph

        _check_quantizable(manifest.dtype, str(manifest.path))
        quantizations = request.quantizations
        variants = [canonical_variant(v) for v in request.variants or VARIANTS]
        graphs = request.graphs
        sources = [
            r
            for r in manifest.records(self.name)
            if r.precision == manifest.dtype and r.variant in variants and (graphs is None or r.graph in graphs)
        ]
        if not sources:
            raise TaperfoldError(f"{manifest.path}: no {manifest.dtype} graph of {', '.join(variants)} to quantize")
        records = []
        for quantization in quantizations:
            for source in sources:
                on_stage(f"quantizing {source.key} to {quantization.precision}")
                name = source.path.removesuffix(".onnx") + f".{quantization.precision}.onnx"
                report = quantize_graph(manifest.file(source), manifest.directory / name, quantization)
                size, data, data_size = describe_file(manifest.directory, name)
                records.append(
                    ArtifactRecord(
                        key=self.key(source.variant, source.graph, quantization.precision),
                        kind=self.name,
                        path=name,
                        variant=source.variant,
                        graph=source.graph,
                        precision=quantization.precision,
                        bytes=size,
                        external_data=data,
                        external_data_bytes=data_size,
                        built_from=source.key,
                        details=source.details,  # the same graph, its MatMuls quantized
                        reports={"quantize": report},
                    )
                )
        return records

    def projection_groups(self, manifest: Export, record: ArtifactRecord) -> int:
        """The groups export fused (`projections.summary.groups`; 0 where it fused none)."""
        projections = details_of(record, OnnxDetails).projections
        if not projections:
            return 0
        summary = projections.get("summary")
        groups = summary.get("groups") if isinstance(summary, dict) else None
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 0:
            raise TaperfoldError(
                f"{manifest.path}: key 'artifacts.{record.key}.projections.summary.groups' must be a count, "
                f"got {groups!r}"
            )
        return groups


def _check_quantizable(dtype: str, origin: str) -> None:
    if dtype != QUANTIZED_FROM:
        raise TaperfoldError(
            f"{origin}: quantized graphs are made from an {QUANTIZED_FROM} export (MatMulNBits takes {QUANTIZED_FROM} "
            f"activations on the CPU), not {dtype}"
        )


ONNX_GRAPH = OnnxGraph()
register_kind(ONNX_GRAPH)
