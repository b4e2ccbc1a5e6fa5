"""Hugging Face models, each family end to end: taper, train to g = 0, save, export, verify, fold.

Tiny random models built from configs (tests/hf_models.py, nothing downloaded). One training run and one
export per family, shared by the tests of that family through a module-scoped fixture.
"""

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # each family trains and exports a model

from hf_models import FAMILIES, tapered_tiny_model, tiny_config  # noqa: E402

from taperfold.export import ExportOptions, export_checkpoint  # noqa: E402
from taperfold.exportdir import GROWING  # noqa: E402
from taperfold.families import family_for  # noqa: E402
from taperfold.hf import load_hf_directory, save_hf_directory, taper_model  # noqa: E402
from taperfold.hf.training import TaperHook, train_hf_directory, trainer_callback  # noqa: E402
from taperfold.nn import GateSchedule, TaperLN, TaperNorm  # noqa: E402
from taperfold.passes import detect_norms  # noqa: E402
from taperfold.train import TrainOptions  # noqa: E402
from taperfold.variants import fold_in_torch  # noqa: E402
from taperfold.verify import verify_export  # noqa: E402

# Families tapered with "all" (final norm too): the tied-head and final-norm paths get exercised.
TAPER = {"llama": "all", "gemma": "all", "gemma2": "all", "granite": "all", "opt": "all", "phi": "all"}
# Families that also export KV-cache decoders: Falcon-7B's multi-query attention caches one head, which its config
# does not name
KV_CACHE = {"llama", "falcon"}


def _randomise_norms(model, seed=0):
    """Norm weights away from 1 (tools skip a multiply by one) so a wrong gain cannot pass unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            w = getattr(module, "weight", None)
            if "norm" in type(module).__name__.lower() and isinstance(w, torch.Tensor):
                w.copy_(torch.rand(w.shape, generator=gen) * 0.5 + 0.75)
                b = getattr(module, "bias", None)
                if isinstance(b, torch.Tensor):
                    b.copy_(torch.rand(b.shape, generator=gen) * 0.2 - 0.1)


def plain_model(family, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    _randomise_norms(model, seed)
    return model


class Family:
    """One family's shared artifacts: the plain and the tapered directory, the export."""


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    f = Family()
    f.name, f.taper = family, TAPER.get(family, "internal")
    f.plain = root / "plain"
    plain_model(family).save_pretrained(f.plain)
    opts = TrainOptions(steps=12, batch_size=2, seq_len=16, eval_batches=1, lr=1e-3)
    f.result = train_hf_directory(f.plain, opts, taper=f.taper)
    f.tapered = save_hf_directory(f.result.model, root / "tapered", step=opts.steps, schedule=f.result.schedule)
    f.export = export_checkpoint(
        f.tapered, root / "export", ExportOptions(baseline=False, decoders=(GROWING,) if family in KV_CACHE else ())
    ).out_dir
    f.manifest = json.loads((f.export / "manifest.json").read_text())
    return f


def test_tapering_keeps_the_function_at_gate_1_and_the_hf_names(fam):
    model = plain_model(fam.name)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    names_before = set(model.state_dict())
    tapering = taper_model(model, fam.taper)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    norms = tapering.norms
    assert norms and all(isinstance(n, (TaperNorm, TaperLN)) for n in norms.values())
    assert len({id(n.gate) for n in norms.values()}) == 1  # one gate shared by every tapered norm
    added = set(model.state_dict()) - names_before
    assert names_before <= set(model.state_dict())  # Hugging Face's names are all still there
    weightless = {"weight", "bias"} if fam.name == "olmo" else set()  # OLMo's norms gain the γ, β they computed as 1, 0
    assert {k.rpartition(".")[2] for k in added} == {
        "weight_tilde",
        "c",
        "ema_num",
        "ema_den",
        "ema_count",
        "calibrated",
        *weightless,
    }
    final = tapering.family.final
    assert (final in norms) == (fam.taper == "all")


def test_training_runs_the_schedule_to_gate_0(fam):
    tapering = fam.result.model.tapering
    assert tapering.gate.value == 0.0 and not tapering.gate.calibrating
    for norm in tapering.norms.values():
        assert bool(norm.calibrated) and int(norm.ema_count) == fam.result.schedule.taper_start
        assert 0 < float(norm.c) < 1e4
    assert np.isfinite(fam.result.val_loss)
    block = json.loads((fam.tapered / "config.json").read_text())["taperfold"]
    assert block["gate"] == 0.0 and block["taper"] == fam.taper and block["step"] == 12
    assert block["schedule"] == {
        "taper_start": fam.result.schedule.taper_start,
        "taper_end": fam.result.schedule.taper_end,
    }


def test_saved_directory_loads_to_the_same_model(fam):
    ckpt = load_hf_directory(fam.tapered)
    assert ckpt.gate == 0.0 and ckpt.config.taper == fam.taper
    ids = torch.randint(3, 256, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = fam.result.model(ids).logits
        got = ckpt.build()(ids, logits="all")
    # two models, the loaded weights at unaligned addresses (safetensors views): MKL may sum in another order
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_built_models_hold_the_directorys_tensors(family, tmp_path):
    """No second copy of the weights (nor a random initialisation): a model built from a directory is made with its
    parameters on the meta device, then given the tensors read from the directory. Ties stay ties; the output is
    the saved model's."""
    saved = tapered_tiny_model(family)
    ckpt = load_hf_directory(save_hf_directory(saved, tmp_path / family))
    held = {t.untyped_storage().data_ptr() for t in ckpt.state_dict.values()}
    tied = saved.get_output_embeddings().weight is saved.get_input_embeddings().weight
    for model in (ckpt.build(), ckpt.build_baseline()):
        assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= held
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        assert (model.hf.get_output_embeddings().weight is model.hf.get_input_embeddings().weight) == tied
    ids = torch.randint(3, 256, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # two models, the loaded weights at unaligned addresses (safetensors views): MKL may sum in another order
        torch.testing.assert_close(ckpt.build()(ids, logits="all"), saved(ids).logits, rtol=1e-6, atol=1e-6)


def test_torch_fold_equals_the_tapered_model(fam):
    tapered = load_hf_directory(fam.tapered).build(gate=0.0)
    folded = fold_in_torch(tapered)
    ids = torch.randint(3, 256, (3, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, out = tapered(ids, logits="all"), folded(ids, logits="all")
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-5
    assert not any(isinstance(m, (TaperNorm, TaperLN)) for m in folded.modules())


def test_export_verifies_against_the_transformers_forward(fam):
    report = verify_export(fam.export, threads=1)
    pairs = {p.name: p for p in report.pairs}
    assert report.passed, report.failure_message()
    for name in ("checkpoint -> unfolded", "checkpoint -> folded", "unfolded -> folded"):
        assert pairs[name].metrics.max_rel <= 1e-5, name
        assert pairs[name].metrics.top1 == 1.0, name
    assert fam.manifest["config"]["source"] == "transformers"
    model_type = tiny_config(fam.name).model_type  # a family's layouts share one (falcon, falcon_new)
    assert fam.manifest["source"]["model_type"] == model_type
    assert fam.manifest["source"]["family"] == family_for(model_type).name


def test_every_tapered_norm_is_folded(fam):
    # Counted, not named: where two norms share their mean subtraction (GPT-NeoX), the report may name
    # both after the node's module. Detection on model.onnx says what is left: the untapered norms only.
    report = fam.manifest["artifacts"]["folded"]["reports"]["fold"]
    tapered = len(fam.result.model.tapering.norms)
    assert report["summary"]["folded"] == tapered, [(n["name"], n["status"], n["reason"]) for n in report["norms"]]
    left = detect_norms(ir.load(fam.export / "model.onnx"))
    kept_norms = len(fam.manifest["source"]["untapered"])  # the final norm (internal), Qwen3's q/k norms
    assert left.candidates == [] and left.gate_not_zero == [] and len(left.real_norms) == kept_norms


@pytest.mark.parametrize("fam", ["qwen3"], indirect=True)
def test_qwen3_qk_norms_are_reported_never_tapered(fam):
    untapered = fam.manifest["source"]["untapered"]
    qk = [name for name in untapered if name.endswith(("q_norm", "k_norm"))]
    assert len(qk) == 4 and all("RoPE" in untapered[name] for name in qk)
    assert not any(name.endswith(("q_norm", "k_norm")) for name in fam.result.model.tapering.norms)


@pytest.mark.parametrize("fam", sorted(KV_CACHE), indirect=True)
def test_kv_cache_decoder_matches_the_full_forward(fam):
    ids = np.random.default_rng(0).integers(3, 256, (2, 12)).astype(np.int64)
    full = ort.InferenceSession(str(fam.export / "model.onnx"), providers=["CPUExecutionProvider"])
    decoder = ort.InferenceSession(str(fam.export / "model.decoder.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in decoder.get_inputs()]
    n_layers = fam.manifest["config"]["n_layers"]
    assert names == ["input_ids"] + [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    outputs = [o.name for o in decoder.get_outputs()]
    assert outputs == ["logits"] + [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    cfg = fam.manifest["config"]
    past = {n: np.zeros((2, cfg["kv_heads"], 0, cfg["head_dim"]), np.float32) for n in names[1:]}
    out = decoder.run(None, {"input_ids": ids[:, :7], **past})
    for step in range(7, 12):  # one token at a time, each against the full forward on the prefix
        past = dict(zip(names[1:], out[1:]))
        out = decoder.run(None, {"input_ids": ids[:, step : step + 1], **past})
        ref = full.run(["logits"], {"input_ids": ids[:, : step + 1]})[0]
        assert np.abs(out[0] - ref).max() / np.abs(ref).max() <= 1e-5
    assert out[1].shape == (2, cfg["kv_heads"], 12, cfg["head_dim"])


@pytest.mark.parametrize("fam", ["stablelm_parallel"], indirect=True)
def test_stablelm_per_head_qk_norms_are_reported_never_tapered(fam):
    untapered = fam.manifest["source"]["untapered"]
    heads = [name for name in untapered if ".norms." in name]
    assert len(heads) == 2 * (4 + 2) and all("qk_layernorm" in untapered[name] for name in heads)  # q: 4, k: 2 heads
    assert set(fam.result.model.tapering.norms) == {f"model.layers.{i}.input_layernorm" for i in range(2)}


@pytest.mark.parametrize("fam", ["falcon", "falcon_new"], indirect=True)
def test_falcon_layout_comes_from_the_config(fam):
    norms = set(fam.result.model.tapering.norms)
    expected = ("ln_attn", "ln_mlp") if fam.name == "falcon_new" else ("input_layernorm",)
    assert norms == {f"transformer.h.{i}.{n}" for i in range(2) for n in expected}
    # what each caches is the modeling code's choice: one key/value head (multi-query); the new architecture's
    # grouped heads, which transformers before 5.25 expanded to every query head before caching
    with torch.no_grad():
        out = plain_model(fam.name)(torch.zeros(1, 2, dtype=torch.long), use_cache=True)
    cached = out["cache" if "cache" in out else "past_key_values"].layers[0].keys.shape[1]
    assert fam.manifest["config"]["kv_heads"] == cached
    assert cached in ((2, 4) if fam.name == "falcon_new" else (1,))  # falcon_new: 2 key/value heads, 4 query heads


# ---- without a family fixture -----------------------------------------------------------------------


def test_gemma_gain_is_one_plus_weight():
    model = plain_model("gemma")
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(3, 32)
    with torch.no_grad():
        expected = norm(x)
        tapering = taper_model(model, "internal")
        tapered = model.model.layers[0].input_layernorm
        torch.testing.assert_close(tapered(x), expected)
        tapered.c.fill_(0.5)
        tapering.set_gate(0.0)
        torch.testing.assert_close(tapered(x), x * 0.5 * (1 + tapered.weight_tilde))


def test_step_hook_and_trainer_callback_drive_the_same_schedule():
    from transformers import TrainerControl, TrainerState

    runs = {}
    for driver in ("hook", "callback"):
        model = plain_model("llama").train()
        taper_model(model, "internal")
        hook = TaperHook(model, GateSchedule(taper_start=3, taper_end=7))
        callback = trainer_callback(hook)
        state, gates = TrainerState(), []
        ids = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        for step in range(9):
            if driver == "hook":
                hook.step(step)
            else:
                state.global_step = step
                callback.on_step_begin(None, state, TrainerControl())
            gates.append(model.tapering.gate.value)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        if driver == "callback":
            state.global_step = 9
            callback.on_train_end(None, state, TrainerControl())
        runs[driver] = (gates, [float(n.c) for n in model.tapering.norms.values()])
        assert model.tapering.gate.value == 0.0
        assert all(int(n.ema_count) == 3 and bool(n.calibrated) for n in model.tapering.norms.values())
    assert runs["hook"] == runs["callback"]
    gates = runs["hook"][0]
    assert gates[:3] == [1.0] * 3 and gates[3] == 1.0 and 0 < gates[5] < 1 and gates[7:] == [0.0, 0.0]


def test_scale_anchoring_loss_is_added_to_the_models_loss():
    model = plain_model("llama").train()
    tapering = taper_model(model, "all", aux=True)
    hook = TaperHook(model, GateSchedule(taper_start=2, taper_end=4))
    ids = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        hook.step(step)
        out = model(input_ids=ids, labels=ids)
    assert bool(tapering.scale_loss.frozen) and float(hook.last_aux.detach()) > 0
    model.eval()
    with torch.no_grad():
        ce = model(input_ids=ids, labels=ids).loss  # eval: no aux term
    model.train()
    with torch.no_grad():
        total = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(total, ce + hook.last_aux)
    assert out.loss is not None


def test_an_alibi_model_whose_config_states_no_context_takes_its_familys(tmp_path):
    # Bloom's config.json has no max_position_embeddings (ALiBi has no position table); it trained at 2048 tokens.
    plain_model("bloom").save_pretrained(tmp_path / "bloom")
    assert "max_position_embeddings" not in json.loads((tmp_path / "bloom" / "config.json").read_text())
    assert load_hf_directory(tmp_path / "bloom").config.max_seq_len == family_for("bloom").context == 2048


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_norm_folds_in_torch_into_the_router_and_every_expert(model_type):
    # The fold's arithmetic on the router and the stacked experts (the directory path: the `fam` tests; the graph
    # passes: tests/passes).
    from fold_models import tiny_model

    from taperfold.hf.model import HFCausalLM, HFModelInfo

    hf = tiny_model(model_type)
    tapering = taper_model(hf, "all")
    readers = tapering.readers["model.layers.0.post_attention_layernorm"]
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"} <= set(readers)
    with torch.no_grad():
        for norm in tapering.norms.values():
            norm.weight_tilde.uniform_(0.5, 1.5)
            norm.c.uniform_(0.5, 2.0)
    tapering.set_gate(0.0)
    family = tapering.family
    model = HFCausalLM(hf, HFModelInfo.from_config(hf.config, family, "all", aux=True, tokenizer="bytes"), family)
    folded = fold_in_torch(model)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = model(ids, logits="all"), folded(ids, logits="all")
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5
    norm = hf.get_submodule("model.layers.0.post_attention_layernorm")
    scale = tapering.kind.constant_map(norm).scale.float()  # diag(scale) moves into each [..., out, in] matrix
    for path in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"):
        torch.testing.assert_close(folded.hf.get_parameter(path), hf.get_parameter(path) * scale)


def test_a_shifted_norm_before_bare_expert_weights_stays_in_the_torch_fold():
    # PhiMoE: the LayerNorm before the experts has a shift β, and the family's forward applies the experts' stacked
    # weights with no bias to take β·W_e: torch's folded model keeps that norm at g = 0 (the ONNX fold adds a bias
    # per expert: tests/passes), and the norms before attention fold.
    from fold_models import LAYERS, tiny_model

    from taperfold.hf.model import HFCausalLM, HFModelInfo

    hf = tiny_model("phimoe")
    tapering = taper_model(hf, "internal")
    with torch.no_grad():
        for norm in tapering.norms.values():
            norm.weight_tilde.uniform_(0.5, 1.5)
            norm.c.uniform_(0.5, 2.0)
    tapering.set_gate(0.0)
    model = HFCausalLM(
        hf,
        HFModelInfo.from_config(hf.config, tapering.family, "internal", aux=True, tokenizer="bytes"),
        tapering.family,
    )
    folded = fold_in_torch(model)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = model(ids, logits="all"), folded(ids, logits="all")
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5
    kept = {name for name, m in folded.hf.named_modules() if isinstance(m, TaperLN)}
    assert kept == {f"model.layers.{i}.post_attention_layernorm" for i in range(LAYERS)}
