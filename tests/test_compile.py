"""`bench --compile`: every variant compiled on its own (its own code object, so dynamo's per-code recompile limit
counts one variant's shapes), no fallback to eager, compile time logged apart from the timed calls.
Inductor compiles C++ on this CPU machine: a few seconds per graph, so the model is one layer wide and short."""

import numpy as np
import pytest
import torch

from taperfold.checkpoint import checkpoint_from_model
from taperfold.errors import TaperfoldError
from taperfold.models import ModelConfig, build_model
from taperfold.runners.torch_runner import TorchRunner, own_forward
from taperfold.variants import build_variants

SHAPES = [(1, 8), (2, 16)]


@pytest.fixture(scope="module")
def variants():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg)
    for norm in model.tapered_norms().values():
        norm.weight_tilde.data.uniform_(0.5, 1.5)
        norm.calibrated.fill_(True)
    model.set_gate(0.0)
    return build_variants(checkpoint_from_model(model, step=0), ["baseline", "folded"], torch.float32)


def test_own_forward_is_a_new_code_object_that_computes_the_same(variants):
    model = variants["folded"]
    forward = own_forward(model)
    assert forward.__func__.__code__ is not type(model).forward.__code__
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(forward(ids, logits="all"), model(ids, logits="all"), rtol=0, atol=0)


@pytest.mark.slow
def test_each_variant_compiles_its_own_graphs_without_fallback(variants):
    import torch._dynamo.config as dynamo
    from torch._dynamo.utils import counters

    # Two variants x two shapes = 4 graphs. Through one shared code object a limit of 2 is hit at the third
    # (checked by hand: FailOnRecompileLimitHit); with a code object per variant each needs only 2.
    with dynamo.patch(recompile_limit=2):
        _compile_two_variants(variants, counters)


def _compile_two_variants(variants, counters):
    graphs_before = counters["stats"]["unique_graphs"]
    rng = np.random.default_rng(0)
    for name, model in variants.items():
        runner = TorchRunner(model, compile=True, shapes=len(SHAPES), name=name)
        with runner:
            for batch, seq in SHAPES:
                ids = rng.integers(0, 64, (batch, seq))
                out, seconds = runner.timed_run(runner.prepare({"input_ids": ids}))
                with torch.no_grad():
                    expected = model(torch.from_numpy(ids))
                torch.testing.assert_close(out["logits"], expected, rtol=1e-4, atol=1e-5)
                assert seconds > 0
            # one compile per shape, logged apart from the timed call; a second call compiles nothing
            assert [kind for kind, _, _ in runner.setup_log] == ["compile", "compile"]
            assert all(seconds > 0 for _, _, seconds in runner.setup_log)
            runner.timed_run(runner.prepare({"input_ids": rng.integers(0, 64, SHAPES[0])}))
            assert len(runner.setup_log) == 2
            assert runner.execution == "compile:default"
    assert counters["stats"]["unique_graphs"] - graphs_before == len(variants) * len(SHAPES)


@pytest.mark.slow
def test_hitting_the_recompile_limit_is_one_error_not_eager(variants):
    import torch._dynamo.config as dynamo

    runner = TorchRunner(variants["baseline"], compile=True, shapes=1, name="baseline (test)")
    with dynamo.patch(recompile_limit=1), runner:
        runner.timed_run(runner.prepare({"input_ids": np.zeros((1, 8), dtype=np.int64)}))
        with pytest.raises(TaperfoldError) as info:
            runner.timed_run(runner.prepare({"input_ids": np.zeros((1, 12), dtype=np.int64)}))
    message = str(info.value)
    assert message.startswith("baseline (test): torch.compile failed instead of falling back to eager")
    assert "RecompileLimit" in message and "\n" not in message


def test_bad_compile_mode_is_refused(variants):
    with pytest.raises(TaperfoldError, match=r"torch\.compile mode must be one of"):
        TorchRunner(variants["folded"], compile=True, compile_mode="fast")
