"""Tiny random transformers configs, one per family taperfold tapers, and one per layout where a family has several
(Falcon's two architectures, StableLM's parallel residual with per-head q/k norms); `UNLISTED`: architectures no family
is shipped for, tapered generically (taperfold.hf.trace). No download: built from configs."""

COMMON = dict(vocab_size=256, max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
RMS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **COMMON)


def tiny_config(model_type: str, **changes):
    """The tiny config of `model_type`, with `changes` set on it."""
    import transformers as t

    configs = {
        "llama": lambda: t.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **RMS),
        "mistral": lambda: t.MistralConfig(num_key_value_heads=2, sliding_window=16, **RMS),
        "qwen2": lambda: t.Qwen2Config(num_key_value_heads=2, **RMS),
        "qwen3": lambda: t.Qwen3Config(num_key_value_heads=2, head_dim=8, **RMS),
        "phi3": lambda: t.Phi3Config(num_key_value_heads=2, original_max_position_embeddings=32, **RMS),
        "gemma": lambda: t.GemmaConfig(num_key_value_heads=2, head_dim=8, **RMS),
        "phi": lambda: t.PhiConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            partial_rotary_factor=0.5,
            **COMMON,
        ),
        "gpt2": lambda: t.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=32, bos_token_id=1, eos_token_id=2
        ),
        "gpt_neox": lambda: t.GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.5, **COMMON
        ),
        "gemma2": lambda: t.Gemma2Config(num_key_value_heads=2, head_dim=8, **RMS),  # logits softcapped at 30
        "gemma3_text": lambda: t.Gemma3TextConfig(
            num_key_value_heads=2, head_dim=8, final_logit_softcapping=10.0, **RMS
        ),
        "olmo2": lambda: t.Olmo2Config(num_key_value_heads=2, **RMS),
        "exaone4": lambda: t.Exaone4Config(num_key_value_heads=2, head_dim=8, **RMS),
        "glm4": lambda: t.Glm4Config(num_key_value_heads=2, head_dim=8, **RMS),
        "granite": lambda: t.GraniteConfig(
            num_key_value_heads=2,
            logits_scaling=4.0,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            **RMS,
        ),
        "smollm3": lambda: t.SmolLM3Config(num_key_value_heads=2, **RMS),
        "olmo": lambda: t.OlmoConfig(num_key_value_heads=2, **RMS),  # LayerNorms without weight or bias
        "bloom": lambda: t.BloomConfig(
            hidden_size=32,
            n_layer=2,
            n_head=4,  # ALiBi: no max_position_embeddings
            **{k: v for k, v in COMMON.items() if k != "max_position_embeddings"},
        ),
        "opt": lambda: t.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32, **COMMON
        ),
        # Falcon-7B's layout: parallel attention, multi-query (one key/value head, broadcast by SDPA), tied head
        "falcon": lambda: t.FalconConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True, parallel_attn=True, **COMMON
        ),
        "falcon_new": lambda: t.FalconConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
            **COMMON,
        ),
        "stablelm": lambda: t.StableLmConfig(num_key_value_heads=2, **RMS),
        "stablelm_parallel": lambda: t.StableLmConfig(
            num_key_value_heads=2, use_parallel_residual=True, qk_layernorm=True, **RMS
        ),
        # MoE: save_pretrained writes each expert's matrices, which loading stacks as transformers does
        "mixtral": lambda: t.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **RMS),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            **RMS,
        ),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **RMS
        ),
        # unlisted: Cohere (one LayerNorm without β read by attention and the MLP in parallel, logit scale) and
        # Persimmon (LayerNorms, per-head q/k LayerNorms that stay), Starcoder2 (LayerNorms with β)
        "cohere": lambda: t.CohereConfig(num_key_value_heads=2, logit_scale=0.5, **RMS),
        "persimmon": lambda: t.PersimmonConfig(qk_layernorm=True, partial_rotary_factor=0.5, **RMS),
        "starcoder2": lambda: t.Starcoder2Config(num_key_value_heads=2, **RMS),
        # unlisted MoE: OLMoE (q/k RMSNorms over the whole projection, read per head: they stay) and GraniteMoE
        # (its router reads the norm's output, and its dtype through type_as)
        "olmoe": lambda: t.OlmoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, **RMS),
        "granitemoe": lambda: t.GraniteMoeConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **RMS
        ),
        # unlisted MoE of the newest forms: gpt-oss (experts stacked [in, out] with biases, a router with a bias) and
        # DeepSeek-V3 (latent attention's norms; a dense first layer, then a router, routed and shared experts)
        "gpt_oss": lambda: t.GptOssConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, head_dim=8, **RMS
        ),
        "deepseek_v3": lambda: t.DeepseekV3Config(
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            moe_intermediate_size=16,
            **RMS,
        ),
        # DeepSeek-V2: latent attention with a complex rotary embedding (queries [batch, heads, tokens, dim])
        "deepseek_v2": lambda: t.DeepseekV2Config(
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            moe_intermediate_size=16,
            **RMS,
        ),
        # unlisted, a family torch.onnx cannot translate as transformers writes it: Llama 4's complex rotary embedding
        "llama4_text": lambda: t.Llama4TextConfig(
            num_key_value_heads=2, head_dim=8, num_local_experts=4, intermediate_size_mlp=64, **RMS
        ),
        # unlisted hybrids, whose linear recurrences transformers writes as a loop over chunks (export_patches: a scan)
        "qwen3_next": lambda: t.Qwen3NextConfig(
            num_key_value_heads=2,
            head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"],
            **RMS,
        ),
        "bamba": lambda: t.BambaConfig(
            num_key_value_heads=2,
            mamba_n_heads=8,
            mamba_d_head=8,
            mamba_d_state=16,
            mamba_chunk_size=16,
            attn_layer_indices=[1],
            **RMS,
        ),
        # Mamba2 beside attention in every layer, its gated norm per 2 groups, norm then gate, µP multipliers
        "falcon_h1": lambda: t.FalconH1Config(
            num_key_value_heads=2,
            head_dim=8,
            mamba_d_ssm=64,
            mamba_n_heads=8,
            mamba_d_head=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=16,
            mamba_rms_norm=True,
            attention_in_multiplier=0.5,
            ssm_in_multiplier=1.5,
            **RMS,
        ),
        # Kimi delta attention (a decay per key channel), MLA in its full-attention layer
        "kimi_linear": lambda: t.KimiLinearConfig(
            num_key_value_heads=4,
            linear_head_dim=8,
            linear_num_heads=4,
            head_dim=8,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            qk_head_dim=16,
            kv_lora_rank=16,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_token=2,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            **RMS,
        ),
        # a gated delta net layer with pre-norms beside an attention layer with OLMo 2's post-norms
        "olmo_hybrid": lambda: t.OlmoHybridConfig(
            num_key_value_heads=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            **RMS,
        ),
        # unlisted, a config of the new shape: Gemma 4's full-attention layer has its own head_dim (per_layer_config)
        "gemma4_text": lambda: t.Gemma4TextConfig(
            num_key_value_heads=2,
            head_dim=8,
            global_head_dim=16,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=256,
            layer_types=["sliding_attention", "full_attention"],
            **RMS,
        ),
        # a multimodal model whose language model is exported (its config.json has the sizes in text_config only):
        # Gemma 3's SigLIP vision tower and projector, with norms of their own a text-only forward never calls
        "gemma3": lambda: t.Gemma3Config(
            text_config=dict(model_type="gemma3_text", num_key_value_heads=2, head_dim=8, **RMS),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
            image_token_id=255,
            boi_token_id=253,
            eoi_token_id=254,
        ),
        # per-layer attention sizes: dots.llm3's second layer has heads of its own (per_layer_config)
        "dots3_note_text": lambda: t.Dots3NoteTextConfig(
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=16,
            sliding_window=16,
            index_n_heads=2,
            index_head_dim=8,
            per_layer_config={"1": dict(num_attention_heads=8, num_key_value_heads=8)},
            layer_types=["indexed_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse"],
            **RMS,
        ),
        # a conversion mapping whose rule for other keys (`.norm.` -> `.kv_norm.`) also matches `model.norm.weight`
        "deepseek_v4": lambda: t.DeepseekV4Config(
            num_key_value_heads=4,
            head_dim=16,
            qk_rope_head_dim=8,
            q_lora_rank=16,
            o_lora_rank=16,
            o_groups=2,
            index_n_heads=2,
            index_head_dim=8,
            index_topk=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            sliding_window=16,
            **RMS,
        ),
        # Mamba's selective scan (a Python loop over the time steps) in layer 0, attention and experts in layer 1
        "jamba": lambda: t.JambaConfig(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_dt_rank=4,
            **RMS,
        ),
        # attention-free: no heads and no context in its config, its selective scan a Python loop over the time steps
        "mamba": lambda: t.MambaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            state_size=8,
            time_step_rank=4,
            **{k: v for k, v in COMMON.items() if k != "max_position_embeddings"},
        ),
        # Nemotron: LayerNorm1P, a LayerNorm with gain 1 + γ
        "nemotron": lambda: t.NemotronConfig(num_key_value_heads=2, **RMS),
        # RoBERTa's position ids count from padding_idx + 1: 32 positions take 32 - 1 - 1 tokens (pad_token_id 1)
        "roberta-prelayernorm": lambda: t.RobertaPreLayerNormConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            is_decoder=True,
            **{**COMMON, "pad_token_id": 1, "bos_token_id": 0},
        ),
        # MPT states its context as max_seq_len (ALiBi: no position table)
        "mpt": lambda: t.MptConfig(
            d_model=32,
            n_heads=4,
            n_layers=2,
            expansion_ratio=2,
            max_seq_len=32,
            **{k: v for k, v in COMMON.items() if k != "max_position_embeddings"},
        ),
        # MiniCPM3: the final norm's output divided by logits_scaling (hidden_size / dim_model_base) before the head
        "minicpm3": lambda: t.MiniCPM3Config(
            num_key_value_heads=4,
            head_dim=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            kv_lora_rank=16,
            q_lora_rank=16,
            dim_model_base=64,
            **RMS,
        ),
        # its attention's SDPA output: torch.onnx fails on the strides torch.export recorded (exported eager instead)
        # (its dynamic mask keeps every key up to keep_window_size, here the context, as Doge's checkpoints have it)
        "doge": lambda: t.DogeConfig(num_key_value_heads=2, keep_window_size=32, **RMS),
    }
    config = configs[model_type]()
    for key, value in changes.items():
        setattr(config, key, value)
    return config


FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "exaone4",
    "glm4",
    "granite",
    "smollm3",
    "olmo",
    "phi",
    "gpt2",
    "gpt_neox",
    "opt",
    "bloom",
    "falcon",
    "falcon_new",
    "stablelm",
    "stablelm_parallel",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)
UNLISTED = (
    "cohere",
    "persimmon",
    "starcoder2",
    "olmoe",
    "granitemoe",
    "gpt_oss",
    "deepseek_v3",
    "llama4_text",
    "gemma4_text",
    "minicpm3",
    "nemotron",
)


def tapered_tiny_model(model_type: str, taper: str = "internal", **changes):
    """A tiny tapered model at g = 0 (Internal-Taper unless `taper` says) with norm parameters away from their
    defaults (no training needed); `changes` set on its tiny config."""
    import torch
    import transformers

    from taperfold.hf import taper_model

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **changes)).eval()
    tapering = taper_model(model, taper)
    with torch.no_grad():
        for norm in tapering.norms.values():
            norm.weight_tilde.uniform_(0.5, 1.5)
            norm.c.fill_(0.7)
            norm.calibrated.fill_(True)
    tapering.set_gate(0.0)
    return model


def dyt_tiny_model(model_type: str, taper: str = "all", **changes):
    """A tiny model with DyT in its norms' places (`taper_model(..., kind="dyt")`; every norm, the final one too,
    unless `taper` says), α, γ and β away from where a DyT starts; `changes` set on its tiny config."""
    import torch
    import transformers

    from taperfold.hf import taper_model

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **changes)).eval()
    tapering = taper_model(model, taper, kind="dyt")
    with torch.no_grad():
        for norm in tapering.norms.values():
            norm.alpha.uniform_(0.3, 1.0)
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.1, 0.1)
    return model
