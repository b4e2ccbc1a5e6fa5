"""Folded checkpoints that serving engines read (`export --vllm`): a Hugging Face-style directory of the folded model,
which vLLM serves through taperfold's plugin and transformers loads through taperfold's registration
(taperfold.serving).

    vllm/folded/config.json             the source's config, its model type and architecture taperfold's own
                                        (`taperfold_llama`, `TaperfoldLlamaForCausalLM`), the folded norms' paths
                                        (`taperfold_folded_norms`)
    vllm/folded/model.safetensors       the folded weights in the export's dtype, or model-0000i-of-0000n.safetensors
                                        and model.safetensors.index.json past 2 GB; no folded norm's weight in them
    vllm/folded/tokenizer.json ...      the source's tokenizer files (a byte-level source: its byte tokenizer)

A stock tool must refuse the directory, never build the stock model with the missing norms initialised to ones and
normalize: transformers and vLLM do not know the model type. The untapered model needs no folder of its own: stock
vLLM serves the source directory itself.

The weights are written tensor by tensor, each folded reader (q/k/v, gate/up) folded in float64 from the source's
weights and cast once just before it is written, so the export holds no second copy of the model. Served: Hugging
Face sources of the families in taperfold.serving.SERVED whose tapered norms are RMS norms (TaperNorm): what each
leaves in its place is the residual add. Anything else is refused in one line before the export's work.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from taperfold.artifacts import VLLM, register_kind
from taperfold.artifacts.base import EXPORT, ArtifactKind, ArtifactRecord, Export, Field, Option, tokenizer_files
from taperfold.errors import TaperfoldError
from taperfold.exportdir import FOLDED, Graph, torch_dtype
from taperfold.fsutil import atomic_dir
from taperfold.serving import CONFIG_KEY, ServedFamily, served_family
from taperfold.taper import fold_target, stored_in_out
from taperfold.variants import producer_writes, reader_writes

if TYPE_CHECKING:
    from taperfold.hf.source import HFCheckpoint

FOLDER = "vllm"  # the folders' parent in the export directory
CONFIG = "config.json"
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"  # save_pretrained's names
GENERATION_CONFIG = "generation_config.json"
SHARD_BYTES = 2 * 1024**3  # the largest shard
SERVED_NORM = "rms"  # the norm kind whose fold leaves nothing but the residual add behind
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


@dataclass(frozen=True)
class VllmRequest:
    """The folded model's folder, its weights in files of at most `shard_bytes`."""

    shard_bytes: int = SHARD_BYTES


class VllmCheckpoint(ArtifactKind):
    name = VLLM
    title = "folded checkpoint for vLLM"
    built_from = EXPORT
    suffix = "vllm"
    options = (
        Option(
            "--vllm",
            is_flag=True,
            help="Also write the folded model as a Hugging Face-style checkpoint that vLLM serves through taperfold's "
            "plugin (vllm/folded/: safetensors, config.json naming taperfold's architecture, tokenizer); Hugging Face "
            "sources of the served families (docs/deployment.md, Serving with vLLM).",
        ),
    )
    request_type = VllmRequest  # asked for by --vllm (ArtifactKind.request: its flag)
    fields = MappingProxyType(
        {
            "architecture": Field((str,), required=True, help="config.json's architecture, taperfold's own class"),
            "weights": Field((list,), required=True, help="the safetensors files (and index) in the folder"),
            "folded_norms": Field((int,), help="the norms folded away (config.json lists their paths)"),
            "tokenizer": Field((list,), help="the tokenizer files in the folder"),
        }
    )

    def plan(self, request: VllmRequest, source: Any, tapered: Any, dtype: str) -> VllmRequest:
        """A source the plugin cannot serve is refused here, before the export's work."""
        _served(source, tapered)
        return request

    def needed_graphs(self, request: VllmRequest) -> tuple[Graph, ...]:
        """None: the folder is written from the source itself."""
        return ()

    def build(
        self, manifest: Export, request: VllmRequest, on_stage: Callable[[str], None] = lambda s: None
    ) -> list[ArtifactRecord]:
        """The folded model's folder (the largest weights file: `request.shard_bytes`, default 2 GB)."""
        from taperfold.hf.tokenizer import save_byte_tokenizer
        from taperfold.sources import open_source

        plain_source = open_source(manifest.checkpoint)
        tapered = plain_source.build(gate=0.0)  # holds the source's tensors, no copy
        source, served = _served(plain_source, tapered)
        dtype = torch_dtype(manifest.dtype)
        tokenizer = tokenizer_files(manifest)
        folder = manifest.directory / FOLDER / FOLDED
        with atomic_dir(folder, manifest.directory) as tmp:
            on_stage("writing the folded weights for vLLM")
            weights = FoldedWeights(tapered, dtype)
            files = write_safetensors(tmp, weights, request.shard_bytes)
            config = _config(source.hf_config_dict, served, weights, dtype)
            (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            for file in [*tokenizer, source.path / GENERATION_CONFIG]:
                if file.is_file():
                    shutil.copyfile(file, tmp / file.name)
            if not tokenizer and source.config.tokenizer == "bytes":  # what vLLM's tokenizer and server need
                save_byte_tokenizer(tmp)
            tokenizer_names = sorted({p.name for p in tmp.iterdir()} - {CONFIG, GENERATION_CONFIG, *files})
        path = f"{FOLDER}/{FOLDED}/{CONFIG}"
        record = ArtifactRecord(
            key=self.key(FOLDED, None),
            kind=self.name,
            path=path,
            variant=FOLDED,
            graph=None,
            precision=manifest.dtype,
            bytes=(manifest.directory / path).stat().st_size,
            details={
                "architecture": served.architecture,
                "weights": files,
                "folded_norms": len(weights.folded_norms),
                "tokenizer": tokenizer_names,
            },
        )
        return [record]

    def files(
        self, manifest: Export, variants: list[str], graph: Graph, precision: str | None = None
    ) -> dict[str, Path]:
        """{variant: its folder's config.json} of the variants among `variants` the export has a folder of (the folded
        one: the untapered model needs none, and `bench --against vllm` times it from the source directory); one line
        where it has none of them. A folder serves any cache: `graph` is not asked."""
        records = {r.variant: r for r in manifest.records(self.name) if r.precision == (precision or manifest.dtype)}
        files = {v: manifest.file(records[v]) for v in variants if v in records}
        if not files:
            raise TaperfoldError(
                f"{manifest.path}: no vLLM checkpoint of {', '.join(variants)} (export --vllm writes the folded "
                "model's; stock vLLM runs the untapered model: bench --against vllm)"
            )
        return files

    def check(self, manifest: Export, record: ArtifactRecord) -> list[str]:
        """The default's, and each weights file the record names present."""
        folder = Path(record.path).parent.as_posix()
        names = [f"{folder}/{name}" for name in record.details["weights"]]
        missing = [f"{name}: missing" for name in names if not (manifest.directory / name).is_file()]
        return super().check(manifest, record) + missing


def _served(source: Any, tapered: Any) -> tuple[HFCheckpoint, ServedFamily]:
    """`source` (a taperfold.sources model source; `tapered` its tapered torch model at g = 0, None for a plain one) as
    the Hugging Face directory it must be, and its served family; or one line saying why the plugin cannot serve its
    folded form."""
    from taperfold.hf.source import HFCheckpoint

    origin = str(source.path)
    if not isinstance(source, HFCheckpoint):
        raise TaperfoldError(
            f"{origin}: --vllm writes the folded form of a Hugging Face directory (save_pretrained); this is a "
            "taperfold checkpoint, whose architecture no serving engine knows"
        )
    tapering = tapered.tapering if tapered is not None else None
    if tapering is None:
        raise TaperfoldError(
            f"{origin}: --vllm: the model is untapered, so there is nothing to fold; stock vLLM serves the directory "
            f"itself (python -m vllm.entrypoints.openai.api_server --model {origin})"
        )
    served = served_family(source.family.name, origin)
    if tapering.kind.name != SERVED_NORM:
        raise TaperfoldError(
            f"{origin}: --vllm: its tapered norms are {tapering.kind.title}s; the plugin serves folded RMS norms "
            "(TaperNorm), which leave only the residual add behind"
        )
    if served.tied_head:
        head = source.family.head
        if not source.hf_config_dict.get("tie_word_embeddings", True):
            raise TaperfoldError(
                f"{origin}: --vllm: its head is untied (tie_word_embeddings false), and vLLM's "
                f"{served.model_class} reads the logits from the embedding: it would serve the wrong head"
            )
        if any(head in tapering.folds_into(path) for path in tapering.norms):
            raise TaperfoldError(
                f"{origin}: --vllm: the final norm folds into the head, which unties it from the embedding, and "
                f"vLLM's {served.model_class} reads the logits from the embedding; taper the internal norms only"
            )
    return source, served


class FoldedWeights:
    """The folded model's tensors under the source's names, made one at a time: what a reader of a folded norm holds
    after the fold (float64, cast once), every other tensor as the source has it, cast to `dtype`; the folded norms'
    own tensors and a tied head's copy left out (a head a fold rewrites is written, untied)."""

    def __init__(self, tapered: Any, dtype: torch.dtype):
        self.network, self.dtype = tapered.network, dtype
        tapering = tapered.tapering
        self.tapering = tapering
        self.folded_norms = [path for path in tapering.norms if tapering.folds_into(path)]
        self.norm_of = {target: path for path in self.folded_norms for target in tapering.folds_into(path)}
        state = self.network.state_dict()
        tied = set(getattr(self.network, "all_tied_weights_keys", None) or {})
        self.untied = {name for name in tied if name.rpartition(".")[0] in self.norm_of}
        self.source = {
            name: tensor
            for name, tensor in state.items()
            if not any(name.startswith(f"{norm}.") for norm in self.folded_norms)
            and (name not in tied or name in self.untied)
        }
        self._pending: dict[str, torch.Tensor] = {}  # a folded layer's tensors not yet asked for
        self._ready: dict[str, torch.Tensor] = {}  # stored tensors made from a model tensor, not yet asked for
        self._model_name: dict[str, str] = {}  # a stored name -> the model's tensor it is (a part of)

    def shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Each tensor's name as checkpoints store it, its shape and stored dtype, in the order they are written."""
        shapes = {}
        for name, t in self.source.items():
            for stored, part in self._stored(name, torch.empty(t.shape, device="meta")).items():
                self._model_name[stored] = name
                shapes[stored] = (part.shape, self._stored_dtype(t))
        return shapes

    def _stored(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's tensor `name` as checkpoints of its family store it: transformers' conversion mapping
        reversed, as save_pretrained writes it (MoE experts stacked in the model, `mlp.experts.gate_up_proj`, stored
        one by one under the checkpoint's names, `block_sparse_moe.experts.0.w1.weight`, which vLLM loads)."""
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # an older transformers: names are stored as the modules have them
            return {name: tensor}
        return revert_weight_conversion(self.network, {name: tensor})

    def tensor(self, stored: str) -> torch.Tensor:
        """The tensor stored as `stored` (a name `shapes()` gave)."""
        if stored not in self._ready:
            name = self._model_name.get(stored, stored)
            self._ready.update(self._stored(name, self._model_tensor(name)))
        return self._ready.pop(stored).contiguous()

    def _model_tensor(self, name: str) -> torch.Tensor:
        layer = name if name in self.norm_of else name.rpartition(".")[0]  # a bare weight is its own target
        if layer not in self.norm_of:
            tensor = self.source[name]
            return tensor.to(self._stored_dtype(tensor))
        if name not in self._pending:
            self._pending.update(self._folded(layer))
        return self._pending.pop(name)

    @torch.no_grad()
    def _folded(self, target: str) -> dict[str, torch.Tensor]:
        """The tensors of layer `target` once its norm's map is folded in (float64, then cast once): into its input
        rows where it reads the norm, into its output columns where it produces a post-norm's input."""
        norm_path = self.norm_of[target]
        norm = self.network.get_submodule(norm_path)
        constant = self.tapering.kind.constant_map(norm)
        reader = fold_target(self.network, target)
        if isinstance(reader, nn.Parameter):  # a router's or stacked experts' weight: a tensor of its own
            weight = nn.Parameter(reader.detach().double())
            in_out = stored_in_out(self.network, target, len(constant.scale))
            for write in reader_writes(weight, constant, in_out):
                if reason := write.past_range(self.dtype):
                    raise TaperfoldError(f"--vllm: {norm_path} cannot be folded into {target} ({reason})")
                write.apply()
            return {target: weight.detach().to(self.dtype)}
        layer = copy.deepcopy(reader).double()  # this layer only
        if norm_path in self.tapering.producers:
            writes = producer_writes(layer, constant)
        else:
            writes = reader_writes(layer, constant, stored_in_out(self.network, target, len(constant.scale)))
        for write in writes:
            if reason := write.past_range(self.dtype):  # in the dtype it is stored in
                raise TaperfoldError(f"--vllm: {norm_path} cannot be folded into {target} ({reason})")
            write.apply()
        tensors = {f"{target}.{key}": t.to(self.dtype) for key, t in layer.state_dict().items()}
        if added := sorted(set(tensors) - set(self.source)):  # a bias a LayerNorm's β would add
            raise TaperfoldError(f"--vllm: folding {norm_path} gives {target} tensors it has not got: {added}")
        return tensors

    def _stored_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return self.dtype if tensor.is_floating_point() else tensor.dtype


def write_safetensors(folder: Path, weights: FoldedWeights, shard_bytes: int) -> list[str]:
    """Write `weights` into `folder` as save_pretrained does (one model.safetensors, or shards of at most
    `shard_bytes` and their index), each tensor made just before it is written; the files written."""
    shards: list[dict[str, tuple[torch.Size, torch.dtype]]] = [{}]
    sizes = [0]
    for name, (shape, dtype) in weights.shapes().items():
        size = math.prod(shape) * dtype.itemsize
        if shards[-1] and sizes[-1] + size > shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = (shape, dtype)
        sizes[-1] += size
    if len(shards) == 1:
        _write_file(folder / WEIGHTS, shards[0], weights)
        return [WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _write_file(folder / name, shard, weights)
    weight_map = {tensor: name for name, shard in zip(names, shards) for tensor in shard}
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX]


def _write_file(path: Path, shard: dict[str, tuple[torch.Size, torch.dtype]], weights: FoldedWeights) -> None:
    """One safetensors file: its header (each tensor's dtype, shape and byte range), then the tensors one by one."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in shard.items():
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for name, (shape, dtype) in shard.items():
            tensor = weights.tensor(name)
            if tensor.shape != shape or tensor.dtype != dtype:  # a fold that changed a layer's form
                raise TaperfoldError(
                    f"{path}: {name} is {list(tensor.shape)} {tensor.dtype}, planned {list(shape)} {dtype}"
                )
            out.write(_raw_bytes(tensor))


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, little-endian as safetensors stores them (bfloat16 has no NumPy type: viewed as bytes)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def _config(source_config: dict, served: ServedFamily, weights: FoldedWeights, dtype: torch.dtype) -> dict:
    """The source's config.json as the folded checkpoint's: taperfold's model type and architecture, the folded
    norms' paths, the weights' dtype; the head untied where a fold rewrote it."""
    from taperfold.hf.taper_block import BLOCK

    config = {key: value for key, value in source_config.items() if key not in (BLOCK, "torch_dtype")}
    config.update(
        model_type=served.model_type,
        architectures=[served.architecture],
        dtype=str(dtype).removeprefix("torch."),
        **{CONFIG_KEY: weights.folded_norms},
    )
    if weights.untied:
        config["tie_word_embeddings"] = False
    return config


VLLM_CHECKPOINT = VllmCheckpoint()
register_kind(VLLM_CHECKPOINT)
