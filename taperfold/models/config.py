"""The config of taperfold's own models: their shape, where they taper, and the training knobs that live
with the model (scale-anchoring loss, calibration); its validation; a preset's config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from taperfold import taper
from taperfold.families import family_for
from taperfold.norms import norm_kind, norm_kinds
from taperfold.numeric import is_finite_number
from taperfold.presets import ARCHS, PRESETS

TAPERS = ("none", *taper.TAPERS)  # none: the baseline, plain norms


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
    norm: str | None = None  # None: the arch's own norm, tapered; "dyt": DyT in those places instead (no gate)
    # a learnable scalar after the token embedding (DyT's LLaMA recipe); None: the norm's default (on for DyT)
    embed_scale: bool | None = None
    aux: bool = True  # fixed-target scale anchoring loss (eq. 5); never with DyT, which has no taper to anchor
    aux_weight: float = 0.1
    ema_momentum: float = 0.01
    calib_delta: float = 1e-8
    tokenizer: str = "bytes"

    def __post_init__(self):
        validate_config(self)
        stand_in = self.norm is not None and not norm_kind(self.norm).gated
        if stand_in:
            self.aux = False  # the scale anchor holds the residual stream's scale through a taper; DyT has none
        if self.embed_scale is None:
            self.embed_scale = stand_in

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def window(self) -> None:
        """taperfold's own models attend over the whole context (an HF model's config may state a window)."""
        return None

    @property
    def norm_kind(self) -> str:
        return family_for(self.arch, "config").norm

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}")
        return cls(**d)


# Types and ranges of the config fields, checked before anything is built from a config: a checkpoint's
# config is input, and a wrong one must fail in one line, not in a ZeroDivisionError or a 7 TiB allocation.
# Upper bounds are far above any real model (Llama 3.1 405B: d_model 16384, 126 layers, 128k context).
_INT_RANGES = {
    "vocab_size": (1, 1 << 24),
    "d_model": (1, 1 << 16),
    "n_layers": (1, 1024),
    "n_heads": (1, 1024),
    "n_kv_heads": (1, 1024),
    "d_ff": (1, 1 << 18),
    "max_seq_len": (1, 1 << 20),
}
# (low, high, low included): norm_eps must be > 0 (a negative one makes 1/sqrt(var + eps) NaN for small h)
_FLOAT_RANGES = {
    "rope_theta": (0.0, 1e12, False),
    "norm_eps": (0.0, 1.0, False),
    "aux_weight": (0.0, 1e6, True),
    "ema_momentum": (0.0, 1.0, False),
    "calib_delta": (0.0, 1.0, True),
}


def validate_config(cfg: ModelConfig) -> None:
    """Raise ValueError naming the field for a wrong type, an impossible value or inconsistent sizes."""
    for name, choices in (("arch", tuple(ARCHS)), ("taper", TAPERS)):
        if getattr(cfg, name) not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {getattr(cfg, name)!r}")
    if cfg.norm is not None:
        stand_ins = [k.name for k in norm_kinds() if not k.gated]
        if cfg.norm not in stand_ins:
            raise ValueError(f"norm must be null (the arch's own, tapered) or one of {stand_ins}, got {cfg.norm!r}")
        if cfg.taper == "none":
            raise ValueError(
                f"norm {cfg.norm!r} with taper 'none': taper says which norms it replaces (internal or all)"
            )
    if cfg.embed_scale is not None and not isinstance(cfg.embed_scale, bool):
        raise ValueError(f"embed_scale must be true, false or null, got {cfg.embed_scale!r}")
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
    for name, (bottom, top, closed) in _FLOAT_RANGES.items():
        value = getattr(cfg, name)
        ok = is_finite_number(value) and (bottom <= value if closed else bottom < value) and value <= top
        if not ok:
            raise ValueError(f"{name} must be a number in {'[' if closed else '('}{bottom:g}, {top:g}], got {value!r}")
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}")
    if cfg.n_heads % cfg.kv_heads:
        raise ValueError(f"n_heads {cfg.n_heads} is not divisible by n_kv_heads {cfg.kv_heads}")
    if ARCHS[cfg.arch].rotary and cfg.head_dim % 2:
        raise ValueError(f"head dimension d_model / n_heads = {cfg.head_dim} must be even (rotary embeddings)")


def preset_config(name: str, arch: str = "llama", **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {tuple(ARCHS)}, got {arch!r}")
    base = dict(PRESETS[name], arch=arch, **ARCHS[arch].defaults)
    return ModelConfig(**{**base, **overrides})
