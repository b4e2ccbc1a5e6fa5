"""OPT: LayerNorm before attention (self_attn_layer_norm) and before the MLP (the layer's
final_layer_norm, read by fc1), a final norm, and an lm_head tied to the embedding."""

from taperfold.families import Family


def _check(config):
    if not getattr(config, "do_layer_norm_before", True):
        return "do_layer_norm_before is false (post-norm, as OPT-350m): TaperNorm tapers pre-norm models only"
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        return "word_embed_proj_dim differs from hidden_size (project_out after the final norm): not supported"
    if not getattr(config, "layer_norm_elementwise_affine", True):
        return "layer_norm_elementwise_affine is false (norms without γ, β): not supported"
    return None


FAMILY = Family(
    name="opt",
    model_types=("opt",),
    norm="ln",
    layers="model.decoder.layers",
    internal={
        "self_attn_layer_norm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "final_layer_norm": ("fc1",),
    },
    final="model.decoder.final_layer_norm",
    check=_check,
)
