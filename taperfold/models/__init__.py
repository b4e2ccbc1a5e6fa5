"""taperfold's own models: Llama and GPT-2 as readable PyTorch (one module each), their config and presets.

    build_model(preset_config("tiny", arch="llama"))     # plain norms, then tapered as cfg.taper says

Their norms and the layers that read them are described by the transformers families of the same names
(taperfold.families), so one tapering, one fold and one export serve them and transformers' models alike.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from unittest import mock

import torch
from torch import nn

from taperfold.families import family_for
from taperfold.models.base import CausalLM, num_parameters
from taperfold.models.config import TAPERS, ModelConfig, preset_config, validate_config
from taperfold.models.gpt2 import GPT2LMHeadModel
from taperfold.models.llama import LlamaForCausalLM
from taperfold.nn import ScaledEmbedding, TaperedNorm
from taperfold.presets import ARCHS, PRESETS
from taperfold.taper import taper_model

MODEL_CLASSES = {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel}  # one per ARCHS entry

__all__ = [
    "ARCHS",
    "PRESETS",
    "TAPERS",
    "CausalLM",
    "ModelConfig",
    "assign_weights",
    "baseline_of",
    "build_model",
    "build_with_weights",
    "num_parameters",
    "parameters_on_meta",
    "preset_config",
    "random_gate0_model",
    "validate_config",
]


# 1 / the embedding's initial std (0.02, models.base.init_weights): the residual stream starts at RMS 1, the scale a
# norm gives the blocks' inputs (DyT computes none: without it q/k gradients start below Adam's ε and do not learn)
EMBED_SCALE0 = 50.0


def build_model(cfg: ModelConfig) -> CausalLM:
    """The model `cfg` describes, tapered as `cfg.taper` says (at gate 1, before any calibration)."""
    model = MODEL_CLASSES[cfg.arch](cfg)
    if cfg.embed_scale:
        path = ARCHS[cfg.arch].embedding
        embedding = model.get_submodule(path)
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{cfg.arch}: {path} is a {type(embedding).__name__}, not the token embedding")
        model.set_submodule(path, ScaledEmbedding(embedding, EMBED_SCALE0))
    if cfg.taper != "none":
        tapering = taper_model(
            model,
            family_for(cfg.arch, "config"),
            cfg.taper,
            kind=cfg.norm,
            aux=cfg.aux,
            aux_weight=cfg.aux_weight,
            momentum=cfg.ema_momentum,
            delta=cfg.calib_delta,
        )
        if tapering.scale_loss is not None:
            model.scale_loss = tapering.scale_loss  # a submodule: its frozen target is saved with the checkpoint
    return model


def baseline_of(model: CausalLM) -> CausalLM:
    """The same architecture and weights with plain norms where the model tapers (γ, β kept): the baseline. For
    a DyT model, the arch's own norms where it has DyTs (γ, β copied): the same places, timed, not the same
    function."""
    cfg = replace(model.cfg, taper="none", norm=None, aux=False)
    with torch.device("meta"):  # its keys only
        keys = set(build_model(cfg).state_dict())
    # the baseline holds the model's own tensors (no copy): neither is changed in place
    base, missing, _ = build_with_weights(cfg, {k: v for k, v in model.state_dict().items() if k in keys})
    if missing:
        raise ValueError(f"the model has no {missing[0]!r} for its baseline")
    return base.to(next(model.parameters()).dtype)


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no initialisation) and their
    buffers as usual: the rotary tables and positions are computed at construction and are in no state dict."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:  # a meta one is a tie (lm_head = embedding): keep it
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    with mock.patch.object(nn.Module, "register_parameter", on_meta):
        yield


def assign_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Give `model` (built under `parameters_on_meta`) the tensors of `state` themselves: no second copy. A tensor of
    another dtype than the model's is cast (a copy, as load_state_dict makes); a tied weight (lm_head = embedding)
    stays one parameter whichever of its keys `state` has. Returns (missing keys, unexpected keys) as
    load_state_dict does; a missing parameter is left on the meta device, so the caller must refuse the model."""
    ties: dict[int, list[str]] = {}  # a parameter several modules hold: id -> all its names
    for name, param in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(param), []).append(name)
    expected = model.state_dict()
    state = {
        k: v.to(expected[k].dtype) if k in expected and v.dtype != expected[k].dtype else v for k, v in state.items()
    }
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    for names in (names for names in ties.values() if len(names) > 1):
        loaded = next((n for n in names if n in state), None)
        if loaded is None:
            continue  # none of its keys: reported missing
        for name in names:  # assign=True gave each key its own Parameter: one again
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(loaded))
        missing = [k for k in missing if k not in names]
    return missing, unexpected


def build_with_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[CausalLM, list[str], list[str]]:
    """The model `cfg` describes, holding the tensors of `state` themselves (`assign_weights`): no freshly
    initialised copy and no second one (a 5 GB checkpoint stays 5 GB once built). Returns (model, missing keys,
    unexpected keys)."""
    with parameters_on_meta():
        model = build_model(cfg)
    return (model, *assign_weights(model, state))


@torch.no_grad()
def random_gate0_model(preset: str, arch: str = "llama", seed: int = 0, **overrides) -> CausalLM:
    """A preset (with config `overrides`) at g = 0 with random weights, and random c and γ̃ in every tapered
    norm (never all ones: graph tools delete a multiply by ones, which would make the unfolded graph look
    like the folded one)."""
    torch.manual_seed(seed)
    model = build_model(preset_config(preset, arch=arch, **overrides))
    for norm in model.tapered_norms().values():
        if not isinstance(norm, TaperedNorm):  # a kind without a gate (DyT): random α, γ, β
            for p in norm.parameters():
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if p.numel() == 1 else 1 + 0.1 * torch.randn_like(p))
            continue
        norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))
        norm.weight_tilde.copy_(1 + 0.1 * torch.randn_like(norm.weight_tilde))
        norm.c.fill_(float(torch.empty(()).uniform_(0.5, 2.0)))
        norm.calibrated.fill_(True)
    model.set_gate(0.0)
    return model.eval()
