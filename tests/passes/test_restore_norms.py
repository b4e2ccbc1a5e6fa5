"""RestoreNormsPass: the baseline's real norms put back where the unfolded graph holds their constant maps, checked by
running both in ONNX Runtime against the norm computed in numpy."""

from __future__ import annotations

import numpy as np
import pytest
from _graphs import F32, D, N, X, build, n, ops, rand, rel_err, run, x3

from taperfold.passes.detect import detect_norms
from taperfold.passes.restore_norms import RealNorm, RestoreNormsPass

EPS = 1e-5
CLASSES = ("taperfold.nn.TaperNorm", "torch.nn.modules.normalization.RMSNorm")


def _rms_then_matmul(opset: int, scale: np.ndarray):
    weight = rand(D, N)
    nodes = [n("Mul", ["x", "s"], ["h"]), n("MatMul", ["h", "W"], ["y"])]
    return build(nodes, [X], [("y", F32, [2, 3, N])], {"s": scale, "W": weight}, opset=opset), weight


@pytest.mark.parametrize("opset, op", [(18, "ReduceMean"), (23, "RMSNormalization")])
def test_an_rms_norms_constant_map_becomes_the_norm_it_stands_for(opset, op):
    # below opset 23 the exporter's decomposed form (FuseRMSNormPass fuses it for ONNX Runtime), from 23 ONNX's op
    c, weight_tilde, gain = 0.7, rand(D), rand(D)
    scale = (c * weight_tilde).astype(np.float32)
    model, weight = _rms_then_matmul(opset, scale)
    (name,) = [candidate.name for candidate in detect_norms(model).candidates]
    norm = RealNorm(False, gain.astype(np.float64), None, EPS, scale.astype(np.float64), None, CLASSES)
    restore = RestoreNormsPass({name: norm})
    restore(model)
    assert restore.missing == [] and ops(model)[op] == 1, ops(model)
    feeds = x3()
    x = feeds["x"].astype(np.float64)
    expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + EPS) * gain @ weight
    assert rel_err(expected, run(model, feeds)[0]) < 1e-5


@pytest.mark.parametrize("shifted", [True, False])
def test_a_layernorms_centred_map_and_shift_become_layer_normalization(shifted):
    # without a shift: a LayerNorm class with no β (Cohere's), whose tapered norm trained one all the same
    c, weight_tilde, gain, beta = 1.3, rand(D), rand(D), rand(D)
    scale = (c * weight_tilde).astype(np.float32)
    weight = rand(D, N)
    nodes = [
        n("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
        n("Sub", ["x", "mean"], ["centred"]),
        n("Mul", ["centred", "s"], ["scaled"]),
        n("Add", ["scaled", "b"], ["h"]),
        n("MatMul", ["h", "W"], ["y"]),
    ]
    model = build(nodes, [X], [("y", F32, [2, 3, N])], {"axes": np.array([-1]), "s": scale, "b": beta, "W": weight})
    (name,) = [candidate.name for candidate in detect_norms(model).candidates]
    real_beta = rand(D) if shifted else None
    norm = RealNorm(
        True,
        gain.astype(np.float64),
        real_beta if real_beta is None else real_beta.astype(np.float64),
        EPS,
        scale.astype(np.float64),
        beta.astype(np.float64),
        CLASSES,
    )
    RestoreNormsPass({name: norm})(model)
    assert ops(model) == {"LayerNormalization": 1, "MatMul": 1}, ops(model)
    feeds = x3()
    x = feeds["x"].astype(np.float64)
    centred = x - x.mean(-1, keepdims=True)
    normed = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + EPS) * gain
    expected = (normed + (real_beta if shifted else 0.0)) @ weight
    assert rel_err(expected, run(model, feeds)[0]) < 1e-5


def test_a_norm_whose_map_is_not_in_the_graph_leaves_it_as_it_was():
    # another scale than the tapered norm's c·γ̃: not its map; the export then traces the baseline model
    scale = rand(D)
    model, _ = _rms_then_matmul(18, scale)
    (name,) = [candidate.name for candidate in detect_norms(model).candidates]
    before = ops(model)
    norm = RealNorm(False, np.ones(D), None, EPS, 2.0 * scale.astype(np.float64), None, CLASSES)
    restore = RestoreNormsPass({name: norm, "model.layers.0.absent_norm": norm})
    restore(model)
    assert restore.missing == [name, "model.layers.0.absent_norm"] and ops(model) == before
