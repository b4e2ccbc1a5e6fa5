"""Reference models: Hugging Face names, KV cache, the torch-level fold, and a short real training run."""

import json

import pytest
import torch

from taperfold.families import family_for
from taperfold.models import (
    ARCHS,
    MODEL_CLASSES,
    baseline_of,
    build_model,
    num_parameters,
    preset_config,
    random_gate0_model,
)
from taperfold.nn import TaperLN, TaperNorm, bias_corrected
from taperfold.train import TrainOptions, train
from taperfold.variants import fold_in_torch


def random_tapered(arch, taper, seed=0, **kw):
    torch.manual_seed(seed)
    model = build_model(preset_config("tiny", arch=arch, taper=taper, **kw)).eval()
    with torch.no_grad():
        for norm in model.tapered_norms().values():
            norm.weight_tilde.uniform_(0.5, 1.5)
            norm.c.uniform_(0.2, 2.0)
            if isinstance(norm, TaperLN):
                norm.bias.uniform_(-0.2, 0.2)
    model.set_gate(0.0)
    return model


def test_hugging_face_parameter_names_and_layouts():
    llama = build_model(preset_config("tiny", arch="llama", taper="none")).state_dict()
    for key in (
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.mlp.gate_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert key in llama
    assert llama["model.layers.0.mlp.up_proj.weight"].shape == (512, 128)  # nn.Linear: [out, in]
    gpt2 = build_model(preset_config("tiny", arch="gpt2", taper="none")).state_dict()
    assert gpt2["transformer.h.0.attn.c_attn.weight"].shape == (128, 384)  # Conv1D: [in, out]
    for key in (
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.ln_1.bias",
        "transformer.h.0.mlp.c_fc.bias",
        "transformer.ln_f.weight",
    ):
        assert key in gpt2
    tapered = build_model(preset_config("tiny", arch="llama", taper="internal")).state_dict()
    assert "model.layers.0.input_layernorm.weight_tilde" in tapered and "model.norm.weight_tilde" not in tapered


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("llama", {"n_kv_heads": 2}), ("gpt2", {})])
def test_kv_cache_matches_full_forward(arch, kw):
    model = random_tapered(arch, "internal", **kw)
    ids = torch.randint(0, 256, (2, 12))
    full = model(ids, logits="all")
    logits, past = model(ids[:, :5], logits="all", use_cache=True)
    steps = [logits]
    for t in range(5, 12):
        step_logits, past = model(ids[:, t : t + 1], logits="all", past_key_values=past, use_cache=True)
        steps.append(step_logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model(ids, logits="last"), full[:, -1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("taper", ["internal", "all"])
def test_torch_fold_is_exact_and_leaves_embedding_alone(arch, taper):
    model = random_tapered(arch, taper)
    ids = torch.randint(0, 256, (2, 16))
    folded = fold_in_torch(model)
    torch.testing.assert_close(folded(ids, logits="all"), model(ids, logits="all"), rtol=1e-4, atol=1e-5)
    assert not any(isinstance(m, (TaperNorm, TaperLN)) for m in folded.modules())
    embed = folded.model.embed_tokens if arch == "llama" else folded.transformer.wte
    original = model.model.embed_tokens if arch == "llama" else model.transformer.wte
    assert torch.equal(embed.weight, original.weight)  # the shared table is not scaled
    assert (folded.lm_head.weight is embed.weight) == (taper == "internal")  # All-Taper unties the head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_fold_keeps_a_norm_whose_folded_weight_would_pass_the_dtypes_range(dtype):
    """q/k/v's column 0 scaled by c·γ̃₀ past the dtype's largest value: the fold leaves that norm (no Inf written),
    says why, folds the others, and the model computes what the unfolded one does."""
    model = random_tapered("llama", "internal").to(dtype)
    path, top = "model.layers.0.input_layernorm", torch.finfo(dtype).max
    layer = model.model.layers[0]
    with torch.no_grad():
        norm = model.get_submodule(path)
        norm.c.fill_(2.0)
        norm.weight_tilde[0] = top / 4  # scale 0.5·max: representable, but not times a weight of 10
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.weight[:, 0] = 10.0
        model.model.embed_tokens.weight[:, 0] = 8 / top  # h·c·γ̃₀ = 8: the unfolded model stays finite
    before = {name: p.clone() for name, p in model.named_parameters()}
    folded = fold_in_torch(model)
    assert list(folded.kept_norms) == [path]
    assert f"past {str(dtype).removeprefix('torch.')}'s range" in folded.kept_norms[path]
    assert isinstance(folded.get_submodule(path), TaperNorm)
    tapered = [p for p in model.tapered_norms() if p != path]
    assert not any(isinstance(folded.get_submodule(p), TaperNorm) for p in tapered)  # the others folded
    assert all(torch.isfinite(p).all() for p in folded.parameters())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # the source untouched
    ids = torch.randint(0, 256, (2, 16))
    want = model(ids, logits="all").float()
    assert torch.isfinite(want).all()
    torch.testing.assert_close(folded(ids, logits="all").float(), want, rtol=0.05, atol=0.05)


def test_fold_refuses_nonzero_gate():
    model = random_tapered("llama", "internal")
    model.set_gate(0.5)
    with pytest.raises(ValueError, match="not 0"):
        fold_in_torch(model)


def test_baseline_keeps_weights_with_plain_norms():
    model = random_tapered("gpt2", "all")
    base = baseline_of(model)
    assert not any(isinstance(m, (TaperNorm, TaperLN)) for m in base.modules())
    assert torch.equal(base.transformer.h[1].ln_2.weight, model.transformer.h[1].ln_2.weight)
    assert torch.equal(base.transformer.h[1].mlp.c_fc.weight, model.transformer.h[1].mlp.c_fc.weight)
    assert num_parameters(base) < num_parameters(model)


def test_every_arch_is_described_by_the_transformers_family_of_its_name():
    assert set(MODEL_CLASSES) == set(ARCHS)
    for arch in ARCHS:
        model = build_model(preset_config("tiny", arch=arch, n_layers=1))
        assert isinstance(model, MODEL_CLASSES[arch]) and model.tapering.family is family_for(arch)
    with pytest.raises(ValueError, match="arch must be one of"):
        preset_config("tiny", arch="mamba")


def test_readers_cover_every_norm():
    for arch in ("llama", "gpt2"):
        model = random_tapered(arch, "all")
        names = {n for n, m in model.named_modules() if isinstance(m, (TaperNorm, TaperLN))}
        readers = family_for(arch).norm_readers(model.cfg.n_layers, "all")
        assert names == set(readers)
        modules = dict(model.named_modules())
        assert all(r in modules for rs in readers.values() for r in rs)


def test_presets():
    cfg = preset_config("paper-30m")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.vocab_size, cfg.max_seq_len, cfg.d_ff) == (
        512,
        8,
        16,
        10_000,
        512,
        2048,
    )
    with torch.device("meta"):
        n = num_parameters(build_model(preset_config("gpt2-124m", arch="gpt2", taper="none")))
    assert 120e6 < n < 130e6


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_training_runs_the_whole_taper(arch):
    cfg = preset_config("tiny", arch=arch, taper="all", max_seq_len=64, n_layers=2)
    result = train(cfg, TrainOptions(steps=30, batch_size=4, eval_batches=2, log_every=10))
    ckpt = result.checkpoint
    assert ckpt.gate == 0.0 and ckpt.step == 30
    assert result.val_loss < 5.0  # better than uniform over 256 bytes (5.55)
    sd = ckpt.state_dict
    norms = [k[: -len(".calibrated")] for k in sd if k.endswith(".calibrated")]
    assert len(norms) == 2 * 2 + 1 and all(bool(sd[n + ".calibrated"]) for n in norms)
    for n in norms:  # c = ŝ_num / (ŝ_den + δ) from the EMAs, which stop at taper start (eq. 4 with A.6's correction)
        num, den = (
            bias_corrected(sd[f"{n}.ema_{part}"], sd[f"{n}.ema_count"], cfg.ema_momentum) for part in ("num", "den")
        )
        assert int(sd[f"{n}.ema_count"]) == result.checkpoint.meta["schedule"]["taper_start"]
        assert float(sd[n + ".c"]) == pytest.approx(float(num / (den + cfg.calib_delta)), rel=1e-6)
    assert bool(sd["scale_loss.frozen"]) and float(sd["scale_loss.target"]) > 0
    gates = [r["gate"] for r in result.history]
    assert gates[-1] == 0.0 and max(gates) <= 1.0


def test_divergence_stops_training_with_one_clear_error():
    from taperfold.errors import TaperfoldError

    cfg = preset_config("tiny", arch="llama", taper="internal", n_layers=2, max_seq_len=32)
    with pytest.raises(TaperfoldError, match="diverged at step"):
        train(cfg, TrainOptions(steps=20, batch_size=2, lr=50.0, eval_batches=1))


def test_nonorm_is_the_tapered_model_with_unit_norms_and_benches_next_to_folded(tmp_path, cli):
    """`nonorm` deletes every tapered norm and nothing else: the tapered model at g = 0 whose norms are identity
    maps (c = 1, γ̃ = 1) computes exactly what it computes; the untapered final norm stays, as in `folded`."""
    from taperfold.checkpoint import checkpoint_from_model
    from taperfold.variants import build_variants

    tapered = random_tapered("llama", "internal")
    with torch.no_grad():
        for norm in tapered.tapered_norms().values():
            norm.c.fill_(1.0)
            norm.weight_tilde.fill_(1.0)
    bare = build_variants(checkpoint_from_model(tapered, step=0), ["nonorm"], torch.float32)["nonorm"]
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(bare(ids, logits="all"), tapered(ids, logits="all"), rtol=0, atol=0)
    assert isinstance(bare.model.norm, torch.nn.RMSNorm)
    r = cli(
        "bench",
        "--preset",
        "tiny",
        "--variants",
        "folded,nonorm",
        "--batch",
        "1",
        "--seq",
        "8",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--json",
        tmp_path / "n.json",
    )
    assert r.exit_code == 0, r.stderr
    assert [row["variant"] for row in json.loads((tmp_path / "n.json").read_text())["results"]] == ["folded", "nonorm"]


# ---- the forward: nothing per call that depends only on the shape (no position tables) ---------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_forward_builds_no_position_tables_and_the_state_dict_stays_the_weights(arch, monkeypatch):
    model = random_gate0_model("tiny", arch=arch)
    buffers = {name for name, _ in model.named_buffers()}
    assert {"positions"} <= buffers and (arch != "llama" or {"rope_cos", "rope_sin"} <= buffers)
    assert not buffers & {"positions", "rope_cos", "rope_sin"} & set(model.state_dict())
    cfg, ids = model.cfg, torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = [
        (torch.zeros(2, cfg.kv_heads, 16, cfg.head_dim), torch.zeros(2, cfg.kv_heads, 16, cfg.head_dim))
        for _ in range(cfg.n_layers)
    ]
    with torch.no_grad():
        expected = model(ids, logits="all")
        _, grown = model(ids[:, :8], past_key_values=None, use_cache=True)

        def no_arange(*args, **kwargs):
            raise AssertionError("a forward computed positions (torch.arange)")

        monkeypatch.setattr(torch, "arange", no_arange)
        full = model(ids, logits="all")  # prefill, a growing cache's step, a static cache's prompt
        step = model(ids[:, 8:], past_key_values=grown)
        prompt, _ = model(ids[:, :8], past_key_values=cache, use_cache=True, cache_position=torch.tensor(range(8)))
    torch.testing.assert_close(full, expected)
    torch.testing.assert_close(step, expected[:, 8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prompt, expected[:, 7], rtol=1e-5, atol=1e-5)
