"""Export's three-layer trace: which models it serves, and the model it traces (passes/stamp_layers.py stamps out
the rest of the layers from that trace).

A model qualifies when its layers are alike: the same modules, weights of the same shapes, the same settings (a
module's plain attributes, its integer and boolean buffers, and transformers' `layer_types`), differing in their
layer index alone. The model traced is the model cut to its first three layers: layer 0 shares the model's tensors,
layers 1 and 2 are copies holding distinct random values (passes/stamp_layers.py says why).
"""

from __future__ import annotations

import copy
import functools
import types
from typing import cast

import torch
from onnx_ir.tensor_adapters import TorchTensor
from torch import nn

from taperfold.passes.stamp_layers import FIRST, TEMPLATE, TRACED, LayerWeights
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


def _same_settings(first: dict, other: dict, index: int) -> bool:
    """Whether layer `index`'s module has layer 0's settings but for its layer index (0 in layer 0, `index` in it)."""
    if first.keys() != other.keys():
        return False
    for key, value in first.items():
        try:
            same = bool(value == other[key])
        except Exception:  # noqa: BLE001 - a value whose == does not answer (a tensor inside a list)
            same = False
        if not same and not (type(value) is int and value == 0 and other[key] == index):
            return False
    return True


def _differs(first: nn.Module, other: nn.Module, index: int) -> str | None:
    """Where layer `index` differs from layer 0 beyond its index, or None."""
    mine, theirs = dict(first.named_modules()), dict(other.named_modules())
    if mine.keys() != theirs.keys():
        return f"its modules ({sorted(mine.keys() ^ theirs.keys())[0]})"
    for path, module in mine.items():
        if type(module) is not type(theirs[path]):
            return f"{path or 'the layer'} is a {type(theirs[path]).__name__}"
        if not _same_settings(_settings(module), _settings(theirs[path]), index):
            return f"the settings of {path or 'the layer'}"
    tensors = dict([*first.named_parameters(), *first.named_buffers()])
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


def why_trace_every_layer(model: TaperedLM) -> str | None:
    """Why export must trace each of the model's layers (its layers differ, or there are too few to gain), or None:
    three are enough."""
    path = model.layers_path
    if path is None:
        return "the model names no list of layers"
    layers = list(_layers(model, path))
    if len(layers) < MIN_LAYERS:
        return f"{len(layers)} layers: tracing them all costs little more"
    layer_types = model.layer_types()
    if layer_types is not None and len(set(layer_types)) > 1:
        return f"its layers are of {len(set(layer_types))} types ({', '.join(sorted(set(layer_types)))})"
    for index, layer in enumerate(layers[1:], start=1):
        where = _differs(layers[0], layer, index)
        if where is not None:
            return f"layer {index} differs from layer 0 in {where}"
    return None


def few_layer_model(model: TaperedLM, scope: str) -> tuple[TaperedLM, LayerWeights]:
    """The model export traces in place of `model`, and what StampLayersPass needs to make `model`'s graph from that
    trace: the layers' module path in the graph is `scope`."""
    assert model.layers_path is not None  # why_trace_every_layer said so
    traced = model.with_first_layers(TRACED)
    copies = _layers(traced, model.layers_path)
    generator = torch.Generator().manual_seed(_SEED)
    with torch.no_grad():
        for index in (FIRST, TEMPLATE):  # layer 0 keeps the model's weights
            copies[index] = layer = copy.deepcopy(copies[index])  # weights of its own: the model keeps its
            for t in [*layer.parameters(), *layer.buffers()]:
                if t.is_floating_point():  # distinct values, none of them 0 or 1 (which an optimizer may drop)
                    noise = torch.rand(t.shape, generator=generator, dtype=torch.float64)
                    t.copy_(0.5 + noise)
    layers = _layers(model, model.layers_path)
    return traced, LayerWeights(
        scope=scope,
        count=len(layers),
        traced=lambda i, path: TorchTensor(_tensor(copies[i], path).detach()),
        real=lambda i, path: TorchTensor(_tensor(layers[i], path).detach()),
    )
