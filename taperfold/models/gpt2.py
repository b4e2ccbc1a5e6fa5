"""GPT-2: learned positions, fused qkv, GELU MLP, biases, LayerNorm / TaperLN, tied lm_head.
Parameter names follow Hugging Face's `GPT2LMHeadModel` (`transformer.h.0.ln_1.weight`; Conv1D weights
stored `[in, out]`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from taperfold.models.base import CausalLM, attend, init_weights, make_norm
from taperfold.models.config import ModelConfig


class Conv1D(nn.Module):
    """HF GPT-2's Conv1D: a linear layer whose weight is stored `[in, out]`."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.c_attn = Conv1D(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = Conv1D(cfg.d_model, cfg.d_model)

    def forward(self, x, past, use_cache, mask, cache_position):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.cfg.n_heads, -1).transpose(1, 2) for z in (q, k, v))
        out, present = attend(q, k, v, past, use_cache, mask, cache_position)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, d)), present


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = Conv1D(cfg.d_model, cfg.d_ff)
        self.c_proj = Conv1D(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = GPT2MLP(cfg)

    def forward(self, h, past, use_cache, mask, cache_position):
        a, present = self.attn(self.ln_1(h), past, use_cache, mask, cache_position)
        h = h + a
        return h + self.mlp(self.ln_2(h)), present


class GPT2Body(nn.Module):
    """HF's `GPT2Model`, so that parameter names start with `transformer.`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = make_norm(cfg)


class GPT2LMHeadModel(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.transformer = GPT2Body(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(_init_weights)

    @property
    def final_norm(self):
        return self.transformer.ln_f

    def body(self, input_ids, past_key_values, use_cache, cache_position):
        positions, mask = self.step_positions(input_ids.shape[1], past_key_values, cache_position)
        h = self.transformer.wte(input_ids) + self.transformer.wpe.weight[positions][None]
        present = []
        for i, block in enumerate(self.transformer.h):
            h, p = block(h, None if past_key_values is None else past_key_values[i], use_cache, mask, cache_position)
            present.append(p)
        return h, (tuple(present) if use_cache else None)


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, Conv1D):
        nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)
    else:
        init_weights(m)
