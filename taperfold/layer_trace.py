"""Export's few-layer trace: which models it serves, and the model it traces (passes/stamp_layers.py stamps out the
rest of the layers from that trace).

A model qualifies when its layers are alike: the same modules, weights of the same shapes, the same settings (a
module's plain attributes, its integer and boolean buffers, and transformers' `layer_types`), differing in their
layer index alone. Layer 0 may differ (it is traced as it is), and so may the first layers where the rest are alike
(DeepSeek-V3's dense layers before its MoE ones): those are traced as they are. The model traced is the model cut to
its first three layers, or to the layers unlike the rest and two more: those share the model's tensors, and the last
two are copies holding distinct random values (passes/stamp_layers.py says why).
"""

from __future__ import annotations

import copy
import functools
import types
from typing import cast

import torch
from onnx_ir.tensor_adapters import TorchTensor
from torch import nn

from taperfold.passes.stamp_layers import LayerWeights
from taperfold.taper import TaperedLM

# fewer layers than this: tracing them all costs little more than tracing three
MIN_LAYERS = 5
_SEED = 20261128


def _layers(model: nn.Module, path: str) -> nn.ModuleList:
    return cast(nn.ModuleList, model.get_submodule(path))


def _tensor(layer: nn.Module, path: str) -> torch.Tensor:
    try:
        return layer.get_parameter(path)
    except AttributeError:
        return layer.get_buffer(path)


def _settings(module: nn.Module) -> dict:
    """A module's plain attributes, by name."""
    out = {}
    for key, value in vars(module).items():
        if key.startswith("_") or isinstance(value, (nn.Module, torch.Tensor)):
            continue
        if isinstance(value, types.MethodType):  # bound to this module: compare what it runs
            value = value.__func__
        elif isinstance(value, functools.partial):  # made per module (transformers' activations): compare its parts
            value = (value.func, value.args, value.keywords)
        out[key] = value
    return out


def _same_settings(reference: dict, other: dict, reference_index: int, index: int) -> bool:
    """Whether layer `index`'s module has the settings of layer `reference_index`'s but for its layer index."""
    if reference.keys() != other.keys():
        return False
    for key, value in reference.items():
        try:
            same = bool(value == other[key])
        except Exception:  # noqa: BLE001 - a value whose == does not answer (a tensor inside a list)
            same = False
        if not same and not (type(value) is int and value == reference_index and other[key] == index):
            return False
    return True


def _differs(reference: nn.Module, other: nn.Module, reference_index: int, index: int) -> str | None:
    """Where layer `index` differs from layer `reference_index` beyond its index, or None."""
    mine, theirs = dict(reference.named_modules()), dict(other.named_modules())
    if mine.keys() != theirs.keys():
        return f"its modules ({sorted(mine.keys() ^ theirs.keys())[0]})"
    for path, module in mine.items():
        if type(module) is not type(theirs[path]):
            return f"{path or 'the layer'} is a {type(theirs[path]).__name__}"
        if not _same_settings(_settings(module), _settings(theirs[path]), reference_index, index):
            return f"the settings of {path or 'the layer'}"
    tensors = dict([*reference.named_parameters(), *reference.named_buffers()])
    others = dict([*other.named_parameters(), *other.named_buffers()])
    if tensors.keys() != others.keys():
        return "its weights"
    for path, t in tensors.items():
        u = others[path]
        if (t.shape, t.dtype) != (u.shape, u.dtype):
            return f"the shape of {path}"
        if not t.is_floating_point() and not torch.equal(t, u):  # a flag or an index table: a setting
            return f"the values of {path}"
    return None


def _unlike(layers: list[nn.Module], layer_types: list[str] | None, first: int) -> tuple[int, str] | None:
    """The first layer after `first` unlike it, and how, or None: every layer from `first` on is alike."""
    for index in range(first + 1, len(layers)):
        if layer_types is not None and layer_types[index] != layer_types[first]:
            return index, f"layer {index} is of type {layer_types[index]}, layer {first} of {layer_types[first]}"
        where = _differs(layers[first], layers[index], first, index)
        if where is not None:
            return index, f"layer {index} differs from layer {first} in {where}"
    return None


def _pattern(model: TaperedLM) -> int | str:
    """The first of the two layers the trace holds with random weights, the pattern of every layer after them: layer
    1, or the first after those unlike the rest (DeepSeek-V3's dense layers); or why there is none."""
    path = model.layers_path
    if path is None:
        return "the model names no list of layers"
    layers = list(_layers(model, path))
    if len(layers) < MIN_LAYERS:
        return f"{len(layers)} layers: tracing them all costs little more"
    layer_types = model.layer_types()
    first, why = 1, ""
    while len(layers) - first >= MIN_LAYERS - 1:  # two layers traced as the pattern, two stamped out at least
        unlike = _unlike(layers, layer_types, first)
        if unlike is None:
            return first
        first, why = unlike  # the layers before the one unlike are traced as they are
    kinds = set(layer_types[1:]) if layer_types is not None else set()
    if len(kinds) > 1:
        return f"its layers are of {len(kinds)} types ({', '.join(sorted(kinds))})"
    return why  # the loop ran: MIN_LAYERS layers or more


def why_trace_every_layer(model: TaperedLM) -> str | None:
    """Why export must trace each of the model's layers (they differ, or there are too few to gain), or None: its
    first layers are enough (few_layer_model)."""
    pattern = _pattern(model)
    return pattern if isinstance(pattern, str) else None


def few_layer_model(model: TaperedLM, scope: str) -> tuple[TaperedLM, LayerWeights]:
    """The model export traces in place of `model`, and what StampLayersPass needs to make `model`'s graph from that
    trace: the layers' module path in the graph is `scope`."""
    first = _pattern(model)
    assert model.layers_path is not None and isinstance(first, int)  # why_trace_every_layer said so
    layers = _layers(model, model.layers_path)
    stamp = LayerWeights(
        scope=scope,
        count=len(layers),
        traced=lambda i, path: TorchTensor(_tensor(copies[i], path).detach()),
        real=lambda i, path: TorchTensor(_tensor(layers[i], path).detach()),
        first=first,
    )
    traced = model.with_first_layers(stamp.in_trace)
    copies = _layers(traced, model.layers_path)
    generator = torch.Generator().manual_seed(_SEED)
    with torch.no_grad():
        for index in (stamp.first, stamp.template):  # the layers before keep the model's weights
            copies[index] = layer = copy.deepcopy(copies[index])  # weights of its own: the model keeps its
            for t in [*layer.parameters(), *layer.buffers()]:
                if t.is_floating_point():  # distinct values, none of them 0 or 1 (which an optimizer may drop)
                    noise = torch.rand(t.shape, generator=generator, dtype=torch.float64)
                    t.copy_(0.5 + noise)
    return traced, stamp
