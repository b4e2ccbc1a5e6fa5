"""Serving a folded model where language models are served: the families a folded checkpoint (`export --vllm`,
taperfold.artifacts.vllm_checkpoint) can be written for, as data.

A folded checkpoint is a Hugging Face directory whose config.json names taperfold's own model type and architecture
(`taperfold_llama`, `TaperfoldLlamaForCausalLM`), so that a tool that does not know the fold refuses it rather than
building the stock model with its norms re-initialised to ones. Two registrations read it:

    taperfold.serving.transformers_models   AutoConfig / AutoModelForCausalLM: transformers' own class of the family
                                            with each folded norm its served form (`register_with_transformers()`)
    taperfold.serving.vllm_plugin           vLLM's `vllm.general_plugins` entry point: vLLM's own class of the family
                                            with each folded norm its served form (taperfold.serving.vllm_models)

A norm's served form is its kind's (taperfold.norms.NormKind.served, one module both libraries call): a folded RMS
norm or LayerNorm leaves the residual add alone; a folded DyT leaves tanh(α·h), α in the checkpoint, γ and β in its
readers; a DyT whose γ, β no layer of the served model takes is kept whole (`served_split`).

A family is served where both libraries call each folded norm the same simple way, at the same module path:
transformers as `norm(x)` with the residual added outside it, vLLM as `norm(x)` or `norm(x, residual)` (its fused
add-and-normalize): pre-norms read by linear layers (Llama's `input_layernorm`, `post_attention_layernorm`; MoE
routers and experts), and post-norms on a sub-block's output folded back into the projection producing it (Gemma 2/3's
`post_attention_layernorm`, `post_feedforward_layernorm`, called `norm(x)` before the residual add). LayerNorms fold
the same way, β into a bias of each reader (GPT-NeoX's query_key_value and dense_h_to_4h have one; StableLM's q/k/v and
gate/up are given one, in both libraries), and so does a DyT's β. Measured, tiny models, greedy tokens equal
(tests/test_vllm.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from taperfold.errors import TaperfoldError

CONFIG_KEY = "taperfold_folded_norms"  # config.json: the module paths of the norms folded away
KEPT_KEY = "taperfold_kept_norms"  # config.json: the module paths of the norms kept whole (absent: none)
KIND_KEY = "taperfold_norm_kind"  # config.json: those norms' kind (taperfold.norms), whose served forms they take
BIAS_KEY = "taperfold_added_biases"  # config.json: the linear layers a fold gave a bias the family builds them without


@dataclass(frozen=True)
class ServedFamily:
    family: str  # taperfold's family (taperfold.families)
    model_class: str  # the family's causal LM class, as transformers and vLLM's registry both name it
    config_name: str | None = None  # transformers' config class where it is not the model class's (Gemma 3's text)
    tied_head: bool = False  # vLLM's class reads the logits from the embedding, whatever the config says (Gemma 2)
    # config.json keys whose true value vLLM's class does not compute (it reads the layer another way), and why
    refused_config: tuple[tuple[str, str], ...] = ()

    @property
    def model_type(self) -> str:
        """config.json's `model_type` of a folded checkpoint: no stock tool knows it."""
        return f"taperfold_{self.family}"

    @property
    def architecture(self) -> str:
        """config.json's `architectures` of a folded checkpoint, and the class names registered for it."""
        return f"Taperfold{self.model_class}"

    @property
    def base_model_class(self) -> str:
        """transformers' model class of the family without its head (what vLLM's Transformers backend builds)."""
        return self.model_class.replace("ForCausalLM", "Model")

    @property
    def config_class(self) -> str:
        """transformers' config class of the family."""
        return self.config_name or self.model_class.replace("ForCausalLM", "Config")


SERVED = {
    served.family: served
    for served in (
        ServedFamily("llama", "LlamaForCausalLM"),
        ServedFamily("mistral", "MistralForCausalLM"),
        ServedFamily("qwen2", "Qwen2ForCausalLM"),
        ServedFamily("qwen3", "Qwen3ForCausalLM"),
        ServedFamily("phi3", "Phi3ForCausalLM"),
        ServedFamily("granite", "GraniteForCausalLM"),
        ServedFamily("gemma", "GemmaForCausalLM"),
        ServedFamily("gemma2", "Gemma2ForCausalLM", tied_head=True),
        ServedFamily("gemma3", "Gemma3ForCausalLM", config_name="Gemma3TextConfig"),
        ServedFamily("mixtral", "MixtralForCausalLM"),
        ServedFamily("qwen3_moe", "Qwen3MoeForCausalLM"),
        ServedFamily("smollm3", "SmolLM3ForCausalLM"),
        ServedFamily("olmo2", "Olmo2ForCausalLM"),
        ServedFamily("gpt_neox", "GPTNeoXForCausalLM"),
        ServedFamily(
            "stablelm",
            "StableLmForCausalLM",
            refused_config=(
                ("use_parallel_residual", "vLLM's StableLM adds attention and the MLP one after the other"),
                ("qk_layernorm", "vLLM's StableLM has no per-head q/k LayerNorms"),
            ),
        ),
    )
}


def served_family(family: str, origin: str) -> ServedFamily:
    """The served form of taperfold family `family`, or one line saying it is not served yet."""
    if family not in SERVED:
        raise TaperfoldError(
            f"{origin}: --vllm: the {family} family is not served yet (served: {', '.join(SERVED)}); "
            "export it without --vllm"
        )
    return SERVED[family]


def served_split(tapering: Any, network: Any) -> tuple[list[str], list[str]]:
    """(folded, kept whole): the tapered norms of `tapering` (taperfold.taper.Tapering, at g = 0) of `network` as a
    served model has them. A norm folds where the served model has a layer for its map: its readers or its producer,
    each able to take the bias a kind with a shift (β) gives it; not the head (vLLM's heads add no bias) nor a bare
    weight (a MoE router's, stacked experts'). Any other is kept whole, where its kind has a whole served form (DyT's);
    ValueError naming the norm where it has not."""
    from torch import nn

    from taperfold.taper import fold_target

    kind, head = tapering.kind, tapering.family.head
    folded: list[str] = []
    kept: list[str] = []
    for path, norm in tapering.norms.items():
        targets = tapering.folds_into(path)
        biasless = [t for t in targets if t == head or isinstance(fold_target(network, t), nn.Parameter)]
        folds = bool(targets) and not (kind.shift and biasless)
        try:
            kind.served(len(norm.get_parameter("weight")), folds)
        except ValueError as e:
            if folds:
                raise ValueError(f"{path}: {e}") from None
            if not targets:
                why = "no layer takes its map"
            elif biasless[0] == head:
                why = f"its β would be a bias of the head {head}, which vLLM's heads do not add"
            else:
                why = f"its β would be a bias of {biasless[0]}, a bare weight"
            raise ValueError(f"{path} does not fold in the served model ({why}), and {e}") from None
        (folded if folds else kept).append(path)
    return folded, kept


def served_norms(config: Any) -> list[tuple[str, bool]]:
    """(module path, folded) of each norm a folded checkpoint's config lists, folded or kept whole."""
    return [(path, True) for path in getattr(config, CONFIG_KEY)] + [
        (path, False) for path in getattr(config, KEPT_KEY, [])
    ]


def served_norm(config: Any, replaced: Any, folded: bool) -> Any:
    """The module a serving class puts in place of its family's norm `replaced` (as wide as `replaced`'s weight, else
    the hidden size): the served form (taperfold.norms.NormKind.served) of the kind the config names, its parameters
    loaded from the checkpoint next."""
    from taperfold.norms import norm_kind

    weight = getattr(replaced, "weight", None)
    width = weight.shape[-1] if weight is not None else config.hidden_size
    # a checkpoint written before the kind was recorded folded RMS norms or LayerNorms, both served as the residual add
    return norm_kind(getattr(config, KIND_KEY, "rms")).served(width, folded)
