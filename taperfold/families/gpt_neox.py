"""GPT-NeoX (Pythia): two LayerNorms per layer; with use_parallel_residual (the default) attention and
the MLP both read the layer's input, each through its own norm."""

from taperfold.families import Family

FAMILY = Family(
    name="gpt_neox",
    model_types=("gpt_neox",),
    norm="ln",
    layers="gpt_neox.layers",
    internal={"input_layernorm": ("attention.query_key_value",), "post_attention_layernorm": ("mlp.dense_h_to_4h",)},
    final="gpt_neox.final_layer_norm",
)
