"""detect_norms alone: a pure analysis that tells candidates, real norms and non-norms apart."""

from __future__ import annotations

import numpy as np
import pytest
from _graphs import F32, I64, RMS_CONSTS, D, N, X, build, mul_matmul, n, rand, rms_real, serialized

from taperfold.passes.detect import detect_norms


def ln_head(x="x", prefix=""):
    return [n("ReduceMean", [x, "axes"], [f"{prefix}m"], keepdims=1), n("Sub", [x, f"{prefix}m"], [f"{prefix}xc"])]


def test_analysis_changes_nothing():
    model = mul_matmul(rand(D))
    before = serialized(model)
    analysis = detect_norms(model)
    assert [c.kind for c in analysis.candidates] == ["rms"] and serialized(model) == before


def test_ln_form_with_beta():
    model = build(
        [
            *ln_head(),
            n("Mul", ["xc", "c"], ["hc"]),
            n("Mul", ["hc", "w"], ["hw"]),
            n("Add", ["hw", "b"], ["h"]),
            n("MatMul", ["h", "W"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N])],
        {"axes": np.array([-1]), "c": np.array(0.5, np.float32), "w": rand(D), "b": rand(D), "W": rand(D, N)},
    )
    (candidate,) = detect_norms(model).candidates
    match = candidate.match
    assert match.kind == "ln" and match.centered and match.bias is not None
    assert [node.op_type for node in match.nodes] == ["ReduceMean", "Sub", "Mul", "Mul", "Add"]
    np.testing.assert_allclose(match.scale, 0.5 * model.graph.initializers["w"].const_value.numpy())


def test_parallel_residual_shared_centering_gives_two_ln_candidates():
    # GPT-NeoX: two tapered LNs read one input; the exporter computes mean and x - mean once.
    model = build(
        [
            *ln_head(),
            n("Mul", ["xc", "w1"], ["h1"]),
            n("Mul", ["xc", "w2"], ["h2"]),
            n("MatMul", ["h1", "W1"], ["a"]),
            n("MatMul", ["h2", "W2"], ["b"]),
            n("Add", ["a", "b"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N])],
        {"axes": np.array([-1]), "w1": rand(D), "w2": rand(D), "W1": rand(D, N), "W2": rand(D, N)},
    )
    analysis = detect_norms(model)
    assert [(c.kind, c.match.centered) for c in analysis.candidates] == [("ln", True), ("ln", True)]
    assert analysis.real_norms == [] and analysis.gate_not_zero == []


def test_parallel_norms_with_equal_c_share_the_scalar_and_stay_two_candidates():
    # Equal c: the exporter computes (x - mean)·c once and each norm multiplies by its own γ̃ after it.
    model = build(
        [
            *ln_head(),
            n("Mul", ["xc", "c"], ["xs"]),
            n("Mul", ["xs", "w1"], ["h1"]),
            n("Mul", ["xs", "w2"], ["h2"]),
            n("MatMul", ["h1", "W1"], ["a"]),
            n("MatMul", ["h2", "W2"], ["b"]),
            n("Add", ["a", "b"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N])],
        {
            "axes": np.array([-1]),
            "c": np.array(0.5, np.float32),
            "w1": rand(D),
            "w2": rand(D),
            "W1": rand(D, N),
            "W2": rand(D, N),
        },
    )
    first, second = detect_norms(model).candidates  # the shared (x - mean)·c is no third one
    for candidate, w in ((first, "w1"), (second, "w2")):
        assert [node.op_type for node in candidate.match.nodes] == ["ReduceMean", "Sub", "Mul", "Mul"]
        np.testing.assert_allclose(candidate.match.scale, 0.5 * model.graph.initializers[w].const_value.numpy())


def test_a_weightless_layer_norm_at_gate_0_is_a_candidate_of_one_scale_for_every_channel():
    # OLMo's LayerNorm has no γ: at g = 0 it is (x - mean)·c.
    model = build(
        [*ln_head(), n("Mul", ["xc", "c"], ["h"]), n("MatMul", ["h", "W"], ["y"])],
        [X],
        [("y", F32, [2, 3, N])],
        {"axes": np.array([-1]), "c": np.array(0.5, np.float32), "W": rand(D, N)},
    )
    (candidate,) = detect_norms(model).candidates
    assert candidate.match.centered and candidate.match.scale.tolist() == [0.5] * D


def test_a_scalar_multiple_of_an_uncentred_value_is_no_norm():
    model = build(
        [n("Mul", ["x", "c"], ["h"]), n("MatMul", ["h", "W"], ["y"])],
        [X],
        [("y", F32, [2, 3, N])],
        {"c": np.array(0.5, np.float32), "W": rand(D, N)},
    )
    assert detect_norms(model).candidates == []


@pytest.mark.parametrize("gain", [True, False])
def test_real_rms_norm_is_a_real_norm_not_a_candidate(gain):
    model = build(
        [*rms_real(gain), n("MatMul", ["h", "W"], ["y"])],
        [X],
        [("y", F32, [2, 3, N])],
        {**RMS_CONSTS, "g": rand(D), "W": rand(D, N)},
    )
    analysis = detect_norms(model)
    assert analysis.candidates == []
    (real,) = analysis.real_norms
    assert real.kind == "rms" and "rsqrt" in real.form and (real.gain is not None) == gain


def test_real_layer_norm_decomposed_and_fused():
    decomposed = [
        *ln_head(),
        n("Pow", ["xc", "two"], ["sq"]),
        n("ReduceMean", ["sq", "axes"], ["var"], keepdims=1),
        n("Add", ["var", "eps"], ["ve"]),
        n("Sqrt", ["ve"], ["std"]),
        n("Div", ["xc", "std"], ["xn"]),
        n("Mul", ["xn", "g"], ["xg"]),
        n("Add", ["xg", "b"], ["h"]),
        n("MatMul", ["h", "W"], ["y"]),
    ]
    fused = [n("LayerNormalization", ["x", "g", "b"], ["h"], axis=-1), n("MatMul", ["h", "W"], ["y"])]
    for nodes in (decomposed, fused):
        model = build(nodes, [X], [("y", F32, [2, 3, N])], {**RMS_CONSTS, "g": rand(D), "b": rand(D), "W": rand(D, N)})
        analysis = detect_norms(model)
        assert analysis.candidates == [] and [r.kind for r in analysis.real_norms] == ["ln"]
        assert analysis.real_norms[0].gain.bias is not None


def test_softmax_written_out_is_not_a_norm():
    model = build(
        [
            n("Exp", ["x"], ["e"]),
            n("ReduceSum", ["e", "axes"], ["s"], keepdims=1),
            n("Div", ["e", "s"], ["p"]),
            n("Mul", ["p", "w"], ["h"]),
            n("MatMul", ["h", "W"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N])],
        {"axes": np.array([-1]), "w": rand(D), "W": rand(D, N)},
    )
    analysis = detect_norms(model)
    assert analysis.real_norms == [] and len(analysis.candidates) == 1


def test_rope_positions_times_frequencies_are_not_a_norm():
    # position ids (int) -> Cast -> Mul by inv_freq [d/2]: a broadcast outer product, not a channel scale.
    model = build(
        [
            n("Unsqueeze", ["pos", "ax"], ["p3"]),
            n("Cast", ["p3"], ["pf"], to=F32),
            n("Mul", ["pf", "inv_freq"], ["freqs"]),
        ],
        [("pos", I64, None)],
        [("freqs", F32, None)],
        {"ax": np.array([-1]), "inv_freq": rand(4)},
    )
    assert not detect_norms(model)


def test_scale_fed_as_a_graph_input_is_not_a_match():
    # An initializer that is also a graph input can be overridden at run time: not a constant.
    model = mul_matmul(rand(D))
    model.graph.inputs.append(model.graph.initializers["s"])
    assert not detect_norms(model)


def test_scalar_only_chain_is_not_a_norm():
    assert not detect_norms(mul_matmul(np.array(0.5, np.float32)))


@pytest.mark.parametrize(
    "module, note",
    [
        ("model.layers.0: transformers.models.gemma3n.modeling_gemma3n.Gemma3nTextDecoderLayer", True),
        ("model.layers.0.input_layernorm: fold_models.ConstantRMSNorm", False),  # a norm at g = 0, as tests/passes make
        (None, False),  # no metadata (a legacy export): nothing to tell
    ],
)
def test_a_scale_no_norm_module_applies_folds_and_the_report_says_it_is_none(module, note):
    # Gemma 3n's AltUp multiplies by a learned per-channel vector in the decoder layer itself: the fold moves it as it
    # moves a g = 0 norm, and the report names what it is
    from taperfold.passes import fold_model

    model = mul_matmul(rand(D))
    if module is not None:
        for node in model.graph:
            around = module if node.op_type == "Mul" else "model.layers.0.mlp.up_proj: torch.nn.Linear"
            node.metadata_props["namespace"] = f": m.LM/{around}/{node.op_type.lower()}: aten.{node.op_type.lower()}"
    (candidate,) = detect_norms(model).candidates
    assert candidate.outside_norm is note
    (entry,) = fold_model(model).norms
    assert entry.status.value == "folded"
    assert ("no norm module: a per-channel scale the model applies itself" in entry.reason) is note


def test_a_scale_no_norm_module_applies_that_stays_is_said_to_be_none():
    # Bamba's Mamba mixer multiplies by exp(A_log)-like per-channel vectors read by Exp: kept, and the report must not
    # leave a user thinking a norm stayed behind
    from taperfold.passes import fold_model

    model = build([n("Mul", ["x", "s"], ["h"]), n("Exp", ["h"], ["y"])], [X], [("y", F32, [2, 3, D])], {"s": rand(D)})
    for node in model.graph:
        node.metadata_props["namespace"] = (
            f": m.LM/model.layers.0.mamba: transformers.models.bamba.modeling_bamba.BambaMixer/{node.op_type.lower()}: "
            f"aten.{node.op_type.lower()}"
        )
    (entry,) = fold_model(model).norms
    assert entry.status.value == "kept" and "Exp" in entry.reason, entry
    assert "no norm module: a per-channel scale the model applies itself" in entry.reason
