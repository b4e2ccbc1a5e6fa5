"""DyT (tanh(α·h)·γ + β) in real torch.onnx exports: detect finds it whatever module wrote it, the fold moves γ and β
into the readers and keeps the tanh, and nothing else that uses a tanh is taken for one."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch
from fold_models import export, norm_modules, tiny_model
from torch import nn

from taperfold.onnx_io import load_model
from taperfold.passes import NormStatus, detect_norms, fold_onnx_file
from taperfold.passes.check_fold import check_fold

pytest.importorskip("transformers")

FEEDS = {"input_ids": [2, 7], "attention_mask": [2, 7]}


class UsersDyT(nn.Module):
    """DyT as a user writes it, operands the other way round and a class name taperfold does not know."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.8))
        self.weight = nn.Parameter(torch.exp(0.5 * torch.randn_like(weight)))  # γ over a wide range
        self.bias = nn.Parameter(torch.randn_like(weight))

    def forward(self, h):
        return self.weight * torch.tanh(h * self.alpha) + self.bias


def with_dyt(family: str, users: bool = False) -> tuple[nn.Module, int]:
    """A tiny transformers model of `family` with every norm swapped for DyT (taperfold's, through
    taperfold.hf.taper_model, or a user's own class), α, γ, β random and wide so that a wrong fold shows."""
    from taperfold.hf import taper_model

    torch.manual_seed(1)
    model = tiny_model(family)
    if users:
        for name, norm in norm_modules(model):
            model.set_submodule(name, UsersDyT(norm.weight, getattr(norm, "bias", None)))
        return model, len(norm_modules(tiny_model(family)))
    tapering = taper_model(model, "all", kind="dyt")
    with torch.no_grad():
        for norm in tapering.norms.values():
            norm.alpha.uniform_(0.3, 1.5)
            norm.weight.copy_(torch.exp(0.5 * torch.randn_like(norm.weight)))
            norm.bias.normal_()
    return model, len(tapering.norms)


def ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


# ONNX Runtime's RotaryEmbedding kernel refuses the dynamic-shape opset-23 export of a RoPE model: GPT-2 there
@pytest.mark.parametrize(
    "family,exporter,opset", [("llama", "dynamo", 20), ("llama", "legacy", 18), ("gpt2", "dynamo", 23)]
)
@pytest.mark.parametrize("users", [False, True], ids=["taperfold-dyt", "users-dyt"])
def test_every_dyt_folds_its_gain_and_shift_and_keeps_its_tanh(tmp_path, family, exporter, opset, users):
    model, norms = with_dyt(family, users)
    src = export(model, tmp_path / "m.onnx", exporter, opset)
    report = fold_onnx_file(src, tmp_path / "folded.onnx")
    assert [(e.kind, e.status, e.reason) for e in report.norms] == [
        ("dyt", NormStatus.FOLDED, "γ, β folded, tanh kept")
    ] * norms
    before, after = ops(src), ops(tmp_path / "folded.onnx")
    assert after["Tanh"] == before["Tanh"] >= norms  # the tanh is per element: it stays (GPT-2's GELU has one too)
    check = check_fold(src, tmp_path / "folded.onnx", FEEDS)
    (logits,) = check.outputs
    assert check.passed and logits.metrics.max_rel <= 1e-5, logits.metrics


def test_the_fold_is_the_dyt_arithmetic_a_wrong_gain_shows(tmp_path):
    """The check above can fail: fold a model, then compare it with the same model whose γ, or β, differs by 1 %."""
    model, _ = with_dyt("llama")
    src = export(model, tmp_path / "m.onnx", "dynamo", 20)
    fold_onnx_file(src, tmp_path / "folded.onnx")
    for name in ("weight", "bias"):
        changed, _ = with_dyt("llama")
        with torch.no_grad():
            getattr(changed.model.norm, name).mul_(1.01)
        other = export(changed, tmp_path / f"{name}.onnx", "dynamo", 20)
        check = check_fold(other, tmp_path / "folded.onnx", FEEDS)
        (logits,) = check.outputs
        assert logits.metrics.max_rel > 1e-4, name


def test_gpt2_with_dyt_folds_into_conv1d_readers_and_its_gelu_tanh_is_no_dyt(tmp_path):
    # GPT-2's MLP activation is tanh-based (gelu_new): 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))), never a DyT
    model, norms = with_dyt("gpt2")
    src = export(model, tmp_path / "m.onnx", "dynamo", 20)
    report = fold_onnx_file(src, tmp_path / "folded.onnx")
    assert report.count(NormStatus.FOLDED) == norms and len(report.norms) == norms
    check = check_fold(src, tmp_path / "folded.onnx", FEEDS)
    assert check.passed and check.outputs[0].metrics.max_rel <= 1e-5
    plain = export(tiny_model("gpt2"), tmp_path / "plain.onnx", "dynamo", 20)
    assert ops(plain)["Tanh"] > 0
    assert [n.kind for n in detect_norms(load_model(plain)).real_norms] == ["ln"] * norms
    assert detect_norms(load_model(plain)).candidates == []


def test_a_post_norm_dyt_stays_its_gain_cannot_pass_the_tanh(tmp_path):
    """Gemma 2's post-norms read a projection's output; a DyT there has its tanh between γ and the projection."""
    model, norms = with_dyt("gemma2")
    src = export(model, tmp_path / "m.onnx", "dynamo", 20)
    report = fold_onnx_file(src, tmp_path / "folded.onnx")
    kept = [e for e in report.norms if e.status == NormStatus.KEPT]
    assert {e.name.rpartition(".")[2] for e in kept} == {"post_attention_layernorm", "post_feedforward_layernorm"}
    assert report.count(NormStatus.FOLDED) == norms - len(kept)
    check = check_fold(src, tmp_path / "folded.onnx", FEEDS)
    assert check.passed and check.outputs[0].metrics.max_rel <= 1e-5
