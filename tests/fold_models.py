"""Tiny Hugging Face models for testing and measuring the passes, built from configs (nothing is downloaded).

`constant_norms(model)` replaces every norm layer by the constant map a TaperNorm / TaperLN computes at
g = 0, written the way users write it (`weight * (c * h)`, Gemma's `(1 + weight)` gain), so an export
of the result is what `taperfold fold` meets on a user's tapered model. `taperfold.hf` does the real
tapering (training, checkpoints); this module only needs the g = 0 graph shape.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from torch import nn

DIM, LAYERS, HEADS, VOCAB, POSITIONS = 32, 2, 4, 64, 64


def _configs() -> dict:
    import transformers as T

    llama_like = dict(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=2 * DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=POSITIONS,
    )
    no_tokens = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # defaults outside the tiny vocabulary
    falcon = dict(
        vocab_size=VOCAB,
        hidden_size=DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=POSITIONS,
    )
    return {
        "llama": lambda: T.LlamaConfig(**llama_like),
        "qwen2": lambda: T.Qwen2Config(**llama_like),
        "qwen3": lambda: T.Qwen3Config(**llama_like, head_dim=DIM // HEADS),
        "mistral": lambda: T.MistralConfig(**llama_like),
        "phi3": lambda: T.Phi3Config(**llama_like, pad_token_id=0),
        "gemma": lambda: T.GemmaConfig(**llama_like, head_dim=DIM // HEADS),
        "phi": lambda: T.PhiConfig(**llama_like),
        "gpt2": lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=DIM, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS),
        "gpt_neox": lambda: T.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=DIM,
            intermediate_size=2 * DIM,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=POSITIONS,
            use_parallel_residual=True,
        ),
        "gemma2": lambda: T.Gemma2Config(**llama_like, head_dim=DIM // HEADS),
        "gemma3_text": lambda: T.Gemma3TextConfig(**llama_like, head_dim=DIM // HEADS),
        "olmo2": lambda: T.Olmo2Config(**llama_like, **no_tokens),
        "glm4": lambda: T.Glm4Config(**llama_like, **no_tokens, head_dim=DIM // HEADS),
        "exaone4": lambda: T.Exaone4Config(**llama_like, **no_tokens, head_dim=DIM // HEADS),
        "olmo": lambda: T.OlmoConfig(**llama_like, **no_tokens),  # LayerNorms without weight or bias
        "bloom": lambda: T.BloomConfig(vocab_size=VOCAB, hidden_size=DIM, n_layer=LAYERS, n_head=HEADS, **no_tokens),
        "opt": lambda: T.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=DIM,
            ffn_dim=2 * DIM,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=POSITIONS,
            word_embed_proj_dim=DIM,
        ),
        "mixtral": lambda: T.MixtralConfig(**llama_like, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(
            **llama_like,
            **no_tokens,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=DIM // 2,
            shared_expert_intermediate_size=DIM,
        ),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(
            **llama_like,
            **no_tokens,
            head_dim=DIM // HEADS,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=DIM // 2,
        ),
        # LayerNorms (β) before a router and experts' stacked matrices without biases; not in FAMILIES (one test)
        "phimoe": lambda: T.PhimoeConfig(**llama_like, **no_tokens, num_local_experts=4, num_experts_per_tok=2),
        "falcon": lambda: T.FalconConfig(**falcon, **no_tokens),  # Falcon-7B's layout: one norm, parallel attention
        "falcon_new": lambda: T.FalconConfig(**falcon, **no_tokens, new_decoder_architecture=True, num_kv_heads=2),
        "stablelm": lambda: T.StableLmConfig(**llama_like, **no_tokens),
        "stablelm_parallel": lambda: T.StableLmConfig(
            **llama_like, **no_tokens, use_parallel_residual=True, qk_layernorm=True
        ),
    }


FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "gemma",
    "phi",
    "gpt2",
    "gpt_neox",
    "opt",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "glm4",
    "exaone4",
    "bloom",
    "olmo",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "falcon",
    "falcon_new",
    "stablelm",
    "stablelm_parallel",
)


def tiny_model(family: str, seed: int = 0) -> nn.Module:
    """A randomly initialized tiny causal LM of `family`, its norm weights random too (tools treat γ = 1 as
    a no-op, and a γ of ones would hide a wrong fold)."""
    from transformers import AutoModelForCausalLM

    from taperfold.hf.model import exportable

    config = _configs()[family]()
    config.use_cache = False
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = exportable(AutoModelForCausalLM.from_config(config).eval())  # MoE experts as the exporters take them
    with torch.no_grad():
        for _, norm in norm_modules(model):
            for name in ("weight", "bias"):
                param = getattr(norm, name, None)
                if isinstance(param, nn.Parameter):
                    param.copy_((1.0 if name == "weight" else 0.0) + 0.3 * torch.randn_like(param))
    return model


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.LayerNorm) or name.endswith(("RMSNorm", "LayerNorm"))


def norm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if _is_norm(m)]


class ConstantRMSNorm(nn.Module):
    """A tapered RMSNorm at g = 0, Hugging Face style: weight * (c * h); Gemma-style with (1 + weight)."""

    def __init__(self, weight: torch.Tensor, c: float, unit_offset: bool):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.c = nn.Parameter(torch.tensor(c, dtype=weight.dtype))
        self.unit_offset = unit_offset

    def forward(self, h):
        gain = 1.0 + self.weight if self.unit_offset else self.weight
        return gain * (self.c * h)


class ConstantLayerNorm(nn.Module):
    """A tapered LayerNorm at g = 0: (h - mean(h)) * c * weight + bias; (h - mean(h)) * c when the norm has no
    weight (OLMo's)."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, c: float):
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.c = nn.Parameter(torch.tensor(c))

    def forward(self, h):
        out = (h - h.mean(-1, keepdim=True)) * self.c
        out = out if self.weight is None else out * self.weight
        return out if self.bias is None else out + self.bias


def constant_norms(model: nn.Module, seed: int = 0) -> tuple[nn.Module, list[str]]:
    """A copy of `model` with every norm replaced by its g = 0 constant map; also the replaced modules' names."""
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    names = []
    for name, norm in norm_modules(model):
        c = float(0.5 + torch.rand((), generator=generator))
        if isinstance(norm, nn.LayerNorm) or type(norm).__name__.endswith("LayerNorm"):
            new = ConstantLayerNorm(getattr(norm, "weight", None), getattr(norm, "bias", None), c)
        else:
            new = ConstantRMSNorm(norm.weight, c, unit_offset="Gemma" in type(norm).__name__)
        model.set_submodule(name, new)
        names.append(name)
    return model, names


class _Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def export(model: nn.Module, path: str | Path, exporter: str, opset: int, optimize: bool = True) -> Path:
    """torch.onnx export of `model`'s logits with inputs input_ids, attention_mask (dynamic batch and sequence).

    exporter: "dynamo" (optimize=False: the exporter's own optimizer off) or "legacy" (optimize=False:
    do_constant_folding off). External data is written beside `path` for both.
    """
    path = Path(path)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    args = (ids, torch.ones_like(ids))
    names = dict(input_names=["input_ids", "attention_mask"], output_names=["logits"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            dims = {0: "batch", 1: "sequence"}
            program = torch.onnx.export(
                _Logits(model),
                args,
                dynamo=True,
                opset_version=opset,
                optimize=optimize,
                verbose=False,
                dynamic_shapes={"input_ids": dims, "attention_mask": dims},
                **names,
            )
            program.save(str(path), external_data=True)
        elif exporter == "legacy":
            axes = {name: {0: "batch", 1: "sequence"} for name in names["input_names"]}
            torch.onnx.export(
                _Logits(model),
                args,
                str(path),
                dynamo=False,
                opset_version=opset,
                do_constant_folding=optimize,
                dynamic_axes=axes,
                external_data=True,
                **names,
            )
        else:
            raise ValueError(f"exporter must be 'dynamo' or 'legacy', got {exporter!r}")
    return path
