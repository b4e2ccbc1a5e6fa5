"""Falcon, both decoder architectures (LayerNorm, fused query_key_value, tied head):

- the original one (Falcon-7B, `parallel_attn`): one `input_layernorm` read by attention and the MLP, which run in
  parallel on the layer input; without `parallel_attn` (the RW models) a `post_attention_layernorm` before the MLP;
- `new_decoder_architecture` (Falcon-40B/180B): `ln_attn` and `ln_mlp`, two norms of the same layer input, in
  parallel (with `num_ln_in_parallel_attn = 1`, one `input_layernorm` read by both).
Which layout a model has is in its config (`configure`)."""

from taperfold.families import Family

QKV, MLP = "self_attention.query_key_value", "mlp.dense_h_to_4h"


def _layout(config) -> dict:
    if config.new_decoder_architecture and (config.num_ln_in_parallel_attn or 2) == 2:
        return {"internal": {"ln_attn": (QKV,), "ln_mlp": (MLP,)}}
    if config.new_decoder_architecture or config.parallel_attn:
        return {"internal": {"input_layernorm": (QKV, MLP)}}
    return {"internal": {"input_layernorm": (QKV,), "post_attention_layernorm": (MLP,)}}


def _check(config) -> str | None:
    if getattr(config, "new_decoder_architecture", False) and not getattr(config, "parallel_attn", True):
        return (
            "new_decoder_architecture with parallel_attn false: transformers builds norms its forward does not "
            "use (not a Falcon checkpoint)"
        )
    return None


FAMILY = Family(
    name="falcon",
    model_types=("falcon",),
    norm="ln",
    layers="transformer.h",
    internal={"input_layernorm": (QKV, MLP)},  # the original architecture; `configure` gives each model's own
    final="transformer.ln_f",
    configure=_layout,
    check=_check,
)
