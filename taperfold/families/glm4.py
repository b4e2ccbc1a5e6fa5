"""GLM-4: sandwich norms. Pre-norms before attention (q, k, v) and before the fused gate/up projection; post-norms
on each sub-block's output (post_self_attn_layernorm, post_mlp_layernorm) fold backwards into o_proj and
down_proj. (`post_attention_layernorm` is, despite its name, the MLP's pre-norm.)"""

from taperfold.families import Family

FAMILY = Family(
    name="glm4",
    model_types=("glm4",),
    norm="rms",
    layers="model.layers",
    internal={
        "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "post_attention_layernorm": ("mlp.gate_up_proj",),
    },
    post={"post_self_attn_layernorm": "self_attn.o_proj", "post_mlp_layernorm": "mlp.down_proj"},
    final="model.norm",
)
