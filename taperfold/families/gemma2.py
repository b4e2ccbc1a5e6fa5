"""Gemma 2: sandwich norms. A pre-norm before attention (q, k, v) and before the MLP (gate, up), and a post-norm on
each sub-block's output before the residual Add, which folds backwards into the projection producing it (o_proj,
down_proj). The norm computes x·(1 + w), as Gemma's."""

from taperfold.families import Family

FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    norm="rms",
    gain_offset=1.0,
    layers="model.layers",
    internal={
        "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "pre_feedforward_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
    },
    post={"post_attention_layernorm": "self_attn.o_proj", "post_feedforward_layernorm": "mlp.down_proj"},
    final="model.norm",
)
