"""Llama (taperfold's own `--arch llama` too): pre-norm RMSNorm before attention (q, k, v) and before the
SwiGLU MLP (gate, up)."""

from taperfold.families import Family

FAMILY = Family(
    name="llama",
    model_types=("llama",),
    norm="rms",
    layers="model.layers",
    internal={
        "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
    },
    final="model.norm",
)
