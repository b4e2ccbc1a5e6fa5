"""Variants of one tapered model, built in PyTorch: the benchmark's baseline (plain norms: `nn.RMSNorm`, whose
forward is the fused `F.rms_norm`, or `nn.LayerNorm`), the same with hand-written norms (Hugging Face's
RMSNorm: the `baseline-decomposed` variant), the torch-level fold (the ONNX passes' counterpart), and a
random-weight model at g = 0 for timing without training."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from taperfold.families import family
from taperfold.models import CausalLM, build_model, preset_config
from taperfold.nn import TaperLN, TaperNorm


def baseline_of(model: CausalLM) -> CausalLM:
    """The same architecture and weights with ordinary RMSNorm / LayerNorm where the model tapers (γ, β kept)."""
    cfg = replace(model.cfg, taper="none", aux=False)
    base = build_model(cfg)
    state = {k: v for k, v in model.state_dict().items() if k in base.state_dict()}
    base.load_state_dict(state, strict=True)
    return base.to(next(model.parameters()).dtype)


class HandWrittenRMSNorm(nn.Module):
    """Hugging Face's `LlamaRMSNorm`: float32 statistics by elementwise ops, then the weight in the input dtype.
    Its ops run one kernel each (no fused F.rms_norm); the exporter writes it as plain ops below opset 23."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps

    def forward(self, h):
        dtype = h.dtype
        h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class HandWrittenLayerNorm(nn.Module):
    """LayerNorm as elementwise ops (mean, variance, scale, shift), the way hand-written LN code computes it."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, h):
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).pow(2).mean(-1, keepdim=True)
        out = (h - mean) * torch.rsqrt(var + self.eps) * self.weight
        return out + self.bias if self.bias is not None else out


def decomposed_baseline_of(model: CausalLM) -> CausalLM:
    """`baseline_of(model)` with every norm hand-written (same weights): the `baseline-decomposed` variant."""
    base = baseline_of(model)
    for name, module in list(base.named_modules()):
        if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
            hand = HandWrittenRMSNorm(module) if isinstance(module, nn.RMSNorm) else HandWrittenLayerNorm(module)
            base.set_submodule(name, hand)
    return base


@torch.no_grad()
def fold_model_in_torch(model: CausalLM) -> CausalLM:
    """The 'folded' benchmark variant in PyTorch: g = 0 tapered norms folded into their readers
    (float64, cast once) and replaced by Identity. The ONNX passes do the same on graphs."""
    if model.gate.value != 0.0:
        raise ValueError(f"gate is {model.gate.value:g}, not 0: the tapered norms are not constant maps")
    folded = copy.deepcopy(model)
    modules = dict(folded.named_modules())
    for norm_name, readers in family(folded.cfg.arch).norm_readers(folded.cfg).items():
        norm = modules[norm_name]
        if not isinstance(norm, (TaperNorm, TaperLN)):
            continue
        scale = norm.c.double() * norm.weight_tilde.double()
        for reader_name in readers:
            reader = modules[reader_name]
            if reader_name == "lm_head" and folded.cfg.tie_embeddings:
                reader.weight = nn.Parameter(reader.weight.detach().clone())  # untie: the embedding stays
            fold_into_reader(reader, scale, norm.bias.double() if isinstance(norm, TaperLN) else None)
        folded.set_submodule(norm_name, nn.Identity())
    return folded


def fold_into_reader(reader: nn.Module, scale: torch.Tensor, beta: torch.Tensor | None) -> None:
    """y = (c·(h − μ)·γ̃ + β) W + b  →  h W' + b'  with W' = (I − 11ᵀ/d) diag(s) W, b' = b + β W.
    Also the Hugging Face fold's (taperfold.hf.variants): transformers' Conv1D is not an nn.Linear either."""
    conv = not isinstance(reader, nn.Linear)  # nn.Linear stores [out, in]; GPT-2's Conv1D [in, out]
    w = reader.weight.double() if conv else reader.weight.double().T  # as [in, out]
    new_w = scale[:, None] * w
    if beta is not None:
        new_w = new_w - new_w.mean(dim=0, keepdim=True)
        shift = beta @ w
        if reader.bias is None:
            reader.bias = nn.Parameter(torch.zeros(w.shape[1], dtype=reader.weight.dtype, device=w.device))
        reader.bias.copy_((reader.bias.double() + shift).to(reader.bias.dtype))
    reader.weight.copy_((new_w if conv else new_w.T).to(reader.weight.dtype))


def without_norms(model: CausalLM) -> CausalLM:
    """The zero-residue reference (variant `nonorm`): the model with nothing where it has a tapered norm, its weights
    copied unscaled. A timing reference, not the same function; norms that do not taper (Internal-Taper's final
    norm) stay, as they stay in the folded model, so that folded vs nonorm measures what the fold leaves behind."""
    bare = copy.deepcopy(model)
    for name in model.tapered_norms():
        bare.set_submodule(name, nn.Identity())
    return bare


@torch.no_grad()
def random_gate0_model(preset: str, arch: str = "llama", seed: int = 0, **overrides) -> CausalLM:
    """A preset (with config `overrides`) at g = 0 with random weights, and random c and γ̃ in every tapered
    norm (never all ones: graph tools delete a multiply by ones, which would make the unfolded graph look
    like the folded one)."""
    torch.manual_seed(seed)
    model = build_model(preset_config(preset, arch=arch, **overrides))
    for norm in model.tapered_norms().values():
        norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))
        norm.weight_tilde.copy_(1 + 0.1 * torch.randn_like(norm.weight_tilde))
        norm.c.fill_(float(torch.empty(()).uniform_(0.5, 2.0)))
        norm.calibrated.fill_(True)
    model.set_gate(0.0)
    return model.eval()


def build_variants(tapered: CausalLM, names: list[str], dtype: torch.dtype) -> dict[str, CausalLM]:
    """The variants in `names` (canonical: baseline, unfolded, folded) of a tapered model at g = 0, all built
    from the fp32 model before any is cast (the fold runs in float64 and casts once)."""
    if getattr(tapered, "hf", None) is not None:  # a transformers model (taperfold.hf)
        from taperfold.hf.variants import build_variants as hf_variants

        return hf_variants(tapered, names, dtype)
    build = {"baseline": lambda: baseline_of(tapered), "unfolded": lambda: tapered,
             "folded": lambda: fold_model_in_torch(tapered),
             "baseline-decomposed": lambda: decomposed_baseline_of(tapered), "nonorm": lambda: without_norms(tapered)}
    models = {name: build[name]() for name in names}
    return {name: m.to(dtype).eval() for name, m in models.items()}
