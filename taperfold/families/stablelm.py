"""StableLM (LayerNorm with bias): `input_layernorm` before attention, `post_attention_layernorm` before the
SwiGLU MLP; with `use_parallel_residual` attention and the MLP both read `input_layernorm` (there is no second
norm). With `qk_layernorm`, each head of the projected queries and keys has its own LayerNorm
(`q_layernorm.norms.i`), never tapered."""

from taperfold.families import Family

ATTENTION, MLP = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")
_QK = (
    "per-head LayerNorm of the projected queries/keys (qk_layernorm): feeds RoPE and the attention scores, "
    "not a linear layer; never tapered"
)


def _layout(config) -> dict:
    if config.use_parallel_residual:
        return {"internal": {"input_layernorm": (*ATTENTION, *MLP)}}
    return {}


FAMILY = Family(
    name="stablelm",
    model_types=("stablelm",),
    norm="ln",
    layers="model.layers",
    internal={"input_layernorm": ATTENTION, "post_attention_layernorm": MLP},
    final="model.norm",
    untapered={"q_layernorm": _QK, "k_layernorm": _QK},
    configure=_layout,
)
