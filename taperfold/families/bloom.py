"""Bloom: LayerNorms before attention (the fused query_key_value) and before the MLP, a final norm, a head tied to
the embedding, and a LayerNorm on the embedding lookup itself, which stays untapered."""

from taperfold.families import Family

FAMILY = Family(
    name="bloom",
    model_types=("bloom",),
    norm="ln",
    layers="transformer.h",
    internal={
        "input_layernorm": ("self_attention.query_key_value",),
        "post_attention_layernorm": ("mlp.dense_h_to_4h",),
    },
    final="transformer.ln_f",
    context=2048,  # ALiBi: config.json has no max_position_embeddings; every BLOOM was trained at 2048 tokens
    untapered={
        "word_embeddings_layernorm": "normalises the embedding lookup, which the first layer's norm and the "
        "residual stream read: no linear layer reads it, never tapered"
    },
)
