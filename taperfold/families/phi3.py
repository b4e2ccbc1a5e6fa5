"""Phi-3: pre-norm RMSNorm; attention reads through one fused qkv_proj, the MLP through gate_up_proj."""

from taperfold.families import Family

FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    norm="rms",
    layers="model.layers",
    internal={"input_layernorm": ("self_attn.qkv_proj",), "post_attention_layernorm": ("mlp.gate_up_proj",)},
    final="model.norm",
)
