"""Folds of graphs exported by torch.onnx (dynamo, legacy, unoptimized) from small hand-written modules."""

from __future__ import annotations

import warnings

import onnx_ir as ir
import pytest
import torch
from _graphs import D, N, V, rand, rel_err, run
from torch import nn

from taperfold.passes import detect_norms, fold_onnx_file


class TaperNorm(nn.Module):
    """g·RMSNorm(h) + (1-g)·c·h·w̃; exported at g = 0 as the constant diagonal map."""

    def __init__(self, d, g=0.0):
        super().__init__()
        self.g = g
        self.c = nn.Parameter(torch.tensor(0.7))
        self.weight = nn.Parameter(torch.randn(d))
        self.weight_tilde = nn.Parameter(torch.randn(d))

    def forward(self, h):
        if self.g == 0:
            return h * self.c * self.weight_tilde
        rms = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.g * rms + (1 - self.g) * self.c * h * self.weight_tilde


class TaperLN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c = nn.Parameter(torch.tensor(0.7))
        self.weight_tilde = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, h):
        hc = h - h.mean(-1, keepdim=True)
        return hc * self.c * self.weight_tilde + self.bias


class Block(nn.Module):
    def __init__(self, norm, d=D):
        super().__init__()
        self.input_layernorm = norm
        self.q_proj, self.v_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=True)

    def forward(self, x):
        h = self.input_layernorm(x)
        return x + self.q_proj(h) * self.k_proj(h) + self.v_proj(h)


class TinyLM(nn.Module):
    """Tied embedding / lm_head around one block and a final norm."""

    def __init__(self, g=0.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layer = Block(TaperNorm(D, g))
        self.norm = TaperNorm(D, g)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        return self.lm_head(self.norm(self.layer(self.embed_tokens(ids))))


def export(module, args, path, dynamo):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"optimize": False} if dynamo == "unoptimized" else {} if dynamo else {"opset_version": 17}
        torch.onnx.export(module.eval(), args, str(path), dynamo=bool(dynamo), input_names=["x"], **kwargs)
    return str(path)


def fold_file_checked(tmp_path, src, feeds, tol=1e-5):
    dst = str(tmp_path / "folded.onnx")
    report = fold_onnx_file(src, dst)
    for a, b in zip(run(src, feeds), run(dst, feeds), strict=True):
        assert rel_err(a, b) <= tol
    return report, ir.load(dst)


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [True, False, "unoptimized"])
@pytest.mark.parametrize("norm", [TaperNorm, TaperLN])
def test_torch_block_exports(tmp_path, norm, dynamo):
    torch.manual_seed(0)
    x = torch.randn(2, 3, D)
    src = export(Block(norm(D)), (x,), tmp_path / "block.onnx", dynamo)
    report, folded = fold_file_checked(tmp_path, src, {"x": x.numpy()})
    (entry,) = report.norms
    assert entry.status == "folded" and len(entry.consumers) == 3
    if dynamo:  # the module path, from the exporter's metadata
        assert entry.name == "input_layernorm"
    else:  # no metadata: a node of the norm, by the name the exporter gave it (gone from the folded graph)
        assert entry.name in {node.name for node in ir.load(src).graph} - {node.name for node in folded.graph}
    assert not detect_norms(folded)  # nothing of the norm is left


@pytest.mark.slow
def test_torch_tied_lm(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 5))
    src = export(TinyLM(), (ids,), tmp_path / "lm.onnx", dynamo="unoptimized")
    report, _ = fold_file_checked(tmp_path, src, {"x": ids.numpy()})
    assert [e.name for e in report.norms] == ["layer.input_layernorm", "norm"]
    assert {e.status.value for e in report.norms} == {"folded"}
    # the tied table: whichever of its names the exporter kept, read by the embedding's Gather and by the head
    name = next(node.inputs[0].name for node in ir.load(src).graph if node.op_type == "Gather")
    assert report.norms[1].copied[0].startswith(f"{name} -> {name}.folded (also read by")
    table = [ir.load(path).graph.initializers[name].const_value.tobytes() for path in (src, report.output)]
    assert table[0] == table[1]  # the embedding lookup still reads the original, tied table


@pytest.mark.slow
def test_tapered_layer_with_gate_not_zero_is_not_foldable(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 5))
    src = export(TinyLM(g=0.5), (ids,), tmp_path / "lm.onnx", dynamo=True)
    report, folded = fold_file_checked(tmp_path, src, {"x": ids.numpy()}, tol=0)
    assert [(e.name, e.status.value) for e in report.norms] == [
        ("layer.input_layernorm", "not_foldable"),
        ("norm", "not_foldable"),
    ]
    assert all("gate ≠ 0" in e.reason for e in report.norms)
    assert len(folded.graph) == report.nodes_before


@pytest.mark.slow
def test_ordinary_rms_norm_weight_is_left_alone(tmp_path):
    # nn.RMSNorm's γ is a Mul by a constant vector, but its module computes statistics: not a taper norm.
    module = nn.Sequential(nn.RMSNorm(D), nn.Linear(D, N, bias=False))
    nn.init.normal_(module[0].weight)
    src = export(module, (torch.randn(2, 3, D),), tmp_path / "rms.onnx", dynamo=True)
    report, folded = fold_file_checked(tmp_path, src, {"x": rand(2, 3, D)}, tol=0)
    assert [(e.name, e.status.value) for e in report.norms] == [("0", "real_norm")]
    assert len(folded.graph) == report.nodes_before
