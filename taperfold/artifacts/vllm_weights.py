"""The folded checkpoint's weights (`export --vllm`, taperfold.artifacts.vllm_checkpoint): the folded model's tensors
made one at a time and written as safetensors files, as save_pretrained writes them. Kept out of the kind's module,
which `taperfold export --help` imports, because it needs torch; the kind imports it in `build`.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taperfold.errors import TaperfoldError
from taperfold.serving import served_split
from taperfold.taper import fold_target, stored_in_out
from taperfold.variants import producer_writes, reader_writes

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"  # save_pretrained's names
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


class FoldedWeights:
    """The folded model's tensors under the source's names, made one at a time: what a reader of a folded norm holds
    after the fold (float64, cast once), every other tensor as the source has it, cast to `dtype`; of each tapered norm
    only the tensors its served form holds (taperfold.norms.NormKind.served: none for a folded RMS norm or LayerNorm, a
    folded DyT's α, all of a DyT kept whole), and a tied head's copy left out (a head a fold rewrites is written,
    untied); the bias a β gives a layer without one written beside its weight (`added_biases`: the serving classes
    give those layers one)."""

    def __init__(self, tapered: Any, dtype: torch.dtype):
        self.network, self.dtype = tapered.network, dtype
        tapering = tapered.tapering
        self.tapering = tapering
        try:
            self.folded_norms, self.kept_norms = served_split(tapering, self.network)
        except ValueError as e:
            raise TaperfoldError(f"--vllm: {e}") from None
        self.norm_of = {target: path for path in self.folded_norms for target in tapering.folds_into(path)}
        state = self.network.state_dict()
        served = {
            f"{path}.{key}"
            for path, norm in tapering.norms.items()
            for key in tapering.kind.served(len(norm.get_parameter("weight")), path in self.folded_norms).state_dict()
        }
        if missing := sorted(served - set(state)):
            raise TaperfoldError(f"--vllm: the served norms hold tensors the tapered model has not: {missing}")
        tied = set(getattr(self.network, "all_tied_weights_keys", None) or {})
        self.untied = {name for name in tied if name.rpartition(".")[0] in self.norm_of}
        self.source = {
            name: tensor
            for name, tensor in state.items()
            if (name in served or not any(name.startswith(f"{norm}.") for norm in tapering.norms))
            and (name not in tied or name in self.untied)
        }
        # layers a fold gives a bias they have not got (a LayerNorm's or a DyT's β: b' = β·W), beside their weight
        self.added_biases = [
            target
            for target, norm in self.norm_of.items()
            if (tapering.kind.shift or (tapering.kind.centered and norm in tapering.producers))
            and isinstance(layer := fold_target(self.network, target), nn.Linear)
            and layer.bias is None
        ]
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
            if (layer := name.removesuffix(".weight")) in self.added_biases:
                shapes[f"{layer}.bias"] = (torch.Size([t.shape[0]]), self.dtype)  # an nn.Linear's: [out]
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
        if added := sorted(set(tensors) - set(self.source) - {f"{t}.bias" for t in self.added_biases}):
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
