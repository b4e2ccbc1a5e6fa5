"""A family for a model_type taperfold does not ship, found by tracing the model (generic tapering).

transformers' own model class for the config (never code from a directory) is built on the meta device and
traced once with torch.export (a forward on a tiny input, no weights read), keeping each norm module's call
signature: the exact graph value it reads and the one it returns. Then, for each norm:

- its readers: the linear layers reading its output directly, through steps that only move rows (views and
  reshapes keeping the last axis, slices and selections of other axes, a row copied per expert, casts). A linear
  layer is a module, a weight F.linear applies, or MoE experts' stacked matrices, applied as transformers' batched
  experts (the form export runs) apply them. Every reader a linear layer: the norm folds forwards into them
  (`Family.internal`);
- otherwise its producer: a norm whose input is one linear layer's output that nothing else reads, and whose
  output keeps its channels (no per-head split), folds backwards into it (`Family.post`: Gemma 2's sandwich);
- otherwise it is left untapered, with the reader that stops it (a residual Add reading the normed value, a
  per-head reshape, attention).

The head is the model's output embeddings; the final norm is the norm it alone reads. A norm's kind and gain
are measured, not guessed from its class name: on a random input, its output is compared with each norm kind's
own module with γ and with 1 + γ (Gemma's gain). The final norm's kind is the family's; a norm of another kind
or gain is left untapered. What a family lists per layer must hold in every layer; a norm whose readers differ
between layers is left untapered.

The result is a plain `Family` (`traced=True`), stored as data in a tapered directory's `taperfold` block
(taperfold.families.serialize), so export and verify read it instead of tracing again; `check_family_paths` checks
one read back against the model config.json describes.
"""

from __future__ import annotations

import copy
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from taperfold.errors import TaperfoldError, first_line
from taperfold.families import Family, is_registered, supported_model_types
from taperfold.hf.config_values import context_length, language_config
from taperfold.hf.model import exportable
from taperfold.nn import Gating, TaperGate
from taperfold.norms import is_norm_module, norm_kind, norm_kinds
from taperfold.taper import fold_target, stored_in_out

GUIDE = "docs/hf.md, section 'Adding a family'"  # where a refusal sends the user
TRACE_TOKENS = 8  # a tiny input: the graph, not the numbers, is what tracing is for
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
_CONFIG_EPS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
_HARD_CODED_EPS = (1e-5, 1e-6, 1e-8, 1e-12)  # tried, measured, for a norm that states none (OLMo's LayerNorm)


def family_for_model(model: nn.Module, where: str = "model") -> Family:
    """The family of a transformers model: the shipped (or registered) one for its model_type, else one traced
    from transformers' own class for its config. `TaperfoldError` naming `where` when neither is possible."""
    from taperfold.families import family_for

    config = model.config
    model_type = getattr(config, "model_type", None)
    if is_registered(model_type):
        family = family_for(model_type, where)
        why_not = family.check(config)
        if why_not:
            raise TaperfoldError(f"{where}: {why_not}")
        return family.for_config(config)
    return traced_family(config, where)


# ---- measuring a norm module ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormBehaviour:
    kind: str | None  # the norm kind whose module computes the same, or None
    gain_offset: float  # 1.0: it computes x·(1 + γ)
    eps: float | None
    why_not: str = ""  # when kind is None
    gating: Gating | None = None  # a gated norm: how it applies its gate input (forward(x, z))


def _eps_of(module: nn.Module, config) -> tuple[float | None, bool]:
    """The epsilon of a norm module, and whether the module itself says it (else config.json's)."""
    for attr in _EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), True
    for key in _CONFIG_EPS:
        value = getattr(language_config(config), key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), False
    return None, False


def _gatings(dim: int) -> list[Gating]:
    """Every gated form a gated norm of width `dim` may compute, ungrouped first."""
    groups = [g for g in range(1, dim + 1) if dim % g == 0]
    return [Gating(act, first, g) for g in groups for first in (True, False) for act in ("silu", "sigmoid")]


def measure_norm(module: nn.Module, config) -> NormBehaviour:
    """Which norm kind `module` computes, with which gain: its output on a random input against each kind's own
    module with γ and with 1 + γ (a CPU copy with random γ and β; the model itself may be on the meta device).
    A module whose forward takes a gate input too (RMSNormGated: forward(x, z)) is first compared, on (x, z), with
    the kinds' tapered modules with a gate input (at g = 1: the norm itself) in each gated form."""
    weight = getattr(module, "weight", None)
    shape = tuple(getattr(module, "normalized_shape", ()) or ())
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        dim = weight.shape[0]
    elif weight is None and len(shape) == 1:
        dim = shape[0]
    else:
        return NormBehaviour(None, 0.0, None, "no per-feature weight (a norm over several axes or per head)")
    eps, own = _eps_of(module, config)
    gen = torch.Generator().manual_seed(0)
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    with torch.no_grad():
        for name, tensor in [*probe.named_parameters(), *probe.named_buffers()]:
            if name.endswith("weight"):
                tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
            elif tensor.is_floating_point():
                tensor.copy_(torch.rand(tensor.shape, generator=gen) * 0.2 - 0.1)
    # off-centre, at two scales: a LayerNorm and an RMSNorm differ, and at the small one so do epsilons
    x = torch.randn(2, 3, dim, generator=gen) * 3 + 0.5
    x = torch.cat([x, x * 1e-3])
    z = torch.randn(x.shape, generator=gen) * 2  # a gate input
    gain = getattr(probe, "weight", None)
    gain = torch.ones(dim) if gain is None else gain.detach()
    bias = getattr(probe, "bias", None)
    # a module stating none: config.json's, then the usual ones, each measured
    epsilons = [e for e in ([eps] if own else [eps, *_HARD_CODED_EPS]) if e is not None]

    def computes(inputs: tuple) -> torch.Tensor | str:
        try:
            with torch.no_grad():
                got = probe(*inputs)
        except Exception as e:  # noqa: BLE001 - any module: what it raises says why it is not a plain norm
            return f"its forward on a [batch, tokens, {dim}] input failed ({first_line(e)})"
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            return "it does not return one tensor of its input's shape"
        return got

    # a gate input first: a gated norm called without one may compute a plain norm
    gated = computes((x, z))
    if isinstance(gated, torch.Tensor) and not isinstance(bias, torch.Tensor):
        for candidate in epsilons:
            for kind in (k for k in norm_kinds() if k.gated and k.tapered_with_gate is not None and not k.shift):
                for offset in (0.0, 1.0) if kind.gain_offset_allowed else (0.0,):
                    for gating in _gatings(dim):
                        reference = kind.new_tapered(dim, TaperGate(1.0), candidate, 0.01, 1e-8, offset, gating)
                        with torch.no_grad():
                            reference.get_parameter("weight").copy_(gain)
                            if torch.allclose(gated, reference(x, z), rtol=1e-4, atol=1e-5):
                                return NormBehaviour(kind.name, offset, candidate, gating=gating)
    got = computes((x,))
    if isinstance(got, torch.Tensor):
        for candidate in epsilons:
            for kind in (k for k in norm_kinds() if k.gated):
                for offset in (0.0, 1.0):
                    reference = kind.plain(dim, candidate)
                    with torch.no_grad():
                        reference.get_parameter("weight").copy_(gain + offset)
                        if kind.shift:
                            reference.get_parameter("bias").copy_(
                                bias.detach() if isinstance(bias, torch.Tensor) else torch.zeros(dim)
                            )
                        elif isinstance(bias, torch.Tensor):
                            continue  # a β the kind has no place for
                        if torch.allclose(got, reference(x), rtol=1e-4, atol=1e-5):
                            return NormBehaviour(kind.name, offset, candidate)
    if isinstance(got, str) and isinstance(gated, str):
        return NormBehaviour(None, 0.0, eps, got)
    return NormBehaviour(
        None,
        0.0,
        eps,
        "it computes neither an RMSNorm nor a LayerNorm of its input (with γ or "
        "1 + γ" + ("" if own else ", at any usual epsilon") + "), nor a gated RMSNorm",
    )


# ---- the traced graph ---------------------------------------------------------------------------------------

aten = torch.ops.aten
# Steps that move rows (tokens) and keep each value's channel: what lies between a norm and a layer it feeds.
_LAYOUT = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.expand.default,
    aten.flatten.using_ints,
    aten.index.Tensor,
    aten.index_select.default,
    aten.transpose.int,
    aten.permute.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.type_as.default,
    aten.dropout.default,
    aten.repeat_interleave.self_int,
    aten.repeat.default,
}
# Steps between a weight and the linear op using it: casts and an expert's selection, and transposes (counted).
_WEIGHT_STEPS = {
    aten.select.int,
    aten.index.Tensor,
    aten.to.dtype,
    aten.to.dtype_layout,
    aten._to_copy.default,
    aten.alias.default,
    aten.detach.default,
    aten.contiguous.default,
}
_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int}
# linear op -> (index of its input, index of its weight, whether it takes the weight as [in, out])
_LINEAR = {
    aten.linear.default: (0, 1, False),
    aten.addmm.default: (1, 2, True),
    aten.mm.default: (0, 1, True),
    aten.matmul.default: (0, 1, True),
    aten.bmm.default: (0, 1, True),
}


def _shape(node) -> tuple | None:
    value = node.meta.get("val") if hasattr(node, "meta") else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _keeps_channels(node, source) -> bool:
    """Whether `node`, reading `source` as its data input, keeps every row's channels in its last axis."""
    if node.target not in _LAYOUT or not node.args or node.args[0] is not source:
        return False
    before, after = _shape(source), _shape(node)
    if not before or not after or before[-1] != after[-1]:
        return False
    last = len(before) - 1
    if node.target in (aten.slice.Tensor, aten.select.int, aten.index_select.default):
        dim = node.args[1] if len(node.args) > 1 else 0
        return dim % len(before) != last
    if node.target is aten.repeat_interleave.self_int:  # each row copied: MoE experts take a token once per expert
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        return dim is not None and dim % len(before) != last
    if node.target is aten.repeat.default:  # whole rows repeated (Llama 4 copies each token once per expert)
        return list(node.args[1])[-1] == 1
    if node.target is aten.index.Tensor:
        return len(node.args[1]) <= last  # the indices address leading axes only
    if node.target is aten.transpose.int:
        return last not in (node.args[1] % len(before), node.args[2] % len(before))
    if node.target is aten.permute.default:
        return node.args[1][-1] % len(before) == last
    if node.target is aten.flatten.using_ints:
        end = node.args[2] if len(node.args) > 2 else -1
        return end % len(before) != last
    return True  # views, reshapes, expands, (un)squeezes and casts keeping the last axis's size keep its channels


_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _joins_rows(node, source) -> int:
    """k > 1 when `node` reshapes `source` so that its last axis holds k of its rows one after another (a norm
    applied per head, whose heads are joined again before the layer reading them: Qwen3-Next's gated norm); else 1.
    In row-major order the channel of element j of that axis is then j mod d: the norm's scale, repeated k times."""
    if node.target not in _RESHAPES or not node.args or node.args[0] is not source:
        return 1
    before, after = _shape(source), _shape(node)
    if not before or not after or not all(isinstance(n, int) for n in (before[-1], after[-1])):
        return 1
    return after[-1] // before[-1] if after[-1] > before[-1] and after[-1] % before[-1] == 0 else 1


def _scales_rows(node, source) -> bool:
    """Whether `node` multiplies (or divides) each row of `source` by one number of that row's ([..., 1] against
    [..., d]), or all of it by one number (Falcon-H1's µP multipliers, MiniCPM3's logits_scaling before the head)."""
    if len(node.args) != 2 or source not in node.args:
        return False
    if node.target is aten.div.Tensor and node.args[0] is source:
        other = node.args[1]
    elif node.target is aten.mul.Tensor:
        other = node.args[1] if node.args[0] is source else node.args[0]
    else:
        return False
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return True
    before, factor = _shape(source), _shape(other) if hasattr(other, "meta") else None
    return bool(before and factor and factor[-1] == 1 and len(factor) <= len(before) and _shape(node) == before)


def _scope(node) -> str | None:
    """The innermost module a graph node ran in."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else None


def _in_module(node, path: str) -> bool:
    return any(value[0] == path for value in (node.meta.get("nn_module_stack") or {}).values())


def _linear_layer_class(module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))


def _stores_in_out(module) -> bool:
    """GPT-2's Conv1D stores its weight [in, out]; nn.Linear [out, in]."""
    return not isinstance(module, nn.Linear)


class _Graph:
    """The traced forward, with what a placeholder of it stands for."""

    def __init__(self, program, model: nn.Module):
        self.graph, self.model = program.graph, model
        signature = program.graph_signature
        self.parameters = dict(signature.inputs_to_parameters)
        self.nodes = {node.name: node for node in self.graph.nodes}
        self.position = {node: i for i, node in enumerate(self.graph.nodes)}

    def parameter(self, node) -> tuple[str | None, bool]:
        """The parameter a linear op's weight argument is (through casts, expert selections and transposes), and
        whether it was transposed on the way."""
        transposed = False
        while node.op == "call_function" and (node.target in _WEIGHT_STEPS or node.target in _TRANSPOSES):
            if node.target is aten.transpose.int:
                rank = len(_shape(node) or ())
                if {node.args[1] % rank, node.args[2] % rank} != {rank - 2, rank - 1}:
                    return None, False  # not a matrix transpose
            transposed ^= node.target in _TRANSPOSES
            node = node.args[0]
        return (self.parameters.get(node.name) if node.op == "placeholder" else None), transposed

    def linear_reader(self, node, value) -> str | None:
        """The path of the linear layer `node` applies to `value` (a module: nn.Linear / Conv1D, or a weight that
        F.linear applies: a router's, stacked experts'), or None when `node` is no such layer."""
        spec = _LINEAR.get(node.target)
        if spec is None or len(node.args) <= spec[1] or node.args[spec[0]] is not value:
            return None
        weight, transposed = self.parameter(node.args[spec[1]])
        if weight is None:
            return None  # a product of two activations: attention
        as_in_out = spec[2] != transposed  # how the parameter itself is laid out, as this op reads it
        scope = _scope(node)
        try:
            module = self.model.get_submodule(scope) if scope else None
        except AttributeError:
            module = None
        if (
            module is not None
            and _linear_layer_class(module)
            and module.weight is self.model.get_parameter(weight)
            and as_in_out == _stores_in_out(module)
        ):
            return scope
        if not as_in_out and self.model.get_parameter(weight).dim() >= 2:
            return weight  # F.linear(x, W): W is [..., out, in]
        width = (_shape(value) or (None,))[-1]
        if as_in_out and self.model.get_parameter(weight).dim() >= 3 and stored_in_out(self.model, weight, width):
            return weight  # x @ W[experts]: a stack of [in, out] matrices (gpt-oss says so; Llama 4's shape does)
        return None

    def column_reader(self, node, value) -> str | None:
        """The stacked weight W that `node`, a trailing unsqueeze of `value`, feeds as bmm(W[experts], x[..., None]):
        [..., out, in] matrices applied to columns, as transformers' batched MoE experts apply theirs."""
        if (
            node.target is not aten.unsqueeze.default
            or node.args[0] is not value
            or _shape(node) != (*(_shape(value) or ()), 1)
        ):
            return None
        weights = set()
        for user in node.users:
            if user.target is not aten.bmm.default or user.args[1] is not node:
                return None
            weight, transposed = self.parameter(user.args[0])
            if weight is None or transposed:
                return None
            weights.add(weight)
        return weights.pop() if len(weights) == 1 else None

    def readers(self, output, rows_scale: bool = False) -> tuple[list[str], list[str], int]:
        """The linear layers reading `output` through channel-keeping steps, in the order the forward runs them,
        every other reader (described), and how many of the norm's rows each of their input rows joins (1, or a
        per-head norm's heads: `_joins_rows`). `rows_scale`: a product of each row with one number of its own (a
        router's score, Llama 4) keeps channels too, which it does for a norm without a shift: (h·diag(s))·r =
        (h·r)·diag(s), where a shift β would be scaled by r as well; the same holds for joining rows."""
        linears, others, todo, seen = [], [], [(output, 1)], set()
        while todo:
            value, joined = todo.pop()
            for user in value.users:
                if user in seen:
                    continue
                seen.add(user)
                if user.op == "output":
                    others.append("the model's output")
                elif _keeps_channels(user, value) or (rows_scale and _scales_rows(user, value)):
                    todo.append((user, joined))
                elif rows_scale and joined == 1 and (heads := _joins_rows(user, value)) > 1:
                    todo.append((user, heads))
                elif (reader := self.linear_reader(user, value) or self.column_reader(user, value)) is not None:
                    linears.append((self.position[user], reader, joined))
                elif not _reads_metadata_only(user, value):
                    others.append(_describe(user, value))
        if len({joined for _, _, joined in linears}) > 1:
            others.append("layers that read it with its heads joined and layers that read it per head")
        heads = max((joined for _, _, joined in linears), default=1)
        return list(dict.fromkeys(reader for _, reader, _ in sorted(linears))), list(dict.fromkeys(others)), heads

    def producer(self, norm_input, norm: str) -> str | None:
        """The linear layer whose output, and nothing else, the norm at `norm` reads (through channel-keeping
        steps), or None."""
        value, came_from = norm_input, None
        while True:
            if not _read_only_by(value, norm, came_from) or value.op != "call_function":
                return None
            spec = _LINEAR.get(value.target)
            if spec is not None:
                return self.linear_reader(value, value.args[spec[0]])
            if not value.args or not _keeps_channels(value, value.args[0]):
                return None
            came_from, value = value, value.args[0]


def _reads_metadata_only(node, value) -> bool:
    """Whether `node` reads only `value`'s dtype and shape: a check, or the dtype a type_as casts to."""
    return node.target is aten._assert_tensor_metadata.default or (
        node.target is aten.type_as.default and node.args[0] is not value
    )


def _read_only_by(value, norm: str, came_from) -> bool:
    """Whether `value` is read by `came_from` and the norm's own nodes only, counting what reads the norm's
    copies and casts of it (export may hand the residual Add the norm's float32 cast of its input)."""
    for user in value.users:
        if user is came_from or _reads_metadata_only(user, value):
            continue
        if not _in_module(user, norm):
            return False
        if _keeps_channels(user, value) and not _read_only_by(user, norm, None):
            return False
    return True


def _describe(node, value) -> str:
    op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    where = _scope(node) or "the model"
    if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default) and node.args[0] is value:
        return f"a reshape to {list(_shape(node) or ())} in {where} (a per-head split)"
    if node.target is aten.scaled_dot_product_attention.default:
        return f"attention in {where}"
    return f"{op} in {where}"


def _trace(model: nn.Module, norms: list[str], config):
    """torch.export of `model` (on the meta device) on a tiny input, keeping each norm's call signature."""
    tokens = min(TRACE_TOKENS, context_length(language_config(config)) or TRACE_TOKENS)
    input_ids = torch.zeros(2, tokens, dtype=torch.long, device="meta")
    return torch.export.export(
        model,
        (),
        {"input_ids": input_ids, "use_cache": False},
        strict=False,
        preserve_module_call_signature=tuple(norms),
    )


# ---- the family -------------------------------------------------------------------------------------------


def shipped_note() -> str:
    return f"taperfold ships families for {', '.join(supported_model_types())}"


def _refuse(where: str, model_type: str, why: str) -> TaperfoldError:
    return TaperfoldError(
        f"{where}: key 'model_type' is {model_type!r}, for which no family is shipped "
        f"({shipped_note()}), and tracing its model found none: {why}; {GUIDE} says how to add one"
    )


class _InLayer(NamedTuple):
    """Where a module path lies in a ModuleList of layers."""

    layers: str  # the ModuleList's path
    layer: int  # the layer's index in it
    inner: str  # the path inside the layer
    size: int  # the layers in the list


def _layer_of(path: str, model: nn.Module) -> _InLayer | None:
    """Where a module path inside a ModuleList lies in it, else None."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit():
            layers = model.get_submodule(".".join(parts[:i]))
            if isinstance(layers, nn.ModuleList):
                return _InLayer(".".join(parts[:i]), int(parts[i]), ".".join(parts[i + 1 :]), len(layers))
    return None


def traced_family(config, where: str = "model") -> Family:
    """The family of transformers' own model for `config`, found by tracing it (see the module docstring)."""
    model_type = config.model_type

    def refuse(why: str) -> TaperfoldError:
        return _refuse(where, model_type, why)

    model, head_path = _meta_model(config, refuse)
    candidates = [name for name, module in model.named_modules() if is_norm_module(module)]
    behaviour = {name: measure_norm(model.get_submodule(name), config) for name in candidates}
    kinds = {name: b.kind for name, b in behaviour.items() if b.kind is not None}  # the norms measured, in order
    # why each norm that does not fold is left untapered, filled in by each step below
    why: dict[str, str] = {name: behaviour[name].why_not for name in candidates if name not in kinds}
    try:
        program = _trace(model, list(kinds), config)
    except Exception as e:  # noqa: BLE001 - torch.export raises many types for code it cannot take
        raise refuse(f"torch.export cannot trace it ({type(e).__name__}: {first_line(e)})") from None
    targets = _fold_targets(program, model, behaviour, kinds, why)

    final = next((name for name, rs in targets.readers.items() if rs == [head_path]), None)
    if final is None:
        raise refuse(f"no norm is read by the head ({head_path}) alone")
    kind, offset = kinds[final], behaviour[final].gain_offset
    if offset and not norm_kind(kind).gain_offset_allowed:
        raise refuse(
            f"its norms compute a {norm_kind(kind).title} with gain 1 + γ, which "
            f"taperfold's tapered {norm_kind(kind).title} does not"
        )
    for name in [*targets.readers, *targets.producers]:
        if kinds[name] != kind:  # a gain of its own (1 + γ or γ) the norm keeps (Qwen3-Next's gated norm: γ)
            why[name] = f"a {norm_kind(kinds[name]).title}, while the final norm is a {norm_kind(kind).title}"
    placed = [name for name in [*targets.readers, *targets.producers] if name not in why and name != final]

    layers = _layer_of(placed[0], model) if placed else None
    if layers is None:
        raise refuse("no norm inside its decoder layers folds into a linear layer")
    per_layer = _per_layer_folds(model, placed, layers.layers, targets, behaviour, why)
    folds = _shared_folds(model, per_layer.folds, layers, why)
    if not folds.internal and not folds.post and not folds.layer_readers and not folds.layer_producers:
        raise refuse("no norm folds alike in every decoder layer that has it")
    kept = set(folds.internal) | set(folds.post) | folds.placed_somewhere
    own = _eps_of(model.get_submodule(final), config)[1]
    return Family(
        name=model_type,
        model_types=(model_type,),
        norm=kind,
        layers=layers.layers,
        internal=folds.internal,
        final=final,
        post=folds.post,
        head=head_path,
        gain_offset=offset,
        untapered=_untapered(model, why, layers.layers),
        norm_eps=None if own else behaviour[final].eps,
        traced=True,
        layer_readers=folds.layer_readers,
        layer_producers=folds.layer_producers,
        gated={relative: gating for relative, gating in per_layer.gated.items() if relative in kept},
        heads=folds.joined,
        gain_offsets={
            relative: gain for relative, gain in per_layer.offsets.items() if gain != offset and relative in kept
        },
    )


def _meta_model(config, refuse) -> tuple[nn.Module, str]:
    """transformers' own causal LM for `config`, built on the meta device in the form export runs, and its head's
    module path."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise refuse("transformers has no causal LM class for it")
    try:
        with torch.device("meta"):
            model = exportable(AutoModelForCausalLM.from_config(config).eval())  # MoE experts as export runs them
    except Exception as e:  # noqa: BLE001 - transformers' constructors raise many types for a config they refuse
        raise refuse(f"transformers cannot build it ({first_line(e)})") from None
    head = model.get_output_embeddings()
    head_path = next((name for name, module in model.named_modules() if module is head), None) if head else None
    if head_path is None:
        raise refuse("the model has no output embeddings (head)")
    return model, head_path


class _FoldTargets(NamedTuple):
    readers: dict[str, list[str]]  # a norm that folds forwards -> the linear layers reading it
    producers: dict[str, str]  # a norm that folds backwards -> the linear layer it reads
    heads: dict[str, int]  # a norm applied per head -> the heads its readers join


def _fold_targets(program, model: nn.Module, behaviour, kinds: dict, why: dict[str, str]) -> _FoldTargets:
    """Where each measured norm folds in the traced graph: into the linear layers reading it, else into the one it
    reads; `why` gets the reason for each that folds into neither."""
    graph = _Graph(program, model)
    signatures = {entry.fqn: entry.signature for entry in program.module_call_graph if entry.signature}
    targets = _FoldTargets({}, {}, {})
    for name in kinds:
        signature = signatures.get(name)
        arguments = (1, 2) if behaviour[name].gating else (1,)  # a gated norm: its input and its gate input
        if signature is None:  # a multimodal model's vision tower, a branch for longer inputs (DeepSeek-V4's)
            why[name] = f"not called by a text-only forward of {TRACE_TOKENS} tokens"
            continue
        if len(signature.inputs) not in arguments or len(signature.outputs) != 1:
            why[name] = "not called once on one tensor in the forward"
            continue
        norm_input = graph.nodes.get(signature.inputs[0].name)
        output = graph.nodes.get(signature.outputs[0].name)
        linears, others, targets.heads[name] = graph.readers(output, rows_scale=not norm_kind(kinds[name]).shift)
        if linears and not others:
            targets.readers[name] = linears
            continue
        split = [o for o in others if "per-head" in o or o.startswith("attention")]
        producer = graph.producer(norm_input, name) if norm_input is not None and not split else None
        if producer is not None:
            targets.producers[name] = producer
        else:
            read_by = " and ".join(others[:3]) if others else "nothing"
            why[name] = f"its output is read by {read_by}, not only by linear layers" + (
                "" if split or norm_input is None else ", and its input is not one linear layer's output alone"
            )
    return targets


class _PerLayer(NamedTuple):
    folds: dict[str, dict[int, tuple]]  # path in a layer -> layer -> (forwards, targets in the layer, heads joined)
    gated: dict[str, Gating]  # path in a layer -> how that gated norm applies its gate input
    offsets: dict[str, float]  # path in a layer -> its gain offset


def _per_layer_folds(
    model: nn.Module, placed: list[str], layers_path: str, targets: _FoldTargets, behaviour, why: dict[str, str]
) -> _PerLayer:
    """How each norm that folds does so in each decoder layer, its targets named within the layer; `why` gets the
    reason for each that folds outside its layer or unlike itself in other layers."""
    found = _PerLayer(defaultdict(dict), {}, {})
    for name in placed:
        where_in = _layer_of(name, model)
        if where_in is None or where_in.layers != layers_path:
            why[name] = f"outside the decoder layers ({layers_path})"
            continue
        prefix = f"{layers_path}.{where_in.layer}."
        into = targets.readers.get(name) or [targets.producers[name]]
        if not all(t.startswith(prefix) for t in into):
            why[name] = f"it folds into {', '.join(into)}, outside its own layer"
            continue
        gating = behaviour[name].gating
        if gating is not None and found.gated.setdefault(where_in.inner, gating) != gating:
            why[name] = "a gated norm whose gate input is applied differently in another layer"
            continue
        if found.offsets.setdefault(where_in.inner, behaviour[name].gain_offset) != behaviour[name].gain_offset:
            why[name] = "its gain is 1 + γ in some layers and γ in others"
            continue
        found.folds[where_in.inner][where_in.layer] = (
            name in targets.readers,
            tuple(t[len(prefix) :] for t in into),
            targets.heads.get(name, 1) if name in targets.readers else 1,
        )
    return found


@dataclass
class _SharedFolds:
    internal: dict[str, tuple[str, ...]]  # a norm in every layer -> the readers it folds into, forwards
    post: dict[str, str]  # a norm in every layer -> the linear layer it folds into, backwards
    layer_readers: dict[int, dict[str, tuple[str, ...]]]  # a layer whose fold differs -> its own, forwards
    layer_producers: dict[int, dict[str, str]]  # ... and backwards
    joined: dict[str, int]  # a per-head norm in a layer -> the heads its readers join

    @property
    def placed_somewhere(self) -> set[str]:
        """The norms that fold in some layers by a fold of their own."""
        forwards = {relative for by_norm in self.layer_readers.values() for relative in by_norm}
        return forwards | {relative for by_norm in self.layer_producers.values() for relative in by_norm}


def _shared_folds(model: nn.Module, per_norm: dict[str, dict[int, tuple]], layers: _InLayer, why) -> _SharedFolds:
    """The folds of each norm as the family lists them: the one most layers share, and each layer's own where it
    differs (a dense MLP where the others route to experts; a post-norm after attention where other layers read it
    before their MLP); `why` gets the reason for each norm whose readers differ between layers in other ways."""
    layers_path, n_layers = layers.layers, layers.size
    folds = _SharedFolds({}, {}, defaultdict(dict), defaultdict(dict), {})
    for relative, by_layer in per_norm.items():
        everywhere = len(by_layer) == n_layers
        # a norm of some layers only (a hybrid's linear-attention or Mamba layers) folds where it is
        where_it_is = [i for i in range(n_layers) if _has_norm(model, f"{layers_path}.{i}.{relative}")]
        if len({h for _, _, h in by_layer.values()}) > 1:
            reason = "its readers join its heads in some layers only"
        elif not everywhere and sorted(by_layer) != where_it_is:
            reason = "it folds in some layers only"
        else:
            common = Counter((forwards, targets) for forwards, targets, _ in by_layer.values()).most_common(1)[0][0]
            if everywhere:
                forwards, targets = common
                if forwards:
                    folds.internal[relative] = targets
                else:
                    folds.post[relative] = targets[0]
            for index, (forwards, targets, _) in by_layer.items():
                if everywhere and (forwards, targets) == common:
                    continue
                if forwards:
                    folds.layer_readers[index][relative] = targets
                else:
                    folds.layer_producers[index][relative] = targets[0]
            if (heads_joined := next(iter(by_layer.values()))[2]) > 1:
                folds.joined[relative] = heads_joined
            continue
        for index in range(n_layers):
            why[f"{layers_path}.{index}.{relative}"] = reason
    folds.layer_readers, folds.layer_producers = dict(folds.layer_readers), dict(folds.layer_producers)
    return folds


def _untapered(model: nn.Module, why: dict[str, str], layers_path: str) -> dict[str, str]:
    """The family's untapered norms: one reason for a norm inside the decoder layers, said of it in every layer, and
    each other norm by its own path."""
    untapered: dict[str, str] = {}
    for name, reason in why.items():
        in_layer = _layer_of(name, model)
        if in_layer is not None and in_layer.layers == layers_path:
            untapered.setdefault(in_layer.inner, _within_layer(reason, f"{layers_path}.{in_layer.layer}"))
        else:
            untapered[name] = reason
    return untapered


def _within_layer(reason: str, layer: str) -> str:
    """`reason` with the modules of its own layer (`layer`: "model.layers.3") named within that layer, so that it
    reads true of the same norm in every layer."""
    owned = re.compile(rf"(?<![\w.]){re.escape(layer)}(?![\w])(\.?)")
    return owned.sub(lambda m: "its layer's " if m.group(1) else "its layer", reason)


def check_family_paths(model: nn.Module, family: Family, bad) -> None:
    """The modules a stored family names exist in `model` (built from config.json, on the meta device): its
    layers, each norm and what it folds into in every layer, the final norm and the head; `bad(key, why)` makes
    the error otherwise (whether each is a linear layer of the right width, taperfold.taper checks)."""
    try:
        layers = model.get_submodule(family.layers)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList):
        raise bad("family.layers", f"{family.layers!r} is not a list of layers in this {family.name} model")
    for key, by_layer in (("layer_readers", family.layer_readers), ("layer_producers", family.layer_producers)):
        if beyond := [i for i in by_layer if i >= len(layers)]:
            raise bad(f"family.{key}", f"names layer {beyond[0]}; this {family.name} model has {len(layers)}")
    for i in range(len(layers)):
        readers, producers = family.readers_in_layer(i), family.producers_in_layer(i)
        own_readers, own_producers = family.layer_readers.get(i, {}), family.layer_producers.get(i, {})
        for key, folds in (
            ("internal", {n: r for n, r in readers.items() if n not in own_readers}),
            ("layer_readers", own_readers),
            ("post", {n: [p] for n, p in producers.items() if n not in own_producers}),
            ("layer_producers", {n: [p] for n, p in own_producers.items()}),
        ):
            for norm, targets in folds.items():
                if not _has_norm(model, f"{family.layers}.{i}.{norm}"):
                    raise bad(f"family.{key}", f"names {norm!r}, which is not a norm module in layer {i}")
                for target in targets:
                    try:
                        fold_target(model, f"{family.layers}.{i}.{target}")
                    except AttributeError:
                        raise bad(
                            f"family.{key}", f"names {target!r} for {norm!r}, which layer {i} has no layer or weight of"
                        ) from None
    if not _has_norm(model, family.final):
        raise bad("family.final", f"{family.final!r} is not a norm module of this {family.name} model")
    if family.final.startswith(f"{family.layers}."):
        raise bad("family.final", f"{family.final!r} is a norm inside a layer, not the norm after the last layer")
    try:
        head = model.get_submodule(family.head)
    except AttributeError:
        raise bad("family.head", f"{family.head!r} is not a module of this {family.name} model") from None
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    if head is embedding:
        raise bad("family.head", f"{family.head!r} is the input embedding, not the output head")


def _has_norm(model: nn.Module, path: str) -> bool:
    try:
        return is_norm_module(model.get_submodule(path))
    except AttributeError:
        return False
