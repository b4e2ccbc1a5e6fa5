"""taperfold's own architectures and presets, as data: what `--arch` and `--preset` offer (no torch needed to
read them, so the command line's choices cost nothing). The models are taperfold.models."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arch:
    """One of taperfold's own architectures (its modeling code is taperfold.models.NAME; its norms and their
    readers are the transformers family of the same name, taperfold.families.NAME)."""

    embedding: str  # the token embedding's module path
    defaults: dict = field(default_factory=dict)  # ModelConfig fields its presets set
    rotary: bool = False  # RoPE: the head dimension must be even


ARCHS = {
    "llama": Arch("model.embed_tokens", rotary=True),  # ModelConfig.arch values
    "gpt2": Arch("transformer.wte", defaults={"norm_eps": 1e-5}),
}
# ModelConfig.norm values besides null: the norm kinds without a gate (taperfold.norms), spelled here so that the
# command line needs no torch to offer them (a test checks the two agree)
STAND_IN_NORMS = ("dyt",)


PRESETS: dict[str, dict] = {
    # Trains through the whole taper on 2 CPU cores in a few minutes.
    "tiny": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512, max_seq_len=128),
    # The paper's benchmark model: d=512, 8 layers, 16 heads, vocab 10k, context 512, SwiGLU x4.
    "paper-30m": dict(vocab_size=10_000, d_model=512, n_layers=8, n_heads=16, d_ff=2048, max_seq_len=512),
    # GPT-2 small's shape (~124M parameters), for export and fold throughput figures.
    "gpt2-124m": dict(vocab_size=50_257, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_seq_len=1024),
}
