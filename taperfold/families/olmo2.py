"""OLMo 2: post-norms only. Each sub-block's output is normed before the residual Add, so both norms of a layer fold
backwards into the projection producing their input (o_proj, down_proj). Its q/k norms span all heads and sit
between the projections and RoPE."""

from taperfold.families import Family

_QK = (
    "normalises the projected queries/keys (every head at once) before RoPE and the attention scores: "
    "a QK-norm, never tapered"
)

FAMILY = Family(
    name="olmo2",
    model_types=("olmo2",),
    norm="rms",
    layers="model.layers",
    internal={},
    post={"post_attention_layernorm": "self_attn.o_proj", "post_feedforward_layernorm": "mlp.down_proj"},
    final="model.norm",
    untapered={"q_norm": _QK, "k_norm": _QK},
)
