"""What every model family shares: the config, presets, norms, attention, RoPE and the CausalLM base.

The families themselves (Llama, GPT-2) are one module each in taperfold.families; their parameter names
and layouts follow Hugging Face's, so Hugging Face checkpoints map onto them one to one. A tapered norm
adds `weight_tilde` (γ̃), `c` and its calibration EMAs next to `weight` (γ).

Forward: `model(input_ids, logits="last" | "all", past_key_values=None, use_cache=False)`.
"last" materialises only the final position's logits (the paper's benchmark mode); the slice is taken
before the final norm so that a tapered final norm still feeds the lm_head directly and can fold into it.
With `use_cache=True` it returns `(logits, present)`, present a tuple of (key, value) per layer shaped
`[batch, kv_heads, past + seq, head_dim]`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from taperfold.families import ARCHS
from taperfold.nn import ScaleAnchorLoss, TaperGate, TaperLN, TaperNorm

TAPERS = ("none", "internal", "all")


@dataclass
class ModelConfig:
    arch: str = "llama"
    vocab_size: int = 256  # byte-level tokens by default
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention (llama); None = n_heads
    d_ff: int = 512
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    taper: str = "internal"  # none (baseline) | internal (final norm kept) | all
    aux: bool = True  # fixed-target scale anchoring loss (eq. 5)
    aux_weight: float = 0.1
    ema_momentum: float = 0.01
    calib_delta: float = 1e-8
    tokenizer: str = "bytes"

    def __post_init__(self):
        validate_config(self)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def norm_kind(self) -> str:
        from taperfold.families import family

        return family(self.arch).norm_kind

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}")
        return cls(**d)


# Types and ranges of the config fields, checked before anything is built from a config: a checkpoint's
# config is input, and a wrong one must fail in one line, not in a ZeroDivisionError or a 7 TiB allocation.
# Upper bounds are far above any real model (Llama 3.1 405B: d_model 16384, 126 layers, 128k context).
_INT_RANGES = {"vocab_size": (1, 1 << 24), "d_model": (1, 1 << 16), "n_layers": (1, 1024), "n_heads": (1, 1024),
               "n_kv_heads": (1, 1024), "d_ff": (1, 1 << 18), "max_seq_len": (1, 1 << 20)}
# (low, high, low included): norm_eps must be > 0 (a negative one makes 1/sqrt(var + eps) NaN for small h)
_FLOAT_RANGES = {"rope_theta": (0.0, 1e12, False), "norm_eps": (0.0, 1.0, False), "aux_weight": (0.0, 1e6, True),
                 "ema_momentum": (0.0, 1.0, False), "calib_delta": (0.0, 1.0, True)}


def validate_config(cfg: "ModelConfig") -> None:
    """Raise ValueError naming the field for a wrong type, an impossible value or inconsistent sizes."""
    for name, choices in (("arch", ARCHS), ("taper", TAPERS)):
        if getattr(cfg, name) not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {getattr(cfg, name)!r}")
    for name in ("tie_embeddings", "aux"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    if not isinstance(cfg.tokenizer, str):
        raise ValueError(f"tokenizer must be a string, got {cfg.tokenizer!r}")
    for name, (low, high) in _INT_RANGES.items():
        value = getattr(cfg, name)
        if name == "n_kv_heads" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    for name, (low, high, closed) in _FLOAT_RANGES.items():
        value = getattr(cfg, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and (low <= value if closed else low < value) and value <= high
        if not ok:
            raise ValueError(f"{name} must be a number in {'[' if closed else '('}{low:g}, {high:g}], got {value!r}")
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}")
    if cfg.n_heads % cfg.kv_heads:
        raise ValueError(f"n_heads {cfg.n_heads} is not divisible by n_kv_heads {cfg.kv_heads}")
    if cfg.arch == "llama" and cfg.head_dim % 2:
        raise ValueError(f"head dimension d_model / n_heads = {cfg.head_dim} must be even (rotary embeddings)")


def implied_parameters(cfg: "ModelConfig") -> int:
    """A lower bound on the parameters any family's model of this config holds, whatever the family: the
    embedding, and per layer a query and an output projection (d × d each) and the MLP's two matrices
    (d × d_ff each). Checked against the tensors of a checkpoint before a model is built."""
    return cfg.vocab_size * cfg.d_model + cfg.n_layers * 2 * cfg.d_model * (cfg.d_model + cfg.d_ff)


PRESETS: dict[str, dict] = {
    # Trains through the whole taper on 2 CPU cores in a few minutes.
    "tiny": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512, max_seq_len=128),
    # The paper's benchmark model: d=512, 8 layers, 16 heads, vocab 10k, context 512, SwiGLU x4.
    "paper-30m": dict(vocab_size=10_000, d_model=512, n_layers=8, n_heads=16, d_ff=2048, max_seq_len=512),
    # GPT-2 small's shape (~124M parameters), for export and fold throughput figures.
    "gpt2-124m": dict(vocab_size=50_257, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_seq_len=1024),
}


def preset_config(name: str, arch: str = "llama", **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    from taperfold.families import family

    base = dict(PRESETS[name], arch=arch, **family(arch).config_defaults)
    return ModelConfig(**{**base, **overrides})


# ----------------------------------------------------------------------------------------------------
# shared pieces


def make_norm(cfg: ModelConfig, gate: TaperGate, tapered: bool) -> nn.Module:
    kw = dict(momentum=cfg.ema_momentum, delta=cfg.calib_delta)
    if cfg.norm_kind == "rms":
        return TaperNorm(cfg.d_model, gate, cfg.norm_eps, **kw) if tapered else nn.RMSNorm(cfg.d_model, cfg.norm_eps)
    return TaperLN(cfg.d_model, gate, cfg.norm_eps, **kw) if tapered else nn.LayerNorm(cfg.d_model, cfg.norm_eps)


def attend(q, k, v, past, use_cache: bool):
    """Causal attention over [batch, heads, seq, head_dim]; prepends the cache when given."""
    if past is not None:
        k = torch.cat([past[0], k], dim=2)
        v = torch.cat([past[1], v], dim=2)
    present = (k, v) if use_cache else None
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if past is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        # Query i sits at absolute position past_len + i and sees keys 0 .. past_len + i.
        q_len, k_len = q.shape[2], k.shape[2]
        q_pos = torch.arange(q_len, device=q.device) + (k_len - q_len)
        mask = torch.arange(k_len, device=q.device)[None, :] <= q_pos[:, None]
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


class CausalLM(nn.Module):
    """What both architectures share: the gate, the taper life cycle, logits and the scale loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = TaperGate(1.0)
        self.scale_loss = ScaleAnchorLoss(cfg.norm_kind, cfg.aux_weight, cfg.norm_eps, cfg.ema_momentum) \
            if (cfg.aux and cfg.taper != "none") else None

    def tapered_norms(self) -> dict[str, nn.Module]:
        return {n: m for n, m in self.named_modules() if isinstance(m, (TaperNorm, TaperLN))}

    def set_gate(self, value: float, calibrating: bool = False) -> None:
        self.gate.value, self.gate.calibrating = float(value), calibrating

    def start_taper(self) -> dict[str, float]:
        """Taper start: every tapered norm freezes c and copies γ → γ̃; the scale target is frozen."""
        cs = {name: m.calibrate() for name, m in self.tapered_norms().items()}
        if self.scale_loss is not None:
            self.scale_loss.freeze()
        return cs

    def _logits(self, h, logits: str):
        if logits == "last":
            h = h[:, -1, :]
        elif logits != "all":
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        return self.lm_head(self.final_norm(h))

    def forward(self, input_ids, logits: str = "last", past_key_values=None, use_cache: bool = False):
        h, present = self.body(input_ids, past_key_values, use_cache)
        out = self._logits(h, logits)
        return (out, present) if use_cache else out

    def loss(self, input_ids, targets, mask=None):
        """Cross-entropy on next-token targets plus the scale anchoring loss on the pre-logit stream."""
        h, _ = self.body(input_ids, None, False)
        logits = self.lm_head(self.final_norm(h))
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.bool()
        ce = ce[keep.flatten()].mean()
        aux = self.scale_loss(h, keep, track=self.training and self.gate.calibrating) \
            if self.scale_loss is not None else ce.new_zeros(())
        return ce, aux


def init_weights(m: nn.Module) -> None:
    """GPT-2's initialisation (normal, std 0.02; zero biases), which both families use."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def build_model(cfg: ModelConfig) -> CausalLM:
    from taperfold.families import family

    return family(cfg.arch).model_class(cfg)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once
