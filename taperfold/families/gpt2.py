"""GPT-2 (taperfold's own `--arch gpt2` too): LayerNorm ln_1 before attention, ln_2 before the MLP, ln_f
before the tied head. Its readers are Conv1D layers, weight stored [in, out]."""

from taperfold.families import Family


def _check(config):
    if getattr(config, "add_cross_attention", False):
        return "add_cross_attention is true (an encoder-decoder block): only decoder-only GPT-2 is supported"
    return None


FAMILY = Family(
    name="gpt2",
    model_types=("gpt2",),
    norm="ln",
    layers="transformer.h",
    internal={"ln_1": ("attn.c_attn",), "ln_2": ("mlp.c_fc",)},
    final="transformer.ln_f",
    check=_check,
)
