"""DyT as a norm kind (taperfold.norms.dyt): the module, DyT in a norm's place, the torch fold, checkpoints, and
the chain train → inspect → export → verify → bench from the command line."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from taperfold.checkpoint import checkpoint_from_model, load_checkpoint, save_checkpoint
from taperfold.models import EMBED_SCALE0, baseline_of, build_model, preset_config, random_gate0_model
from taperfold.nn import ScaledEmbedding
from taperfold.norms import norm_kind, norm_kinds
from taperfold.norms.dyt import DyT, ScaledTanh
from taperfold.presets import STAND_IN_NORMS
from taperfold.variants import fold_in_torch, without_norms

DYT = norm_kind("dyt")


def test_dyt_is_the_papers_formula():
    torch.manual_seed(0)
    dyt = DyT(8)
    with torch.no_grad():
        dyt.alpha.fill_(0.7)
        dyt.weight.normal_()
        dyt.bias.normal_()
    h = 3 * torch.randn(2, 5, 8)
    assert torch.equal(dyt(h), torch.tanh(0.7 * h) * dyt.weight + dyt.bias)
    assert float(DyT(8).alpha) == 0.5  # α₀ of the paper


def test_dyt_takes_a_norms_gain_and_shift():
    ln = nn.LayerNorm(6)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    dyt = DYT.taper(ln, None, 1e-5, 0.1, 1e-8)
    assert torch.equal(dyt.weight, ln.weight) and torch.equal(dyt.bias, ln.bias)
    rms = nn.RMSNorm(6)  # Gemma-style gain x·(1 + w): γ = 1 + w
    with torch.no_grad():
        rms.weight.normal_()
    dyt = DYT.taper(rms, None, 1e-6, 0.1, 1e-8, gain_offset=1.0)
    assert torch.allclose(dyt.weight, rms.weight + 1) and not dyt.bias.any()
    weightless = nn.LayerNorm(6, elementwise_affine=False)  # OLMo: γ = 1, β = 0
    assert torch.equal(DYT.taper(weightless, None, 1e-5, 0.1, 1e-8).weight, torch.ones(6))


def test_the_command_lines_choices_are_the_registrys_kinds_without_a_gate():
    assert list(STAND_IN_NORMS) == [k.name for k in norm_kinds() if not k.gated]


def test_a_dyt_model_has_no_gate_to_drive_and_its_baseline_has_the_archs_norms():
    model = build_model(preset_config("tiny", norm="dyt", taper="all", n_layers=2))
    assert model.cfg.aux is False and model.gate.value == 0.0 and model.tapering.calibrated
    assert all(isinstance(n, DyT) for n in model.tapered_norms().values()) and len(model.tapered_norms()) == 5
    # the paper's LLaMA recipe: a learnable scalar after the embedding, the head still tied to the table
    embedding = model.network.model.embed_tokens
    assert isinstance(embedding, ScaledEmbedding) and float(embedding.scale) == EMBED_SCALE0
    assert model.network.lm_head.weight is embedding.weight
    baseline = baseline_of(model)
    assert baseline.tapering is None and isinstance(baseline.network.model.embed_tokens, ScaledEmbedding)
    assert sum(isinstance(m, nn.RMSNorm) for m in baseline.modules()) == 5
    tapered = build_model(preset_config("tiny", n_layers=2))
    assert isinstance(tapered.network.model.embed_tokens, nn.Embedding)  # TaperNorm models have no such scalar
    internal = build_model(preset_config("tiny", arch="gpt2", norm="dyt", taper="internal", n_layers=2))
    assert isinstance(internal.network.get_submodule("transformer.ln_f"), nn.LayerNorm)  # the final norm stays


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(norm="dyt", taper="none"), "taper 'none'"),
        (dict(norm="rms"), "norm must be null"),
        (dict(norm="tanh"), "norm must be null"),
        (dict(norm="dyt", embed_scale=1), "embed_scale must be"),
    ],
)
def test_a_wrong_norm_in_a_config_is_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        preset_config("tiny", **bad)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_torch_fold_moves_gain_and_shift_and_keeps_the_tanh(arch):
    model = random_gate0_model("tiny", arch=arch, norm="dyt", taper="all", n_layers=2)
    folded = fold_in_torch(model)
    assert not any(isinstance(m, DyT) for m in folded.modules())
    assert sum(isinstance(m, ScaledTanh) for m in folded.modules()) == 5
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        ref, out = model.double()(ids, logits="all"), folded.double()(ids, logits="all")
        # the folded weights are rounded to fp32 once: float32's precision, not the fold's, bounds the difference
        assert torch.allclose(out, ref, rtol=0, atol=1e-6 * ref.abs().max())
        bare = without_norms(model)(ids, logits="all")
    assert not torch.allclose(bare, ref, atol=1e-3)  # nonorm is a timing reference, not the same function


@pytest.mark.parametrize("dtype, refused", [("fp16", True), ("bf16", False)])
def test_an_alpha_past_the_export_dtypes_range_is_refused_before_any_graph(tmp_path, cli, dtype, refused):
    # 1e5 is finite in the fp32 checkpoint, Inf in fp16 (max 65504) and fine in bf16 (fp32's range)
    model = random_gate0_model("tiny", norm="dyt", taper="all", n_layers=1)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.alpha.fill_(1e5)
    path = save_checkpoint(checkpoint_from_model(model, 7), tmp_path / "dyt.safetensors")
    r = cli("export", path, "-o", tmp_path / "out", "--dtype", dtype)
    if refused:
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
        assert (
            "'model.layers.0.input_layernorm.alpha' holds values beyond fp16's range (±65504): "
            "export with --dtype bf16 or fp32"
        ) in r.stderr
        assert not (tmp_path / "out").exists()
    else:
        assert r.exit_code == 0, r.stderr


def test_a_dyt_checkpoint_round_trips(tmp_path):
    model = random_gate0_model("tiny", norm="dyt", taper="all", n_layers=2)
    path = save_checkpoint(checkpoint_from_model(model, 7), tmp_path / "dyt.safetensors")
    again = load_checkpoint(path).build()
    assert again.cfg.norm == "dyt" and again.gate.value == 0.0
    saved, loaded = model.state_dict(), again.state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())  # bit for bit
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # two models, the loaded weights at unaligned addresses: fp32's tolerance (test_checkpoint)
        torch.testing.assert_close(again(ids), model(ids), rtol=1e-6, atol=1e-6)


def test_train_inspect_export_verify_bench_a_dyt_model(cli, tmp_path):
    ckpt, out = tmp_path / "dyt.safetensors", tmp_path / "out"
    r = cli("train", "--preset", "tiny", "--norm", "dyt", "--steps", "30", "--batch-size", "4", "-o", ckpt, "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (summary["norm"], summary["taper"], summary["aux"], summary["gate"]) == ("dyt", "internal", False, 0.0)
    r = cli("inspect", ckpt, "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    dyts = [n for n in info["norms"] if n["kind"] == "DyT"]
    assert info["foldable"] == len(dyts) == 8 and all(n["alpha"] > 0 for n in dyts)
    assert [n["name"] for n in info["norms"] if n["kind"] != "DyT"] == ["model.norm"]  # Internal: the final RMSNorm
    assert cli("export", ckpt, "-o", out).exit_code == 0
    report = json.loads((out / "manifest.json").read_text())["artifacts"]["folded"]["reports"]["fold"]
    assert [(n["kind"], n["status"], n["reason"]) for n in report["norms"] if n["kind"] == "dyt"] == [
        ("dyt", "folded", "γ, β folded, tanh kept")
    ] * 8
    r = cli("verify", out)
    assert r.exit_code == 0, r.stdout + r.stderr
    r = cli(
        "bench",
        out,
        "--batch",
        "1",
        "--seq",
        "16",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--rounds",
        "1",
        "--json",
        tmp_path / "bench.json",
    )
    assert r.exit_code == 0, r.stderr
    cells = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert {c["variant"] for c in cells} >= {"baseline", "unfolded", "folded"}


def test_dyt_command_line_refusals(cli, tmp_path):
    r = cli("train", "--norm", "dyt", "--taper", "none", "-o", tmp_path / "x.pt")
    assert r.exit_code == 2 and "--taper none" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("train", "--norm", "dyt", "--from", tmp_path, "-o", tmp_path / "o")
    assert r.exit_code == 2 and "--from" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "value, model_dtype, dtype, remedy",
    [
        (3.4e38, torch.float32, "bf16", "±3.38953e+38): export with --dtype fp32"),  # past bf16's max, within fp32's
        (1e300, torch.float64, "fp32", "±3.40282e+38): no export dtype holds it"),  # a float64 checkpoint
    ],
)
def test_a_value_past_bf16s_or_fp32s_range_is_refused_before_any_graph(
    tmp_path, cli, value, model_dtype, dtype, remedy
):
    model = random_gate0_model("tiny", norm="dyt", taper="all", n_layers=1).to(model_dtype)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.alpha.fill_(value)
    path = save_checkpoint(checkpoint_from_model(model, 7), tmp_path / "dyt.safetensors")
    r = cli("export", path, "-o", tmp_path / "out", "--dtype", dtype)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"'model.layers.0.input_layernorm.alpha' holds values beyond {dtype}'s range ({remedy}" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_dyt_transformers_model_saves_as_a_directory_that_reopens_exports_and_verifies(cli, tmp_path):
    """`taper_model(model, kind="dyt")` then save_hf_directory: the block says "norm": "dyt" (no calibration: a DyT
    has none), taperfold reopens it with the DyTs where they were and the model's logits, and export folds each DyT
    (γ, β into the readers, the tanh kept) in a graph that verify holds to the directory."""
    pytest.importorskip("transformers")
    from hf_models import dyt_tiny_model

    from taperfold.hf import load_hf_directory, save_hf_directory

    model = dyt_tiny_model("llama", "internal")
    folder = save_hf_directory(model, tmp_path / "dyt")
    block = json.loads((folder / "config.json").read_text())["taperfold"]
    assert block["norm"] == "dyt" and "calibration" not in block and block["gate"] == 0.0
    assert load_hf_directory(folder).config.norm_kind == "dyt"  # what the manifest and bench reports record
    reopened = load_hf_directory(folder).build()
    tapering = reopened.tapering
    assert tapering.kind.name == "dyt" and tapering.norms.keys() == model.tapering.norms.keys()
    assert all(isinstance(norm, DyT) for norm in tapering.norms.values())
    ids = torch.tensor([[5, 17, 33, 90, 120, 7, 200, 3]])
    with torch.no_grad():
        torch.testing.assert_close(reopened.network(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-6)
    out = tmp_path / "out"
    r = cli("export", folder, "-o", out)
    assert r.exit_code == 0, r.stderr
    report = json.loads((out / "manifest.json").read_text())["artifacts"]["folded"]["reports"]["fold"]
    assert [(n["kind"], n["status"]) for n in report["norms"] if n["kind"] == "dyt"] == [("dyt", "folded")] * 4
    r = cli("verify", out)
    assert r.exit_code == 0, r.stdout + r.stderr
