"""onnxruntime-genai folders: what `onnxruntime_genai.Model(folder)` loads, built from a variant's growing-cache
decoder (`export --genai`: the folded model and the baseline; `read_manifest(dir).build("genai", GenaiRequest(...))`).

    genai/folded/genai_config.json     the decoder's shape, IO names and search defaults (type "decoder")
    genai/folded/model.decoder.onnx    the export's decoder, its logits given the sequence axis genai reads
    genai/folded/model.decoder.onnx.data   a copy of the export's weights file
    genai/folded/tokenizer.json ...    the source's tokenizer files, when it has them
    genai/folded-int4/ ...             the same, weights quantized (`export --genai --quantize int4`)

genai runs a custom decoder from its config (its names are genai's defaults, which the export already uses:
input_ids, past_key_values.%d.key|value -> logits, present.%d.key|value); it feeds attention_mask and position_ids
only to a graph that has them, and taperfold's decoders take neither (positions follow the past's length). It reads
logits of rank 3, so the export's last-position logits [batch, vocab] get an Unsqueeze to [batch, 1, vocab]: the
only change to the graph. The weights are copied file to file, never loaded: a hard link would save the disk but
make the export's own file unreadable to onnx-ir, which refuses external data that has several links.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taperfold.artifacts import GENAI, ONNX, register_kind
from taperfold.artifacts.base import (
    LOGITS,
    ArtifactKind,
    ArtifactRecord,
    Export,
    ExportRequest,
    Option,
    details_of,
    tokenizer_files,
    tokenizer_names,
)
from taperfold.artifacts.onnx_graph import QUANTIZED_FROM, OnnxRequest
from taperfold.errors import TaperfoldError
from taperfold.exportdir import (
    BASELINE,
    DTYPES,
    FOLDED,
    GROWING,
    OUTPUT,
    PAST,
    Graph,
    canonical_variant,
    decoder_io_names,
)
from taperfold.fsutil import atomic_dir
from taperfold.genai_config import check_genai_folder
from taperfold.jsonfields import Fields, is_file_name
from taperfold.quantize import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, Quantization

if TYPE_CHECKING:
    from taperfold.artifacts.genai_builder import BuilderRoute

FOLDER = "genai"  # the folders' parent in the export directory
CONFIG = "genai_config.json"
GENAI_DTYPES = ("fp32", "fp16")  # the logits genai reads (it has no bfloat16)
AUTO, BUILDER, TRACED = "auto", "builder", "traced"
ROUTES = (AUTO, BUILDER, TRACED)
DEFAULT_VARIANTS = (FOLDED, BASELINE)  # what a user deploys, and what it is measured against


@dataclass(frozen=True)
class GenaiRequest:
    """Folders of `variants` (None: the folded model and the baseline) in each of `precisions` (empty: the export's
    dtype alone; int4 / int8: quantized with `block_size`, taperfold.quantize), by `route`: builder (onnxruntime-genai's
    builder, taperfold.artifacts.genai_builder), traced (the export's growing decoder, or its quantized form), or
    auto, which `GenaiFolder.plan` turns into one of them once (`declined`: why it turned the builder down)."""

    route: str = AUTO
    precisions: tuple[str, ...] = ()
    block_size: int = DEFAULT_BLOCK_SIZE
    variants: tuple[str, ...] | None = None
    declined: str | None = None

    def __post_init__(self) -> None:
        if self.route not in ROUTES:
            raise TaperfoldError(f"--genai-route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        _ = [Quantization(p, self.block_size) for p in self.precisions if p not in DTYPES]  # each checked

    def quantizations(self, dtype: str) -> list[Quantization]:
        """The quantized precisions it names (the export's dtype among them is no quantization)."""
        return [Quantization(p, self.block_size) for p in self.precisions if p != dtype]


@dataclass(frozen=True)
class GenaiDetails:
    """A genai folder's own keys in the manifest."""

    decoder: str  # the decoder's file in the folder, as genai_config.json names it
    tokenizer: tuple[str, ...] = ()  # the tokenizer files in the folder
    route: str = TRACED  # traced (the export's decoder) or builder (onnxruntime-genai's); an older entry's: traced
    builder_declined: str | None = None  # why the auto route took the traced route for a model the builder would read

    @classmethod
    def from_json(cls, entry: Fields) -> GenaiDetails:
        return cls(
            decoder=entry.value("decoder", is_file_name, "a file name in the folder"),
            tokenizer=tokenizer_names(entry),
            route=entry.value("route", lambda v: v in (BUILDER, TRACED), f"{BUILDER} or {TRACED}", TRACED),
            builder_declined=entry.optional_text("builder_declined"),
        )

    def to_json(self) -> dict[str, Any]:
        declined = {"builder_declined": self.builder_declined} if self.builder_declined is not None else {}
        return {"decoder": self.decoder, "tokenizer": list(self.tokenizer), "route": self.route, **declined}


class GenaiFolder(ArtifactKind):
    name = GENAI
    title = "onnxruntime-genai folder"
    built_from = ONNX
    verified = LOGITS
    suffix = "genai"
    needs_graphs = (GROWING,)
    options = (
        Option(
            "--genai",
            is_flag=True,
            help="Also write an onnxruntime-genai folder (genai/VARIANT/: genai_config.json beside the growing-cache "
            "decoder) per variant; adds --kv-cache growing.",
        ),
        Option(
            "--genai-route",
            choices=ROUTES,
            default=AUTO,
            show_default=True,
            help="How --genai makes each folder: builder (onnxruntime-genai's own builder, its fastest graph form, "
            "tapered norms replaced after it; Hugging Face Llama-like sources), traced (the decoder taperfold "
            "exports), or auto: the builder where it applies (docs/deployment.md).",
        ),
    )
    request_type = GenaiRequest
    details_type = GenaiDetails

    def request(self, values: Mapping[str, Any], export: ExportRequest) -> GenaiRequest | None:
        """--genai: the export's dtype and --quantize's precisions, by --genai-route."""
        if not values["genai"]:
            return None
        return GenaiRequest(values["genai_route"], (export.dtype, *values["quantize"]), values["block_size"])

    def check_request(self, request: GenaiRequest, export: ExportRequest) -> None:
        _check_export(export.dtype, export.logits, "--genai")
        for quantization in request.quantizations(export.dtype):
            if export.dtype != QUANTIZED_FROM:
                raise TaperfoldError(
                    f"--genai --quantize {quantization.precision}: quantized folders are made from an "
                    f"{QUANTIZED_FROM} export, not {export.dtype}"
                )

    def plan(self, request: GenaiRequest, source: Any, tapered: Any, dtype: str) -> GenaiRequest:
        """The route decided: builder where `request.route` asks for it (refused here in one line where it cannot
        be) or, auto, where the source, its dtype and its norms allow it; else traced."""
        recorded = source.manifest_source()
        hf = recorded is not None and recorded.is_huggingface
        return _decide_route(
            request, hf, dtype, tapered is not None, lambda: tapered, Path(source.path), str(source.path)
        )

    def needed_graphs(self, request: GenaiRequest) -> tuple[Graph, ...]:
        """The traced route is built from the growing decoders; the builder route from the source itself."""
        return () if request.route == BUILDER else (GROWING,)

    def build(
        self, manifest: Export, request: GenaiRequest, on_stage: Callable[[str], None] = lambda s: None
    ) -> list[ArtifactRecord]:
        """The folders `request` asks for, by its route (an auto route not planned by an export, as on demand, is
        planned here first, as `plan` does it, from the export's source)."""
        _check_export(manifest.dtype, manifest.logits, str(manifest.path))
        if request.route == AUTO:
            request = _plan_from_export(request, manifest)
        variants = [canonical_variant(v) for v in request.variants or DEFAULT_VARIANTS]
        quantizations = request.quantizations(manifest.dtype)
        builder = _builder(manifest) if request.route == BUILDER else None
        if request.declined:
            on_stage(f"onnxruntime-genai folders by the traced route, not the builder's: {request.declined}")
        records = []
        for precision in dict.fromkeys(request.precisions or [manifest.dtype]):
            quantization = next((q for q in quantizations if q.precision == precision), None)
            if builder is not None:  # built from the source itself, whichever graphs the export holds
                records += self._build_with_builder(manifest, builder, variants, quantization, on_stage)
            else:
                wanted = list(request.variants) if request.variants is not None else None
                records += self._build_traced(manifest, wanted, quantization, on_stage, request.declined)
        return records

    def _build_traced(
        self,
        manifest: Export,
        wanted: list[str] | None,
        quantization: Quantization | None,
        on_stage: Callable[[str], None],
        declined: str | None,
    ) -> list[ArtifactRecord]:
        precision = quantization.precision if quantization else manifest.dtype
        variants = [canonical_variant(v) for v in wanted] if wanted is not None else list(DEFAULT_VARIANTS)
        growing = [r for r in manifest.records(ONNX) if r.graph == GROWING and r.precision == manifest.dtype]
        if wanted is not None:
            missing = [v for v in variants if v not in {r.variant for r in growing}]
            if missing:
                raise TaperfoldError(
                    f"{manifest.path}: no growing-cache decoder of {', '.join(missing)} for an onnxruntime-genai "
                    "folder (re-export with --kv-cache growing)"
                )
        sources = [r.variant for r in growing if r.variant in variants]
        if not sources:
            raise TaperfoldError(
                f"{manifest.path}: no growing-cache decoder to build an onnxruntime-genai folder from "
                "(re-export with --kv-cache growing, or --genai)"
            )
        if quantization is not None:  # the quantized decoders, made first where the export has none yet
            unmade = [v for v in sources if manifest.find(v, GROWING, ONNX, precision) is None]
            if unmade:
                manifest.build(
                    ONNX,
                    OnnxRequest((precision,), quantization.block_size, variants=tuple(unmade), graphs=(GROWING,)),
                    on_stage,
                )
        records = []
        for variant in sources:
            decoder = manifest.find(variant, GROWING, ONNX, precision)
            assert decoder is not None  # made above
            on_stage(f"writing the onnxruntime-genai folder of {decoder.key}")
            records.append(self._write_folder(manifest, decoder, declined))
        return records

    def _build_with_builder(
        self,
        manifest: Export,
        builder: BuilderRoute,
        variants: list[str],
        quantization: Quantization | None,
        on_stage: Callable[[str], None],
    ) -> list[ArtifactRecord]:
        precision = quantization.precision if quantization else manifest.dtype
        extra = quantization.builder_options() if quantization else []
        names = {v: folder_name(v, precision, manifest.dtype) for v in variants}
        with contextlib.ExitStack() as stack:  # every folder, or none
            folders = {
                v: stack.enter_context(atomic_dir(manifest.directory / FOLDER / names[v], manifest.directory))
                for v in variants
            }
            builder.build(folders, precision, manifest.directory / FOLDER, on_stage, extra)
            for variant, tmp in folders.items():  # as verify and bench check it before genai reads a word of it
                final = manifest.directory / FOLDER / names[variant]
                try:
                    check_genai_folder(tmp)
                except TaperfoldError as e:
                    raise TaperfoldError(
                        f"{str(e).replace(str(tmp), str(final))} (written by onnxruntime-genai's builder; "
                        "use --genai-route traced)"
                    ) from None
        records = []
        for variant in variants:
            folder = manifest.directory / FOLDER / names[variant]
            config = json.loads((folder / CONFIG).read_text())
            records.append(
                ArtifactRecord(
                    key=self.key(variant, GROWING, None if precision == manifest.dtype else precision),
                    kind=self.name,
                    path=f"{FOLDER}/{names[variant]}/{CONFIG}",
                    variant=variant,
                    graph=GROWING,
                    precision=precision,
                    bytes=(folder / CONFIG).stat().st_size,
                    details=GenaiDetails(
                        decoder=config["model"]["decoder"]["filename"],
                        # what the builder saved beside its graph and config: the tokenizer and its processing files
                        tokenizer=tuple(
                            sorted(
                                p.name for p in folder.iterdir() if p.name != CONFIG and not p.name.startswith("model.")
                            )
                        ),
                        route=BUILDER,
                    ),
                    reports={"quantize": {**quantization.to_json(), "tool": "onnxruntime-genai builder"}}
                    if quantization
                    else {},
                )
            )
        return records

    def _write_folder(self, manifest: Export, decoder: ArtifactRecord, declined: str | None) -> ArtifactRecord:
        assert decoder.variant is not None  # a decoder is a variant's
        folder = f"{FOLDER}/{folder_name(decoder.variant, decoder.precision, manifest.dtype)}"
        tokenizer = tokenizer_files(manifest)
        with atomic_dir(manifest.directory / folder, manifest.directory) as tmp:
            _write_decoder(manifest.file(decoder), tmp / decoder.path)
            if decoder.external_data:
                shutil.copyfile(manifest.directory / decoder.external_data, tmp / decoder.external_data)
            for path in tokenizer:
                shutil.copyfile(path, tmp / path.name)
            config = genai_config(manifest, decoder.path)
            (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        config_path = manifest.directory / folder / CONFIG
        return ArtifactRecord(
            key=self.key(decoder.variant, GROWING, None if decoder.precision == manifest.dtype else decoder.precision),
            kind=self.name,
            path=f"{folder}/{CONFIG}",
            variant=decoder.variant,
            graph=GROWING,
            precision=decoder.precision,
            bytes=config_path.stat().st_size,
            built_from=decoder.key,
            details=GenaiDetails(
                decoder=decoder.path,
                tokenizer=tuple(p.name for p in tokenizer),
                route=TRACED,
                builder_declined=declined or None,
            ),
            reports={"quantize": decoder.reports["quantize"]} if "quantize" in decoder.reports else {},
        )

    def files(
        self, manifest: Export, variants: list[str], graph: Graph, precision: str | None = None
    ) -> dict[str, Path]:
        """The folders' configs of `variants` in `precision` (default: the export's dtype), each built from its
        growing decoder where the export has none yet."""
        if graph != GROWING:
            raise TaperfoldError(
                f"an onnxruntime-genai folder holds a growing-cache decoder, not a {graph} graph (--kv-cache growing)"
            )
        precision = precision or manifest.dtype
        missing = [v for v in variants if manifest.find(v, GROWING, GENAI, precision) is None]
        if missing:  # built on demand, as TensorRT engines are (bench --engine genai times the unfolded model too), the
            # way the export's folders were: one graph form for every variant timed
            routes = {details_of(r, GenaiDetails).route for r in manifest.records(GENAI)}
            route = routes.pop() if len(routes) == 1 else AUTO
            block_size = _recorded_block_size(manifest, precision)
            manifest.build(GENAI, GenaiRequest(route, (precision,), block_size, variants=tuple(missing)))
        return super().files(manifest, variants, graph, precision)

    def check(self, manifest: Export, record: ArtifactRecord) -> list[str]:
        """The config and the decoder are in the folder (genai names a missing weights file itself)."""
        problems = super().check(manifest, record)
        decoder = Path(record.path).parent / details_of(record, GenaiDetails).decoder
        if not (manifest.directory / decoder).is_file():
            problems.append(f"{decoder}: missing")
        return problems


def folder_name(variant: str, precision: str, dtype: str) -> str:
    """genai/folded for the export's dtype, genai/folded-int4 for a quantized form."""
    return variant if precision == dtype else f"{variant}-{precision}"


def _recorded_block_size(manifest: Export, precision: str) -> int:
    """The block size the export's `precision` artifacts were quantized with (a folder built on demand matches
    them), else the default."""
    for record in manifest.records():
        report = record.reports.get("quantize") if record.precision == precision else None
        if isinstance(report, dict) and report.get("block_size") in BLOCK_SIZES:
            return report["block_size"]
    return DEFAULT_BLOCK_SIZE


def _decide_route(
    request: GenaiRequest,
    hf: bool,
    dtype: str,
    is_tapered: bool,
    tapered: Callable[[], Any],
    checkpoint: Path,
    origin: str,
) -> GenaiRequest:
    """`request` with its route decided for an export (of a Hugging Face source or not, in `dtype`, of a tapered model
    or a plain one, `tapered` giving the tapered torch model at g = 0): builder or traced, and where auto turned the
    builder down for this model, why (`declined`). The model is read only where the export's settings allow the
    builder."""
    from taperfold.artifacts.genai_builder import NotBuildable, builder_scales

    if not _takes_builder(request.route, hf, dtype, is_tapered, checkpoint):
        return replace(request, route=TRACED)
    try:
        builder_scales(tapered(), origin, checkpoint)
    except NotBuildable as e:
        if request.route == BUILDER:
            raise
        return replace(request, route=TRACED, declined=e.reason)
    return replace(request, route=BUILDER)


def _plan_from_export(request: GenaiRequest, manifest: Export) -> GenaiRequest:
    """`GenaiFolder.plan` for a request made after the export (on demand): from the source the manifest records."""
    from taperfold.sources import open_source

    hf = manifest.source is not None and manifest.source.is_huggingface
    tapered = manifest.find(FOLDED) is not None
    return _decide_route(
        request,
        hf,
        manifest.dtype,
        tapered,
        lambda: open_source(manifest.checkpoint).build(gate=0.0),
        manifest.checkpoint,
        str(manifest.path),
    )


def _builder(manifest: Export) -> BuilderRoute:
    """The builder route for `manifest`'s source (a planned request's: one line where it still cannot take it)."""
    from taperfold.artifacts.genai_builder import BuilderRoute
    from taperfold.sources import open_source

    return BuilderRoute(open_source(manifest.checkpoint), str(manifest.path))


def _takes_builder(route: str, hf: bool, dtype: str, tapered: bool, checkpoint: Path) -> bool:
    """Whether `route` makes the folders of an export (of a Hugging Face source or not, in `dtype`, of a tapered
    model or a plain one) with the builder, as far as the export says without reading the model: never for traced,
    always for builder (one line when it cannot), for auto where nothing stands against it."""
    from taperfold.artifacts.genai_builder import builder_missing

    if route not in ROUTES:
        raise TaperfoldError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    if route == TRACED:
        return False
    refusal = None
    if builder_missing():
        refusal = "--genai-route builder: onnxruntime-genai's builder is not installed (pip install 'taperfold[genai]')"
    elif dtype != "fp32":
        refusal = f"{checkpoint}: the builder route builds fp32 exports, not {dtype}"
    elif not hf:
        refusal = (
            f"{checkpoint}: onnxruntime-genai's builder reads a Hugging Face directory, and this source is none; "
            "--genai-route traced exports the decoder taperfold traces"
        )
    elif not tapered:
        refusal = f"{checkpoint}: the builder route needs a tapered model (its baseline alone: --genai-route traced)"
    if refusal is not None and route == BUILDER:
        raise TaperfoldError(refusal)
    return refusal is None


def _check_export(dtype: str, logits: str, origin: str) -> None:
    if dtype not in GENAI_DTYPES:
        raise TaperfoldError(
            f"{origin}: an onnxruntime-genai folder needs an fp32 or fp16 export (genai reads no bfloat16 logits), "
            f"not {dtype}"
        )
    if logits != "last":
        raise TaperfoldError(
            f"{origin}: an onnxruntime-genai folder needs --logits last (genai keeps the last position's logits), "
            f"not --logits {logits}"
        )


def genai_config(manifest: Export, decoder_file: str) -> dict:
    """genai_config.json of a growing-cache decoder: genai's generic decoder-only type, the export's IO names, the
    source's special tokens where it has them (taperfold's byte-level models have none)."""
    shape = manifest_shape(manifest)
    inputs, outputs = decoder_io_names(shape["num_hidden_layers"], GROWING)
    special = dict((manifest.source.special_tokens if manifest.source is not None else None) or {})
    return {
        "model": {
            **special,
            "context_length": shape["context_length"],
            "type": "decoder",
            "vocab_size": shape["vocab_size"],
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": decoder_file,
                "head_size": shape["head_size"],
                "hidden_size": shape["hidden_size"],
                "num_attention_heads": shape["num_attention_heads"],
                "num_hidden_layers": shape["num_hidden_layers"],
                "num_key_value_heads": shape["num_key_value_heads"],
                "inputs": {
                    "input_ids": inputs[0],
                    "past_key_names": f"{PAST}%d.key",
                    "past_value_names": f"{PAST}%d.value",
                },
                "outputs": {
                    "logits": outputs[0],
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "max_length": shape["context_length"],
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,  # a growing cache: each step's present is one longer than its past
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def manifest_shape(manifest: Export) -> dict[str, int]:
    """The decoder's shape as genai_config.json names it, from the exported model's config."""
    shape = manifest.config()
    return {
        "context_length": shape.max_seq_len,
        "vocab_size": shape.vocab_size,
        "head_size": shape.head_dim,
        "hidden_size": shape.d_model,
        "num_attention_heads": shape.n_heads,
        "num_hidden_layers": shape.n_layers,
        "num_key_value_heads": shape.kv_heads,
    }


def _write_decoder(source: Path, dest: Path) -> None:
    """The decoder's graph (its weights stay where they are: external data by file name, beside it) with the logits
    given their sequence axis when the export dropped it."""
    import numpy as np
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    graph = model.graph
    logits = next((o for o in graph.output if o.name == OUTPUT), None)
    if logits is None:
        raise TaperfoldError(f"{source}: the decoder has no output {OUTPUT!r}")
    dims = logits.type.tensor_type.shape.dim
    if len(dims) == 2:
        flat = f"{OUTPUT}.last"
        for node in graph.node:
            node.output[:] = [flat if name == OUTPUT else name for name in node.output]
        axis = onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), f"{OUTPUT}.axis")
        graph.initializer.append(axis)
        graph.node.append(onnx.helper.make_node("Unsqueeze", [flat, axis.name], [OUTPUT], name="genai_logits_axis"))
        batch, vocab = (onnx.TensorShapeProto.Dimension(), onnx.TensorShapeProto.Dimension())
        batch.CopyFrom(dims[0])
        vocab.CopyFrom(dims[1])
        del dims[:]
        dims.add().CopyFrom(batch)
        dims.add().dim_value = 1
        dims.add().CopyFrom(vocab)
    dest.write_bytes(model.SerializeToString())


GENAI_FOLDER = GenaiFolder()
register_kind(GENAI_FOLDER)
