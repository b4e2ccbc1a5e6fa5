"""TaperNorm / TaperLN against the paper's formulas (eq. 3–7, A.6, Prop. 4.3)."""

import itertools
import math

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from taperfold.nn import (
    GatedTaperNorm,
    GateSchedule,
    Gating,
    ScaleAnchorLoss,
    TaperGate,
    TaperLN,
    TaperNorm,
    bias_corrected,
)
from taperfold.norms import norm_kind

D = 16


def make(kind, g=1.0, seed=0):
    torch.manual_seed(seed)
    gate = TaperGate(g)
    layer = TaperNorm(D, gate) if kind == "rms" else TaperLN(D, gate)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.weight_tilde.uniform_(0.5, 1.5)
        layer.c.fill_(0.37)
        if kind == "ln":
            layer.bias.uniform_(-0.5, 0.5)
    return layer, gate


def tokens(n=64, scale=3.0, seed=1):
    torch.manual_seed(seed)
    return torch.randn(4, n, D) * scale + 0.5


def test_gate_one_is_rmsnorm():
    layer, _ = make("rms", 1.0)
    h = tokens()
    ref = torch.nn.RMSNorm(D, eps=layer.eps)
    ref.weight.data.copy_(layer.weight.data)
    manual = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.weight
    torch.testing.assert_close(layer(h), ref(h), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer(h), manual, rtol=1e-5, atol=1e-6)


def test_gate_one_is_layernorm():
    layer, _ = make("ln", 1.0)
    h = tokens()
    ref = torch.nn.LayerNorm(D, eps=layer.eps)
    ref.weight.data.copy_(layer.weight.data)
    ref.bias.data.copy_(layer.bias.data)
    torch.testing.assert_close(layer(h), ref(h), rtol=1e-6, atol=1e-6)


def test_gate_zero_is_constant_diagonal_map():
    layer, _ = make("rms", 0.0)
    h = tokens()
    torch.testing.assert_close(layer(h), 0.37 * h * layer.weight_tilde, rtol=1e-6, atol=1e-6)


def test_gate_zero_ln_is_affine():
    layer, _ = make("ln", 0.0)
    h = tokens()
    expected = 0.37 * (h - h.mean(-1, keepdim=True)) * layer.weight_tilde + layer.bias
    torch.testing.assert_close(layer(h), expected, rtol=1e-6, atol=1e-6)
    # affine: f(a + b) - f(b) = f(a) - f(0)
    a, b, z = h[0], h[1], torch.zeros_like(h[0])
    torch.testing.assert_close(layer(a + b) - layer(b), layer(a) - layer(z), rtol=1e-5, atol=1e-5)


def test_intermediate_gate_mixes_branches():
    for kind in ("rms", "ln"):
        layer, gate = make(kind, 0.3)
        h = tokens()
        gate.value = 1.0
        normed = layer(h)
        gate.value = 0.0
        scaled = layer(h)
        gate.value = 0.3
        torch.testing.assert_close(layer(h), 0.3 * normed + 0.7 * scaled, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_gate_zero_computes_no_per_token_scale_statistics(kind):
    layer, _ = make(kind, 0.0)
    graph = torch.fx.symbolic_trace(layer).graph
    calls = {str(n.target) for n in graph.nodes if n.op in ("call_function", "call_method")}
    assert not any(s in c for c in calls for s in ("rms_norm", "layer_norm", "sqrt", "pow", "var", "std"))
    # the LN form keeps one mean (its mean subtraction is affine and folds as I - 11ᵀ/d); RMS has none
    assert any("mean" in c for c in calls) == (kind == "ln")


def test_gate_schedule_boundaries():
    s = GateSchedule(taper_start=10, taper_end=30)
    assert s(0) == 1.0 and s(9) == 1.0 and s(10) == 1.0
    assert s(20) == pytest.approx(0.5)
    assert s(15) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    assert 0.0 < s(29) < 0.01
    assert s(30) == 0.0 and s(1000) == 0.0
    values = [s(k) for k in range(40)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    with pytest.raises(ValueError):
        GateSchedule(5, 5)


def test_ema_bias_correction():
    mu = 0.1
    ema, count = torch.tensor(0.0, dtype=torch.float64), torch.tensor(0)
    xs = [3.0, 5.0, 4.0]
    for x in xs:
        ema = (1 - mu) * ema + mu * x
        count += 1
    weights = [mu * (1 - mu) ** (len(xs) - 1 - i) for i in range(len(xs))]
    expected = sum(w * x for w, x in zip(weights, xs)) / sum(weights)
    assert float(bias_corrected(ema, count, mu)) == pytest.approx(expected, rel=1e-12)
    # a constant stream is recovered exactly after any number of updates
    ema, count = torch.tensor(0.0, dtype=torch.float64), torch.tensor(0)
    for _ in range(3):
        ema = (1 - mu) * ema + mu * 7.0
        count += 1
    assert float(bias_corrected(ema, count, mu)) == pytest.approx(7.0, rel=1e-12)


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_calibrated_c_is_least_squares_optimum(kind):
    layer, gate = make(kind, 1.0)
    layer.delta = 0.0
    gate.calibrating = True
    layer.train()
    h = tokens(scale=2.5)
    for _ in range(5):  # the same batch: the bias-corrected EMAs equal its means exactly
        layer(h)
    c = layer.calibrate()
    x = h.double()
    if kind == "ln":
        x = x - x.mean(-1, keepdim=True)
    scale = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + layer.eps)
    gamma = layer.weight.double()
    target = (x / scale * gamma).reshape(-1, 1)  # A(h), normalised branch
    basis = (x * gamma).reshape(-1, 1)  # B(h), scaling branch before c
    c_star = torch.linalg.lstsq(basis, target).solution.item()
    assert c == pytest.approx(c_star, rel=1e-6)
    torch.testing.assert_close(layer.weight_tilde, layer.weight)  # γ̃ ← γ
    assert bool(layer.calibrated)


def gated_reference(x, z, gamma, gating: Gating, eps=1e-6):
    """A gated RMSNorm as transformers' RMSNormGated classes write it (Mamba2's grouped one, the gated delta net's)."""
    act = F.silu if gating.activation == "silu" else torch.sigmoid
    h = x if gating.norm_first else x * act(z)
    grouped = h.unflatten(-1, (gating.groups, -1))
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * gamma
    return normed * act(z) if gating.norm_first else normed


GATINGS = [Gating("silu", True), Gating("sigmoid", True), Gating("silu", False, 4), Gating("silu", True, 2)]


@pytest.mark.parametrize("gating", GATINGS, ids=str)
def test_gated_taper_norm_is_the_gated_norm_at_gate_1_and_a_diagonal_map_times_the_gate_at_0(gating):
    gate = TaperGate(1.0)
    layer = GatedTaperNorm(D, gate, gating=gating)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.weight_tilde.uniform_(0.5, 1.5)
        layer.c.fill_(0.37)
    x, z = tokens(), tokens(seed=2)
    torch.testing.assert_close(layer(x, z), gated_reference(x, z, layer.weight, gating))
    gate.value = 0.0
    act = F.silu if gating.activation == "silu" else torch.sigmoid
    torch.testing.assert_close(layer(x, z), x * act(z) * 0.37 * layer.weight_tilde)
    # what a fold leaves in its place: the gate alone
    torch.testing.assert_close(norm_kind("rms").residue(layer)(x, z), x * act(z))


def test_grouped_calibration_is_the_least_squares_c_of_the_grouped_norm():
    gating = Gating("silu", False, 4)
    gate = TaperGate(1.0, calibrating=True)
    layer = GatedTaperNorm(D, gate, gating=gating).train()
    layer.delta = 0.0
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    x, z = tokens(scale=2.5), tokens(seed=2)
    for _ in range(5):
        layer(x, z)
    c = layer.calibrate()
    h = (x * F.silu(z)).double()
    target = gated_reference(x.double(), z.double(), layer.weight.double(), gating, layer.eps).reshape(-1, 1)
    basis = (h * layer.weight.double()).reshape(-1, 1)
    assert c == pytest.approx(torch.linalg.lstsq(basis, target).solution.item(), rel=1e-5)


def test_calibration_needs_samples():
    layer, _ = make("rms")
    with pytest.raises(RuntimeError, match="no EMA samples"):
        layer.calibrate()


def test_no_ema_update_outside_warmup():
    layer, gate = make("rms", 1.0)
    layer.train()
    layer(tokens())  # not calibrating
    assert int(layer.ema_count) == 0
    gate.calibrating = True
    layer.eval()
    layer(tokens())  # eval mode
    assert int(layer.ema_count) == 0


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("target_offset", [-0.5, 0.5])
def test_aux_loss_gradient_is_radial_with_prop_4_3_sign(kind, target_offset):
    torch.manual_seed(0)
    loss_fn = ScaleAnchorLoss(centered=norm_kind(kind).centered, weight=0.1, eps=1e-6)
    h = (torch.randn(1, 1, D) * 2 + (0.7 if kind == "ln" else 0.0)).double().requires_grad_()
    x = h.detach()[0, 0]
    centred = x - x.mean() if kind == "ln" else x
    s = torch.sqrt(centred.pow(2).mean() + 1e-6)
    loss_fn.target.fill_(float(s) - target_offset)  # r(h) above (offset > 0) or below the target
    loss_fn.frozen.fill_(True)
    loss_fn(h).backward()
    grad = h.grad[0, 0]
    expected = 2 * 0.1 * (s - loss_fn.target.double()) / (D * s) * centred
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-7)
    radial = torch.dot(grad, centred)
    assert (radial > 0) == (target_offset > 0)  # above target: a descent step shrinks the scale


def test_aux_loss_tracks_then_freezes():
    loss_fn = ScaleAnchorLoss(centered=False, weight=0.1, momentum=0.5)
    h = torch.randn(2, 8, D) * 3
    assert float(loss_fn(h, track=True)) == 0.0  # no target yet
    loss_fn(h, track=True)
    target = loss_fn.freeze()
    s = torch.sqrt(h.pow(2).mean(-1) + loss_fn.eps)
    assert target == pytest.approx(float(s.mean()), rel=1e-5)
    loss_fn(h * 2, track=True)  # frozen: no more tracking
    assert float(loss_fn.target) == pytest.approx(target)
    assert float(loss_fn(h)) == pytest.approx(float(0.1 * (s - target).pow(2).mean()), rel=1e-5)


def test_aux_loss_ignores_padding():
    loss_fn = ScaleAnchorLoss(centered=False, weight=1.0)
    loss_fn.target.fill_(1.0)
    loss_fn.frozen.fill_(True)
    h = torch.ones(1, 4, D)
    h[0, 3] = 100.0
    mask = torch.tensor([[1, 1, 1, 0]])
    assert float(loss_fn(h, mask)) == pytest.approx(0.0, abs=1e-5)
    assert float(loss_fn(h)) > 1.0


def test_half_precision_keeps_ema_in_float64():
    layer, _ = make("rms")
    layer.to(torch.bfloat16)
    assert layer.ema_num.dtype == torch.float64 and layer.weight.dtype == torch.bfloat16
    out = layer(tokens().bfloat16())
    assert out.dtype == torch.bfloat16
    assert F.mse_loss(out.float(), make("rms")[0](tokens())).item() < 1e-3
