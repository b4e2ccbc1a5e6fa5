"""Serving a folded model where language models are served: the families a folded checkpoint (`export --vllm`,
taperfold.artifacts.vllm_checkpoint) can be written for, as data.

A folded checkpoint is a Hugging Face directory whose config.json names taperfold's own model type and architecture
(`taperfold_llama`, `TaperfoldLlamaForCausalLM`), so that a tool that does not know the fold refuses it rather than
building the stock model with its norms re-initialised to ones. Two registrations read it:

    taperfold.serving.transformers_models   AutoConfig / AutoModelForCausalLM: transformers' own class of the family
                                            with each folded norm an identity (`register_with_transformers()`)
    taperfold.serving.vllm_plugin           vLLM's `vllm.general_plugins` entry point: vLLM's own class of the family
                                            with each folded norm the residual add alone (taperfold.serving.vllm_models)

A family is served where both libraries call each folded norm the same simple way, at the same module path:
transformers as `norm(x)` with the residual added outside it, vLLM as `norm(x)` or `norm(x, residual)` (its fused
add-and-normalize): pre-norms read by linear layers (Llama's `input_layernorm`, `post_attention_layernorm`; MoE
routers and experts), and post-norms on a sub-block's output folded back into the projection producing it (Gemma 2/3's
`post_attention_layernorm`, `post_feedforward_layernorm`, called `norm(x)` before the residual add). LayerNorms fold
the same way, β into a bias of each reader (GPT-NeoX's query_key_value and dense_h_to_4h have one; StableLM's q/k/v and
gate/up are given one, in both libraries). Measured, tiny models, greedy tokens equal (tests/test_vllm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from taperfold.errors import TaperfoldError

CONFIG_KEY = "taperfold_folded_norms"  # config.json: the module paths of the norms folded away
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
