"""What taperfold's own models share: norms, attention, RoPE and the CausalLM base.

The architectures (Llama, GPT-2) are one module each beside this one; their parameter and module names
follow Hugging Face's, so Hugging Face checkpoints map onto them one to one and the transformers family
descriptions (taperfold.families) describe them too. A model is built with plain norms and tapered by
taperfold.taper, which adds `weight_tilde` (γ̃), `c` and its calibration EMAs next to each norm's `weight` (γ).

Forward: `model(input_ids, logits="last" | "all", past_key_values=None, use_cache=False, cache_position=None)`.
"last" materialises only the final position's logits (the paper's benchmark mode); the slice is taken
before the final norm so that a tapered final norm still feeds the lm_head directly and can fold into it.
With `use_cache=True` it returns `(logits, present)`, present a tuple of (key, value) per layer. Two caches:

- growing (no `cache_position`): the new keys and values are appended to the past, present is shaped
  `[batch, kv_heads, past + seq, head_dim]`;
- static (`cache_position`: the positions of the new tokens, int64 `[seq]`): `past_key_values` are buffers of a
  fixed length, `[batch, kv_heads, cache_len, head_dim]`; the new keys and values are written into them in place
  at those positions, attention masks every position beyond each query's, and present is those same buffers.
  Every step has the same shapes, so one compiled or captured graph serves them all.

What depends only on the context is built once, as non-persistent buffers (not in the state dict): the RoPE
cos/sin tables and the position index the masks are read from; a forward slices or gathers them.
"""

from __future__ import annotations

import abc
import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from taperfold.families import family_for
from taperfold.models.config import ModelConfig
from taperfold.norms import norm_kind
from taperfold.taper import TaperedLM, Tapering, shared_parameters


def make_norm(cfg: ModelConfig) -> nn.Module:
    """A plain norm of the family's kind (nn.RMSNorm, nn.LayerNorm); `build_model` tapers the model afterwards."""
    return norm_kind(cfg.norm_kind).plain(cfg.d_model, cfg.norm_eps)


def attend(q, k, v, past, use_cache: bool, mask=None, cache_position=None):
    """Attention over [batch, heads, seq, head_dim]. With a growing past the new keys and values are appended to it;
    with `cache_position` (a static cache) they are written into the past buffers in place. `mask` (boolean
    [seq, keys], True = attend; None: plain causal, no past) is the step's, built once per forward."""
    if cache_position is not None:
        k_cache, v_cache = past
        index = cache_position[None, None, :, None].expand_as(k)
        k_cache.scatter_(2, index, k)
        v_cache.scatter_(2, index, v)
        k, v = k_cache, v_cache
    elif past is not None:
        k = torch.cat([past[0], k], dim=2)
        v = torch.cat([past[1], v], dim=2)
    present = (k, v) if use_cache else None
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out, present


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class CausalLM(TaperedLM):
    """What both architectures share: logits, the losses, and the taper's state (`tapering`, set by build_model)."""

    cfg: ModelConfig
    tapering: Tapering | None = None  # the model is its own network: taper_model attaches the tapering here
    static_cache = True
    lm_head: nn.Linear  # set by each architecture
    positions: torch.Tensor  # buffer

    @property
    @abc.abstractmethod
    def final_norm(self) -> nn.Module:
        """The norm in front of the head."""

    @abc.abstractmethod
    def body(
        self, input_ids: torch.Tensor, past_key_values, use_cache: bool, cache_position: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple | None]:
        """(the final norm's input, the present key/value cache or None)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # position k of the context, for the masks (non-persistent: the state dict stays the weights)
        self.register_buffer("positions", torch.arange(cfg.max_seq_len), persistent=False)

    @property
    def network(self) -> nn.Module:
        return self

    def step_positions(self, t: int, past_key_values, cache_position):
        """(slice or index of the new tokens' positions, the attention mask) for one forward of `t` tokens: the
        mask is None without a past (plain causal); a growing past puts the tokens after it; a static cache at
        `cache_position`, each query seeing the cache up to its own position."""
        if cache_position is not None:
            cache_len = past_key_values[0][0].shape[2]
            return cache_position, self.positions[:cache_len][None, :] <= cache_position[:, None]
        if past_key_values is None:
            return slice(0, t), None
        past_len = past_key_values[0][0].shape[2]
        keys = self.positions[: past_len + t]
        return slice(past_len, past_len + t), keys[None, :] <= keys[past_len:, None]

    def copy(self, shared: bool = False) -> CausalLM:
        return copy.deepcopy(self, shared_parameters(self) if shared else None)

    @property
    def layers_path(self) -> str:
        return family_for(self.cfg.arch, "config").layers

    def _count_layers(self, count: int) -> None:
        self.cfg = dataclasses.replace(self.cfg, n_layers=count)

    def _logits(self, h, logits: str):
        if logits == "last":
            h = h[:, -1, :]
        elif logits != "all":
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        return self.lm_head(self.final_norm(h))

    def forward(
        self, input_ids, logits: str = "last", past_key_values=None, use_cache: bool = False, cache_position=None
    ):
        if cache_position is not None and past_key_values is None:
            raise ValueError("cache_position needs the static cache's buffers (past_key_values)")
        h, present = self.body(input_ids, past_key_values, use_cache, cache_position)
        out = self._logits(h, logits)
        return (out, present) if use_cache else out

    def loss(self, input_ids, targets, mask=None):
        """Cross-entropy on next-token targets plus the scale anchoring loss on the pre-logit stream."""
        h, _ = self.body(input_ids, None, False, None)
        logits = self.lm_head(self.final_norm(h))
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.bool()
        ce = ce[keep.flatten()].mean()
        scale_loss = self.tapering.scale_loss if self.tapering is not None else None
        aux = (
            scale_loss(h, keep, track=self.training and self.gate.calibrating)
            if scale_loss is not None
            else ce.new_zeros(())
        )
        return ce, aux


def init_weights(m: nn.Module) -> None:
    """GPT-2's initialisation (normal, std 0.02; zero biases), which both families use."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once
