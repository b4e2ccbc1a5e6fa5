"""OLMo (v1): Llama's layout with LayerNorms that have neither weight nor bias. Tapered, each starts from what it
computes (γ = 1, β = 0) and learns them; at g = 0 it is (h − mean(h))·c·γ̃ + β like any tapered LayerNorm."""

from taperfold.families import Family

FAMILY = Family(
    name="olmo",
    model_types=("olmo",),
    norm="ln",
    layers="model.layers",
    internal={
        "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
    },
    final="model.norm",
    norm_eps=1e-5,  # OlmoLayerNorm's forward calls F.layer_norm(..., eps=1e-5)
)
