"""A transformers causal LM behind taperfold's model interface, for export, verify and bench.

taperfold's runners and exporter call `model(input_ids, logits="last"|"all", past_key_values=[(k, v), ...],
use_cache=...)` and read `model.cfg` (vocabulary, context, layers, KV heads). `HFCausalLM` gives a
transformers model that interface and nothing more: every layer runs transformers' own code.

A static KV cache (`cache_position=` with fixed-size buffers, as taperfold's own models take one) runs as
transformers' StaticCache over the given buffers, updated in place.

Sliding-window (and chunked) layers keep every position in the cache, as full-attention layers do, and the window
is applied by the mask alone (transformers' masks take it from the config). transformers' own window layers crop the
cache to the window and count positions in the cache object, which a cache fed back as tensors loses: positions
and the mask would restart at the cropped length once the past outgrows the window. Keeping everything costs memory
past the window, but the decoder's keys are at the positions their index says, for every runtime that feeds them.

Every call is transformers' own forward (`model(input_ids, logits_to_keep=1, ...)`), head included: a family's
logit softcapping (Gemma 2/3) or scaling (Granite, Cohere) is in the graph because the modeling code does it.
MoE experts run as `EXPERTS`, the form the exporters take.
The last position is taken after the final norm, which is a per-token map; a tapered final norm folds through
that Slice into the head (taperfold.passes.readers).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, cast

import torch.nn.functional as F
from torch import nn

from taperfold.families import Family
from taperfold.hf.config_values import (
    attention_window,
    config_value,
    context_length,
    language_config,
    layer_zero,
)
from taperfold.taper import TaperedLM, shared_parameters

if TYPE_CHECKING:  # transformers is the [hf] extra, imported where a model is run
    from transformers import PreTrainedModel

SOURCE = "transformers"
# How transformers' MoE experts run here: `batched_mm` exports with both torch.onnx exporters (the default,
# `grouped_mm`, calls torch.histc, which neither takes) and is the form transformers' own ONNX exporter gives ONNX
# Runtime's MoE fusion. It gathers each token's experts' weights, so a long prompt costs memory in proportion.
EXPERTS = "batched_mm"
# The longest input an attention-free model (Mamba: its config states no context) is exported and verified for
RECURRENT_CONTEXT = 4096
EAGER = "eager"  # transformers' attention as MatMul and Softmax: where torch.onnx fails on a model's SDPA form


def exportable(hf: PreTrainedModel) -> PreTrainedModel:
    """`hf` with its MoE experts (if any) run as `EXPERTS`, in place."""
    if hf._can_set_experts_implementation() and hf.config._experts_implementation != EXPERTS:
        hf.set_experts_implementation(EXPERTS)
    return hf


def position_table_context(hf: PreTrainedModel) -> int | None:
    """The longest input a position table with a padding row takes, where the model has one: RoBERTa's position ids
    count from padding_idx + 1, so max_position_embeddings − padding_idx − 1 tokens (512 of 514), not the table's
    size; else None."""
    for name, module in hf.named_modules():
        if (
            isinstance(module, nn.Embedding)
            and "position" in name.rpartition(".")[2]
            and module.padding_idx is not None
        ):
            return module.num_embeddings - module.padding_idx - 1
    return None


def cached_heads(hf: PreTrainedModel) -> tuple[int, int] | None:
    """(heads, head dim) of the keys `hf` caches, from one two-token forward of a model on the meta device (shapes
    only: no memory, no arithmetic). The modeling code decides what it caches and the config does not always say:
    Falcon-7B's multi-query attention caches one key/value head and its config names none, Falcon-40B caches every
    query head. None where the forward cannot run on the meta device."""
    import torch

    try:
        with torch.no_grad():
            out = exportable(hf)(torch.zeros(1, 2, dtype=torch.long, device="meta"), use_cache=True)
        keys = out["cache" if "cache" in out else "past_key_values"].layers[0].keys
    except Exception:  # noqa: BLE001 - any modeling code; the config's numbers stand in
        return None
    return keys.shape[1], keys.shape[-1]


@contextmanager
def _attention_implementation(hf: PreTrainedModel, implementation: str, default: str) -> Iterator[None]:
    hf.set_attn_implementation(implementation)
    try:
        yield
    finally:
        hf.set_attn_implementation(default)


@dataclass(frozen=True)
class HFModelInfo:
    """What taperfold's tools read of a model's shape (the `config` of a manifest for an HF export)."""

    arch: str  # config.json's model_type
    family: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    kv_heads: int
    head_dim: int
    max_seq_len: int
    taper: str  # "none" | "internal" | "all"
    norm_kind: str
    tie_embeddings: bool
    aux: bool = False
    tokenizer: str = "bytes"  # "bytes" (ids are byte values) or "hf" (the directory's own tokenizer)
    source: str = SOURCE
    # the fewest keys an attention layer sees (a sliding window, a chunk) where fewer than the context, else None
    window: int | None = None

    def __post_init__(self) -> None:
        window = self.window  # read back from a manifest, which is input
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"window must be null or a positive integer, got {window!r}")

    @classmethod
    def from_config(
        cls,
        config,
        family: Family,
        taper: str,
        aux: bool,
        tokenizer: str,
        cache: tuple[int, int] | None = None,
        longest: int | None = None,
        norm: str | None = None,
    ) -> HFModelInfo:
        """`cache`: the (heads, head dim) of the keys the model caches (`cached_heads`), where measured; else the
        config's key/value heads and head dim. `longest`: the longest input the model takes where it is less than
        the context its config states (`position_table_context`). `norm`: the kind in the norms' places where not
        the family's own (DyT: the taperfold block's `norm`)."""
        language = language_config(config)  # a multimodal model's language model: the sizes of what is exported
        heads, kv_heads, head_dim = (  # lists where layers differ (Gemma 4's head_dim): layer 0's
            layer_zero(config_value(language, name))
            for name in ("num_attention_heads", "num_key_value_heads", "head_dim")
        )
        context: int | None = RECURRENT_CONTEXT
        if heads is None:  # attention-free (Mamba): no heads, no KV cache, and a recurrence that takes any length
            heads, kv_heads, head_dim = 0, 0, 0
        else:
            kv_heads, head_dim = cache or (kv_heads or heads, head_dim or language.hidden_size // heads)
            context = context_length(language) or family.context
        if context is not None and longest is not None:
            context = min(context, longest)
        if context is None:  # taperfold.hf.config_check refuses such a config before any model is built
            raise ValueError(
                f"{config.model_type}: no max_position_embeddings, and family {family.name} states no context"
            )
        window = attention_window(config) if heads else None
        return cls(
            arch=config.model_type,
            family=family.name,
            vocab_size=language.vocab_size,
            d_model=language.hidden_size,
            n_layers=language.num_hidden_layers,
            n_heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            max_seq_len=context,
            taper=taper,
            norm_kind=norm or family.norm,
            tie_embeddings=bool(getattr(language, "tie_word_embeddings", False)),
            aux=aux,
            tokenizer=tokenizer,
            window=window if window is not None and window < context else None,
        )

    @classmethod
    def from_dict(cls, d: dict) -> HFModelInfo:
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


class HFCausalLM(TaperedLM, nn.Module):
    """taperfold's interface over a transformers `*ForCausalLM` (see the module docstring)."""

    network_path = "hf"

    cfg: HFModelInfo

    def __init__(self, hf: PreTrainedModel, cfg: HFModelInfo, family: Family):
        super().__init__()
        self.hf, self.cfg, self.family = exportable(hf), cfg, family
        # transformers renamed `past_key_values` (argument and output) to `cache`: 5.24 warns the old name goes in 5.40
        self._cache_argument = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

    @property
    def network(self) -> nn.Module:
        return self.hf

    @property
    def tapering(self):
        return getattr(self.hf, "tapering", None)

    def eager_attention(self) -> AbstractContextManager[None] | None:
        default = self.hf.config._attn_implementation
        if default == EAGER or not self.hf._can_set_attn_implementation():
            return None
        return _attention_implementation(self.hf, EAGER, default)

    def copy(self, shared: bool = False) -> HFCausalLM:
        return HFCausalLM(copy.deepcopy(self.hf, shared_parameters(self.hf) if shared else None), self.cfg, self.family)

    @property
    def layers_path(self) -> str:
        return f"hf.{self.family.layers}"

    def layer_types(self) -> list[str] | None:
        types = config_value(language_config(self.hf.config), "layer_types")
        return list(types) if isinstance(types, (list, tuple)) else None

    def _count_layers(self, count: int) -> None:
        config = language_config(self.hf.config)  # the copy's own: with_first_layers copied the model
        config.num_hidden_layers = count
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:count]
        self.cfg = replace(self.cfg, n_layers=count)

    def loss(self, input_ids, targets):
        """Cross-entropy of transformers' forward on next-token `targets`, and the scale-anchoring loss on the
        final norm's input (zero until its target is frozen)."""
        scale_loss = self.tapering.scale_loss if self.tapering is not None else None
        seen = []
        final = self.hf.get_submodule(self.family.final)
        hook = final.register_forward_pre_hook(lambda module, args: seen.append(args[0])) if scale_loss else None
        try:
            logits = self.hf(input_ids=input_ids, use_cache=False).logits
        finally:
            if hook is not None:
                hook.remove()
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if scale_loss is None:
            return ce, ce.new_zeros(())
        return ce, scale_loss.to(seen[0].device)(seen[0], track=self.training and self.gate.calibrating)

    def _cache(self, past_key_values, use_cache: bool):
        """The growing cache holding `past_key_values` (empty where None and `use_cache`: the prompt's call)."""
        from transformers import DynamicCache

        if past_key_values is None and not use_cache:
            return None
        cache = _keeping_every_position(DynamicCache(config=self.hf.config))
        for layer, (keys, values) in zip(cache.layers, past_key_values or ()):
            if keys is not None:  # a layer that shares another's keys (Gemma 4) caches none
                layer.update(keys, values)
        return cache

    @property
    def static_cache(self) -> bool:
        """Whether transformers' StaticCache of this model is plain static layers once its window layers keep every
        position (`_keeping_every_position`)."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        cache = _keeping_every_position(StaticCache(config=self.hf.config, max_cache_len=1), 1)
        return all(type(layer) is StaticLayer for layer in cache.layers)

    @property
    def kv_cache(self) -> bool:
        """Whether transformers' cache of this model holds keys and values in every layer (DynamicLayer and its
        sliding-window kind); Qwen3-Next's and the Mamba hybrids' LinearAttentionLayer holds recurrent states."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        return all(isinstance(layer, DynamicLayer) for layer in DynamicCache(config=self.hf.config).layers)

    def _static(self, past_key_values, cache_position):
        """transformers' StaticCache over the given buffers, which its layers update in place (index_copy_). A layer
        writes from its `cumulative_length` on: here the first position of this call."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        length = past_key_values[0][0].shape[2]
        cache = _keeping_every_position(StaticCache(config=self.hf.config, max_cache_len=length), length)
        # a caller passes cache_position only where `static_cache` holds: every layer is a StaticLayer
        for layer, (keys, values) in zip(cast(list[StaticLayer], cache.layers), past_key_values, strict=True):
            layer.keys, layer.values, layer.device = keys, values, keys.device
            layer.batch_size, layer.num_heads = keys.shape[:2]
            layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
            layer.cumulative_length = cache_position[0].clone()  # StaticLayer adds to it in place
            layer.is_initialized = True
        return cache

    def forward(
        self, input_ids, logits: str = "last", past_key_values=None, use_cache: bool = False, cache_position=None
    ):
        if logits not in ("last", "all"):
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        if cache_position is None:
            cache = self._cache(past_key_values, use_cache)
        else:
            cache = self._static(past_key_values, cache_position)
        out = self.hf(
            input_ids=input_ids,
            **{self._cache_argument: cache},
            use_cache=use_cache,
            cache_position=cache_position,
            logits_to_keep=1 if logits == "last" else 0,
        )
        result = out.logits[:, -1, :] if logits == "last" else out.logits
        if not use_cache:
            return result
        present = tuple((layer.keys, layer.values) for layer in out[self._cache_argument].layers)
        return result, present


def _keeping_every_position(cache, static_length: int | None = None):
    """`cache` (a transformers DynamicCache, or a StaticCache of `static_length` positions) with each sliding-window
    layer replaced by the full layer of its kind: the cache keeps every position and the mask alone applies the window
    (the module docstring)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

    def full(layer):
        if type(layer) is DynamicSlidingWindowLayer:
            return DynamicLayer()
        if type(layer) is StaticSlidingWindowLayer:
            assert static_length is not None  # a StaticCache's caller gives its length
            return StaticLayer(max_cache_len=static_length)
        return layer

    cache.layers = [full(layer) for layer in cache.layers]
    return cache
