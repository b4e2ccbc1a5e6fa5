"""Llama: pre-norm, RoPE, SwiGLU, no biases, SDPA, tied embeddings by default, optional GQA.
Parameter names follow Hugging Face's `LlamaForCausalLM` (`model.layers.0.input_layernorm.weight`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from taperfold.models.base import CausalLM, apply_rope, attend, init_weights, make_norm, rope_cos_sin
from taperfold.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, past, use_cache, mask, cache_position):
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, present = attend(q, k, v, past, use_cache, mask, cache_position)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), present


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = make_norm(cfg)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = LlamaMLP(cfg)

    def forward(self, h, cos, sin, past, use_cache, mask, cache_position):
        a, present = self.self_attn(self.input_layernorm(h), cos, sin, past, use_cache, mask, cache_position)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), present


class LlamaBody(nn.Module):
    """HF's `LlamaModel`, so that parameter names start with `model.`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)


class LlamaForCausalLM(CausalLM):
    rope_cos: torch.Tensor  # buffers
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(init_weights)
        # RoPE for every position of the context, once (a forward slices or gathers the rows it needs)
        cos, sin = rope_cos_sin(self.positions, cfg.head_dim, cfg.rope_theta, torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def final_norm(self):
        return self.model.norm

    def body(self, input_ids, past_key_values, use_cache, cache_position):
        positions, mask = self.step_positions(input_ids.shape[1], past_key_values, cache_position)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        present = []
        for i, layer in enumerate(self.model.layers):
            past = None if past_key_values is None else past_key_values[i]
            h, p = layer(h, cos, sin, past, use_cache, mask, cache_position)
            present.append(p)
        return h, (tuple(present) if use_cache else None)
