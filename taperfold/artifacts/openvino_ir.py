"""OpenVINO stateful IR folders: the form OpenVINO's CPU plugin decodes fastest, made from the torch variants
(`export --openvino`: the folded model and the baseline; `bench --engine openvino-ir` builds what it times).

    openvino/folded/openvino_model.xml   the growing-cache decoder, its KV cache held in the model's state
    openvino/folded/openvino_model.bin   its weights (fp32)
    openvino/folded/tokenizer.json ...   the source's tokenizer files, when it has them
    openvino/folded-int4/ ...            the same, weights compressed (`export --openvino --quantize int4`)

OpenVINO reads taperfold's ONNX decoders as they are, but runs their attention as MatMul and Softmax and takes the
whole cache in and out at every step (docs/benchmarks.md, "OpenVINO against optimum-intel"). This kind converts the
variant's torch model instead, as optimum-intel does for the untapered one: torch.export of the same decoder the
ONNX export traces (taperfold.tracing.trace_call), `openvino.convert_model`, whose PyTorch frontend keeps
scaled_dot_product_attention as one ScaledDotProductAttention op, then the form the CPU plugin's stateful attention
fusion matches:

- each past key/value becomes a variable of the model's state (OpenVINO's make-stateful transformation), zeros of
  the prompt's batch to start; `reset_state` starts a new sequence;
- a `beam_idx` input (int32 [batch]) picks the rows of the cache each step continues (Gather), as optimum-intel's
  IR has it: the fusion matches the Gather, and arange(batch) keeps every row;
- a boolean attention mask becomes the additive one (0 or float32's lowest) the fused kernel runs fast.

int8 and int4 forms are OpenVINO's own weight compression (NNCF's `compress_weights`) with the settings optimum-intel's
`--weight-format int8 | int4` passes it: int8 asymmetric per output channel; int4 asymmetric in groups of 128 (a
width no multiple of it takes the nearest group size that divides it), every layer int4 but the embedding and the
LM head, which stay int8.

The decoder's inputs are `input_ids` and `beam_idx`; its positions follow the cache's length, as the ONNX decoders'
do. The manifest records how many attention layers became ScaledDotProductAttention (`attention`): fewer than the
model's layers means OpenVINO runs the others decomposed (a model whose attention torch.export traces as MatMul).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from taperfold.artifacts import OPENVINO, register_kind
from taperfold.artifacts.base import (
    EXPORT,
    LOGITS,
    ArtifactKind,
    ArtifactRecord,
    Export,
    ExportRequest,
    Option,
    tokenizer_files,
    tokenizer_names,
)
from taperfold.environment import install_hint
from taperfold.errors import TaperfoldError, first_line
from taperfold.exportdir import BASELINE, FOLDED, GROWING, OUTPUT, PAST, Graph, canonical_variant
from taperfold.fsutil import atomic_dir
from taperfold.jsonfields import Fields
from taperfold.quantize import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    from taperfold.taper import TaperedLM

FOLDER = "openvino"  # the folders' parent in the export directory
MODEL = "openvino_model.xml"  # optimum-intel's name for it
BEAM_IDX = "beam_idx"
DTYPE = "fp32"
DEFAULT_VARIANTS = (FOLDED, BASELINE)  # what a user deploys, and what it is measured against
SDPA = "ScaledDotProductAttention"
COMPRESSED = ("int8", "int4")
DEFAULT_GROUP_SIZE = 128  # NNCF's int4 groups, and optimum-intel's


@dataclass(frozen=True)
class WeightCompression:
    """One compressed form of the IR, as optimum-intel's `--weight-format` asks NNCF for it."""

    precision: str  # int8 | int4
    group_size: int = DEFAULT_GROUP_SIZE  # int4 only: int8 is per output channel

    def to_json(self) -> dict:
        import importlib.metadata

        int4 = self.precision == "int4"
        return {
            "precision": self.precision,
            "mode": f"{self.precision}_asym",
            "group_size": self.group_size if int4 else -1,
            "ratio": 1.0,
            **({"group_size_fallback": "adjust"} if int4 else {}),
            "tool": f"nncf {importlib.metadata.version('nncf')} compress_weights",
        }

    def apply(self, model: Any) -> Any:
        """`model` with its weights compressed. NNCF's statistics table and progress bar (stdout, stderr) are kept
        out of taperfold's output: the manifest records the settings."""
        import nncf

        nncf.set_log_level(logging.ERROR)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return self._compress(nncf, model)

    def _compress(self, nncf: Any, model: Any) -> Any:
        if self.precision == "int8":
            return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM, ratio=1.0)
        return nncf.compress_weights(
            model,
            mode=nncf.CompressWeightsMode.INT4_ASYM,
            ratio=1.0,
            group_size=self.group_size,
            advanced_parameters=nncf.AdvancedCompressionParameters(
                group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST
            ),
        )


@dataclass(frozen=True)
class OpenvinoRequest:
    """Folders of `variants` (None: the folded model and the baseline, those the export holds) in each of
    `precisions` (empty: fp32 alone; int8 / int4: weights compressed by NNCF, `group_size` int4's groups, None:
    NNCF's 128)."""

    precisions: tuple[str, ...] = ()
    group_size: int | None = None
    variants: tuple[str, ...] | None = None


@dataclass(frozen=True)
class OpenvinoDetails:
    """An OpenVINO IR's own keys in the manifest."""

    attention: int  # attention layers OpenVINO runs as one ScaledDotProductAttention op (the others decomposed)
    tokenizer: tuple[str, ...] = ()  # the source's tokenizer files copied into the folder

    @classmethod
    def from_json(cls, entry: Fields) -> OpenvinoDetails:
        return cls(attention=entry.count("attention"), tokenizer=tokenizer_names(entry))

    def to_json(self) -> dict[str, Any]:
        return {"attention": self.attention, "tokenizer": list(self.tokenizer)}


class OpenVinoIR(ArtifactKind):
    name = OPENVINO
    title = "OpenVINO stateful IR"
    built_from = EXPORT
    verified = LOGITS
    suffix = "openvino"
    options = (
        Option(
            "--openvino",
            is_flag=True,
            help="Also write an OpenVINO stateful IR per variant (openvino/VARIANT/openvino_model.xml: the "
            "growing-cache decoder, its KV cache in the model's state, attention as ScaledDotProductAttention), "
            "converted from the torch model; fp32 exports (docs/deployment.md).",
        ),
    )
    request_type = OpenvinoRequest
    details_type = OpenvinoDetails

    def request(self, values: Mapping[str, Any], export: ExportRequest) -> OpenvinoRequest | None:
        """--openvino: the export's dtype and --quantize's precisions; NNCF's int4 groups unless --block-size sets
        them."""
        if not values["openvino"]:
            return None
        block_size = values["block_size"]
        return OpenvinoRequest(
            (export.dtype, *values["quantize"]), block_size if block_size != DEFAULT_BLOCK_SIZE else None
        )

    def check_request(self, request: OpenvinoRequest, export: ExportRequest) -> None:
        if importlib.util.find_spec("openvino") is None:  # before the export's work
            raise TaperfoldError(f"--openvino: openvino is not installed ({install_hint('openvino')})")
        if export.dtype != DTYPE:
            raise TaperfoldError(f"--openvino: the stateful IR is made from an fp32 export, not {export.dtype}")
        _compressions(request)

    def build(
        self, manifest: Export, request: OpenvinoRequest, on_stage: Callable[[str], None] = lambda s: None
    ) -> list[ArtifactRecord]:
        """A folder per variant and precision `request` asks for, each converted from the variant's torch model,
        built afresh from the export's source."""
        from taperfold.sources import open_source

        self.check_request(request, manifest)
        source = open_source(manifest.checkpoint)
        wanted = request.variants
        if wanted:
            variants = [canonical_variant(v) for v in wanted]
        elif manifest.onnx:
            variants = [v for v in DEFAULT_VARIANTS if manifest.find(v) is not None]
        else:  # export --no-onnx: the variants the source has
            variants = [v for v in DEFAULT_VARIANTS if v == BASELINE or source.tapered]
        precisions = list(dict.fromkeys(request.precisions or [DTYPE]))
        compressions = {c.precision: c for c in _compressions(request)}
        models = _torch_variants(source, variants, str(manifest.checkpoint))
        tokenizer = tokenizer_files(manifest)
        names = {(v, p): folder_name(v, p) for v in variants for p in precisions}
        attention = {}
        with contextlib.ExitStack() as stack:  # every folder, or none
            folders = {
                key: stack.enter_context(atomic_dir(manifest.directory / FOLDER / n, manifest.directory))
                for key, n in names.items()
            }
            for variant in variants:
                on_stage(f"converting {variant} to a stateful OpenVINO IR")
                with source.export_context():
                    converted, attention[variant] = stateful_ir(models.pop(variant), str(manifest.checkpoint), on_stage)
                for precision in precisions:
                    folder = folders[(variant, precision)]
                    if precision in compressions:
                        on_stage(f"compressing {variant}'s weights to {precision} (NNCF)")
                        _save(compressions[precision].apply(converted.clone()), folder / MODEL)
                    else:
                        _save(converted, folder / MODEL)
                    for file in tokenizer:
                        shutil.copyfile(file, folder / file.name)
                del converted
        records = []
        for (variant, precision), name in names.items():
            model = f"{FOLDER}/{name}/{MODEL}"
            weights = Path(model).with_suffix(".bin").as_posix()
            compression = compressions.get(precision)
            records.append(
                ArtifactRecord(
                    key=self.key(variant, GROWING, None if precision == DTYPE else precision),
                    kind=self.name,
                    path=model,
                    variant=variant,
                    graph=GROWING,
                    precision=precision,
                    bytes=(manifest.directory / model).stat().st_size,
                    external_data=weights,
                    external_data_bytes=(manifest.directory / weights).stat().st_size,
                    details=OpenvinoDetails(attention[variant], tuple(p.name for p in tokenizer)),
                    reports={"quantize": compression.to_json()} if compression else {},
                )
            )
        return records

    def files(
        self, manifest: Export, variants: list[str], graph: Graph, precision: str | None = None
    ) -> dict[str, Path]:
        """The IR of each of `variants`, converted first where the export has none yet (bench times the unfolded
        model too)."""
        if graph != GROWING:
            raise TaperfoldError(f"an OpenVINO stateful IR holds a growing KV cache, not a {graph} graph")
        precision = precision or DTYPE
        if precision not in (DTYPE, *COMPRESSED):
            raise TaperfoldError(f"the OpenVINO stateful IR is {DTYPE}, int8 or int4, not {precision}")
        missing = [v for v in variants if manifest.find(v, GROWING, self.name, precision) is None]
        if missing:
            manifest.build(self.name, OpenvinoRequest((precision,), variants=tuple(missing)))
        return super().files(manifest, variants, graph, precision)


def folder_name(variant: str, precision: str) -> str:
    """openvino/folded for fp32, openvino/folded-int4 for a compressed form."""
    return variant if precision == DTYPE else f"{variant}-{precision}"


def _compressions(request: OpenvinoRequest) -> list[WeightCompression]:
    """The compressed forms a build request names (its precisions beside fp32, its group size); one line naming what
    is wrong, or NNCF missing."""
    unknown = [p for p in request.precisions if p not in (DTYPE, *COMPRESSED)]
    if unknown:
        raise TaperfoldError(f"--openvino: the stateful IR is {DTYPE}, int8 or int4, not {unknown[0]}")
    group_size = DEFAULT_GROUP_SIZE if request.group_size is None else request.group_size
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise TaperfoldError(f"--openvino: int4 groups of {group_size!r} weights: give a positive whole number")
    wanted = [WeightCompression(p, group_size) for p in request.precisions if p in COMPRESSED]
    if wanted and importlib.util.find_spec("nncf") is None:
        raise TaperfoldError(
            "--openvino --quantize: NNCF compresses OpenVINO's weights and is not installed "
            f"({install_hint('openvino')})"
        )
    return wanted


def _save(model: Any, path: Path) -> None:
    import openvino as ov

    ov.save_model(model, str(path), compress_to_fp16=False)


def _torch_variants(source: Any, variants: list[str], origin: str) -> dict[str, TaperedLM]:
    """The variants' torch models at g = 0 in fp32 (the folded one folded in float64), sharing their weights."""
    import torch

    from taperfold.variants import build_variants

    if not source.tapered:
        other = [v for v in variants if v != BASELINE]
        if other:
            raise TaperfoldError(f"{origin}: the export's model is untapered; it has no {other[0]} variant")
        return {BASELINE: source.build_baseline().to(torch.float32).eval()}
    return build_variants(source, variants, torch.float32)


def stateful_ir(model: TaperedLM, origin: str, on_stage: Callable[[str], None]) -> tuple[Any, int]:
    """`model`'s growing-cache decoder converted to a stateful OpenVINO model, and the number of attention layers it
    runs as ScaledDotProductAttention."""
    import openvino as ov

    converted = _converted(_exported_decoder(model, origin), origin, on_stage)
    cfg = model.cfg
    _name_ports(converted, cfg.n_layers)
    converted.reshape(
        {
            name: ov.PartialShape([-1, cfg.kv_heads, -1, cfg.head_dim])
            for name in (p.get_any_name() for p in converted.inputs)
            if name.startswith(PAST)
        }
    )
    attention = _additive_masks(converted)
    _cache_in_state(converted)
    return converted, attention


def _converted(program: Any, origin: str, on_stage: Callable[[str], None]) -> Any:
    """OpenVINO's model of a torch.export program. `openvino.convert_model(program)` first decomposes the program to
    core ATen ops (a second trace: 80 s of a 135M Llama's 90 s here); the frontend reads most of the program's own
    ops, and `_frontend_ops` rewrites the few it misses in a Llama-like model, so the program goes to it directly,
    decomposed only where the frontend still misses an op (one line says so)."""
    import openvino as ov
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ov.convert_model(TorchFXPythonDecoder(_frontend_ops(program.module()), dynamic_shapes=True))
        except Exception as missed:  # noqa: BLE001 - the frontend's own types; its report names every op it missed
            on_stage(f"OpenVINO reads the decoder's program decomposed ({_frontend_summary(missed)})")
        try:
            return ov.convert_model(program)
        except Exception as e:  # noqa: BLE001 - as above
            raise TaperfoldError(f"{origin}: OpenVINO cannot convert the decoder ({_frontend_summary(e)})") from None


def _frontend_summary(error: Exception) -> str:
    """The lines of OpenVINO's conversion report that name what it missed (its first line names only its source)."""
    text = re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", str(error))  # a Python function the graph calls
    summary = text.split("Summary:", 1)[1] if "Summary:" in text else ""
    lines = [line.strip(" -") for line in summary.splitlines() if line.strip(" -")]
    return "; ".join(lines) if lines else first_line(error)


def _frontend_ops(module: Any) -> Any:
    """`module` (torch.export's graph) with the ops OpenVINO's frontend has no rule for written as ones it has: reshape
    as view (one op to OpenVINO), & as bitwise_and, the casts (to, type_as) as _to_copy(dtype) (the CPU alone), softmax
    as _softmax, dropout (an inference graph's: off) and contiguous dropped, and max of two lengths (a sliding
    window's start) as a maximum of two scalars."""
    import torch

    aten = torch.ops.aten
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target, args = node.target, node.args
        if target is aten.reshape.default:
            node.target = aten.view.default
        elif target is aten.__and__.Tensor:
            node.target = aten.bitwise_and.Tensor
        elif target in (aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.type_as.default):
            dtype = _cast_dtype(node)
            if dtype is None:
                node.replace_all_uses_with(args[0])
                graph.erase_node(node)
            else:
                node.target, node.args, node.kwargs = aten._to_copy.default, (args[0],), {"dtype": dtype}
        elif target is aten.softmax.int and len(args) == 2 and not node.kwargs:
            node.target, node.args = aten._softmax.default, (*args, False)
        elif target is aten.contiguous.default or (target is aten.dropout.default and not args[2]):
            node.replace_all_uses_with(args[0])
            graph.erase_node(node)
        elif target is torch.sym_max:
            with graph.inserting_before(node):
                scalars = [graph.call_function(aten.scalar_tensor.default, (a,), {"dtype": torch.int64}) for a in args]
                node.target, node.args = aten.maximum.default, tuple(scalars)
    module.recompile()
    return module


def _cast_dtype(node: Any) -> Any:
    """The dtype a cast node (to(dtype), to(device, dtype), to(dtype=...), type_as) casts to; None: none."""
    import torch

    aten = torch.ops.aten
    if node.target is aten.to.dtype:
        return node.args[1]
    if node.target is aten.to.device:
        return node.args[2]
    if node.target is aten.type_as.default:
        return node.args[1].meta["val"].dtype
    return node.kwargs.get("dtype")


def _exported_decoder(model: TaperedLM, origin: str):
    """torch.export's program of the growing-cache decoder the ONNX export traces: non-strict, else as torch.onnx
    captures it (its strategies in turn: size-oblivious, the dynamic axes refined by torch.export's own suggested
    fixes, strict; what a model that ties two lengths, as Mistral's sliding window does, needs); with the model's
    plain MatMul and Softmax attention where its fused form fails to trace."""
    import torch

    from taperfold.tracing import ExportOptions, trace_call

    call = trace_call(model, ExportOptions(dtype=DTYPE), GROWING)

    def export():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.export's notes on its own deprecations
            try:
                return torch.export.export(
                    call.module, call.args, call.kwargs, dynamic_shapes=call.shapes, strict=False
                )
            except Exception as plain:  # torch.export raises many types
                from torch.onnx._internal.exporter._capture_strategies import CAPTURE_STRATEGIES

                for strategy in CAPTURE_STRATEGIES:
                    result = strategy(verbose=False)(call.module, call.args, call.kwargs, call.shapes)
                    if result.exported_program is not None:
                        return result.exported_program
                raise plain

    try:
        program = export()
    except Exception as e:  # noqa: BLE001 - torch.export raises many types, each with a long banner
        eager = model.eager_attention()
        if eager is None:
            raise TaperfoldError(f"{origin}: torch.export failed on the decoder ({first_line(e)})") from None
        with eager:
            try:
                program = export()
            except Exception as again:  # noqa: BLE001 - as above
                raise TaperfoldError(f"{origin}: torch.export failed on the decoder ({first_line(again)})") from None
    _drop_empty_concat_inputs(program)
    return program


def _drop_empty_concat_inputs(program) -> None:
    """torch.cat skips 1-D empty tensors, and transformers' DynamicLayer starts its cache as one (then concatenates
    the past onto it); OpenVINO's frontend refuses to concatenate such a tensor with 4-D ones. The same cat without
    them computes the same."""
    import torch

    graph = program.graph_module.graph
    changed = False
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        tensors = list(node.args[0])
        kept = [t for t in tensors if not _empty_vector(t)]
        if kept and len(kept) < len(tensors):
            node.args = (kept, *node.args[1:])
            changed = True
    if changed:
        graph.eliminate_dead_code()
        program.graph_module.recompile()


def _empty_vector(node: Any) -> bool:
    value = getattr(node, "meta", {}).get("val")
    return value is not None and tuple(value.shape) == (0,)


def _name_ports(model: Any, n_layers: int) -> None:
    """The decoder's inputs and outputs get the names the ONNX decoders have (exportdir.decoder_io_names)."""
    from taperfold.exportdir import decoder_io_names

    inputs, outputs = decoder_io_names(n_layers, GROWING)
    if len(model.inputs) != len(inputs) or len(model.outputs) != len(outputs):
        raise TaperfoldError(
            f"the converted decoder has {len(model.inputs)} inputs and {len(model.outputs)} outputs, "
            f"not {len(inputs)} and {len(outputs)}"
        )
    for port, name in zip(model.inputs, inputs, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})


def _additive_masks(model: Any) -> int:
    """Each ScaledDotProductAttention's boolean mask becomes the additive one (0 where it attends, float32's lowest
    where not: no row is all masked, so no NaN); one Select per mask, shared by the layers that share it. The
    number of ScaledDotProductAttention ops."""
    from openvino import opset13

    additive: dict[Any, Any] = {}
    count = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != SDPA:
            continue
        count += 1
        if op.get_input_size() < 4:
            continue
        mask = op.input_value(3)
        if mask.get_element_type().is_real():
            continue
        key = (mask.get_node().get_name(), mask.get_index())
        if key not in additive:
            lowest = np.float32(np.finfo(np.float32).min)
            additive[key] = opset13.select(mask, np.float32(0.0), lowest).output(0)
        op.input(3).replace_source_output(additive[key])
    model.validate_nodes_and_infer_types()
    return count


def _cache_in_state(model: Any) -> None:
    """Pasts and presents become the model's state (OpenVINO's make-stateful transformation), behind a beam_idx
    Gather on the path each past is concatenated on (the other readers of a past take its shape alone), as
    optimum-intel's stateful IR has them; each variable starts as zeros of the prompt's batch."""
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    beam = opset13.parameter([-1], ov.Type.i32, name=BEAM_IDX)
    beam.output(0).get_tensor().set_names({BEAM_IDX})
    pasts = [p for p in model.inputs if p.get_any_name().startswith(PAST)]
    for past in pasts:
        for reader in list(past.get_target_inputs()):
            if reader.get_node().get_type_name() == "Concat":
                reader.replace_source_output(opset13.gather(past, beam, np.int64(0)).output(0))
    model.add_parameters([beam])
    names = [p.get_any_name() for p in pasts]
    apply_make_stateful_transformation(model, {name: name.replace(PAST, "present.") for name in names})
    ids = model.input("input_ids")
    batch = opset13.gather(opset13.shape_of(ids, output_type="i64"), np.array([0], dtype=np.int64), np.int64(0))
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        shape = op.get_output_partial_shape(0)
        dims = [batch] + [np.array([d.get_length() if d.is_static else 0], dtype=np.int64) for d in list(shape)[1:]]
        zero = opset13.constant(0.0, dtype=op.get_output_element_type(0))
        op.set_arguments([opset13.broadcast(zero, opset13.concat(dims, 0))])
    model.validate_nodes_and_infer_types()
    if OUTPUT not in model.output(0).get_names():
        raise TaperfoldError(f"the stateful decoder's first output is not {OUTPUT!r}")


OPENVINO_IR = OpenVinoIR()
register_kind(OPENVINO_IR)
