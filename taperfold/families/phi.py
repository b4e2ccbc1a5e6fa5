"""Phi-1/1.5/2: one LayerNorm per layer read by attention (q, k, v) and the MLP (fc1) in parallel."""

from taperfold.families import Family

_QK = (
    "per-head LayerNorm of the projected queries/keys (qk_layernorm): feeds RoPE and the attention "
    "scores, not a linear layer; never tapered"
)

FAMILY = Family(
    name="phi",
    model_types=("phi",),
    norm="ln",
    layers="model.layers",
    internal={"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1")},
    final="model.final_layernorm",
    untapered={"q_layernorm": _QK, "k_layernorm": _QK},
)
