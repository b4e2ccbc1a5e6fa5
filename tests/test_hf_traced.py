"""Generic tapering (taperfold.hf.trace): a model_type with no shipped family gets one by tracing transformers' model.

The traced family is held to the shipped ones (each family's model tapered both ways: the same norms, readers,
producers and untapered modules); architectures taperfold does not ship run the whole command line (train --from,
inspect, export, verify, every tapered norm folded); the family a tapered directory records is what export and
verify use, and bad data there is one line naming the file and the key; models tracing cannot place are refused in
one line naming docs/hf.md's section on adding a family. Tiny random models built from configs: nothing downloaded.
"""

import json
import re
import shutil
from pathlib import Path

import onnx_ir as ir
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import FAMILIES, UNLISTED, tiny_config  # noqa: E402

from taperfold.families import family_for, is_registered  # noqa: E402
from taperfold.families.serialize import family_from_data, family_to_data  # noqa: E402
from taperfold.hf import (  # noqa: E402
    taper_model,
    trace,
)
from taperfold.nn import Gating  # noqa: E402
from taperfold.passes import detect_norms  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _model(name, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(name)).eval()


def _as_sets(readers: dict) -> dict:
    """Each norm's readers in any order (the traced family lists them as the forward runs them): a fold rewrites
    each."""
    return {norm: set(paths) for norm, paths in readers.items()}


def test_the_guide_a_refusal_names_is_a_section_of_hf_md():
    assert trace.GUIDE == "docs/hf.md, section 'Adding a family'"
    assert "\n## Adding a family\n" in (ROOT / "docs" / "hf.md").read_text()


@pytest.mark.parametrize("name", FAMILIES)
def test_traced_family_tapers_as_the_shipped_one(name):
    # Each shipped family treated as unlisted: its model tapered with the traced family and with the shipped one.
    config = tiny_config(name)
    traced = trace.traced_family(config, name)
    shipped = family_for(config.model_type).for_config(config)
    assert traced.traced and not shipped.traced
    assert (traced.norm, traced.gain_offset, traced.layers, traced.final, traced.head) == (
        shipped.norm,
        shipped.gain_offset,
        shipped.layers,
        shipped.final,
        shipped.head,
    )
    assert _as_sets(traced.internal) == _as_sets(shipped.internal) and traced.post == shipped.post
    for taper in ("internal", "all"):
        by_trace = taper_model(_model(name), taper, family=traced, aux=False)
        by_hand = taper_model(_model(name), taper, family=shipped, aux=False)
        assert _as_sets(by_trace.readers) == _as_sets(by_hand.readers) and by_trace.producers == by_hand.producers
        assert set(by_trace.norms) == set(by_hand.norms)
        assert set(by_trace.untapered) == set(by_hand.untapered)  # Qwen3's q/k norms, Bloom's embedding norm, ...


def test_traced_reasons_name_what_stops_a_norm():
    untapered = trace.traced_family(tiny_config("olmo2"), "olmo2").untapered
    assert set(untapered) == {"self_attn.q_norm", "self_attn.k_norm"}  # paths within a layer
    assert all("per-head split" in why for why in untapered.values())
    bloom = trace.traced_family(tiny_config("bloom"), "bloom")  # outside the layers: by its whole path
    assert "add" in bloom.untapered_reason("transformer.word_embeddings_layernorm")  # the residual stream reads it


@pytest.mark.parametrize(
    "name, router, experts",
    [
        ("olmoe", "mlp.gate.weight", "mlp.experts"),
        ("granitemoe", "block_sparse_moe.router.weight", "block_sparse_moe.experts"),
    ],
)
def test_unlisted_moe_norm_feeds_the_router_and_every_expert(name, router, experts):
    # transformers' batched experts apply their stacked matrices as bmm(W[expert ids], x[..., None])
    family = trace.traced_family(tiny_config(name), name)
    assert family.internal["post_attention_layernorm"] == (router, f"{experts}.gate_up_proj")


def test_gemma_gain_and_olmo_epsilon_are_measured():
    assert trace.traced_family(tiny_config("gemma"), "gemma").gain_offset == 1.0
    assert trace.traced_family(tiny_config("llama"), "llama").gain_offset == 0.0
    olmo = trace.traced_family(tiny_config("olmo"), "olmo")  # weightless LayerNorms that state no epsilon
    assert olmo.norm == "ln" and olmo.norm_eps == family_for("olmo").norm_eps


def _gated_norms():
    from transformers.models.bamba.modeling_bamba import BambaRMSNormGated
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    return [
        (BambaRMSNormGated(24, group_size=6), Gating("silu", False, 4)),  # Mamba2's: gate, then norm per group
        (Qwen3NextRMSNormGated(24), Gating("silu", True)),  # the gated delta net's: norm, then gate
        (KimiLinearRMSNormGated(24), Gating("sigmoid", True)),
        (FalconH1RMSNormGated(24, n_groups=3, norm_before_gate=True), Gating("silu", True, 3)),
    ]


@pytest.mark.parametrize("module, gating", _gated_norms(), ids=lambda v: type(v).__name__)
def test_a_gated_norms_gate_is_measured(module, gating):
    behaviour = trace.measure_norm(module, None)
    assert (behaviour.kind, behaviour.gating, behaviour.eps) == ("rms", gating, 1e-6), behaviour


@pytest.mark.parametrize(
    "name, gated_norm, reader, gating, heads, own_gain",
    [
        # Bamba: gate·x, then the norm, into out_proj; its other norms γ too
        ("bamba", "mamba.norm", "mamba.out_proj", Gating("silu", False, 1), {}, {}),
        # Qwen3-Next: the norm per head (4 heads), then the gate, the heads joined for out_proj; γ where its others are
        # 1 + γ
        (
            "qwen3_next",
            "linear_attn.norm",
            "linear_attn.out_proj",
            Gating("silu", True, 1),
            {"linear_attn.norm": 4},
            {"linear_attn.norm": 0.0},
        ),
        # Kimi Linear: per head, then a sigmoid gate
        (
            "kimi_linear",
            "self_attn.o_norm",
            "self_attn.o_proj",
            Gating("sigmoid", True, 1),
            {"self_attn.o_norm": 4},
            {},
        ),
    ],
)
def test_a_hybrids_gated_norm_is_tapered_in_the_layers_that_have_it(name, gated_norm, reader, gating, heads, own_gain):
    # layer 0 is recurrent (Mamba2 / gated delta net), layer 1 attention
    family = trace.traced_family(tiny_config(name), name)
    assert family.layer_readers[0][gated_norm] == (reader,) and gated_norm not in family.internal
    assert family.gated == {gated_norm: gating} and "norm" not in family.untapered
    assert (family.heads, family.gain_offsets) == (heads, own_gain)
    assert f"model.layers.0.{gated_norm}" in _tapered_all_at_gate_1(_model(name)).norms
    data = family_to_data(family)
    assert family_from_data(json.loads(json.dumps(data)), name, ValueError) == family


def test_a_norm_that_is_a_post_norm_in_some_layers_and_a_pre_norm_in_others_folds_in_each():
    # OLMo hybrid: layer 0 (a gated delta net, pre-norms) reads post_attention_layernorm before its MLP; layer 1
    # (attention with OLMo 2's post-norms) normalizes o_proj's output with it before the residual Add
    family = trace.traced_family(tiny_config("olmo_hybrid"), "olmo_hybrid")
    assert family.readers_in_layer(0)["post_attention_layernorm"] == ("mlp.gate_proj", "mlp.up_proj")
    assert family.producers_in_layer(1) == {
        "post_attention_layernorm": "self_attn.o_proj",
        "post_feedforward_layernorm": "mlp.down_proj",
    }
    assert "post_attention_layernorm" not in family.readers_in_layer(1) and not family.producers_in_layer(0)
    assert family_from_data(json.loads(json.dumps(family_to_data(family))), "olmo_hybrid", ValueError) == family
    tapering = _tapered_all_at_gate_1(_model("olmo_hybrid"))
    assert tapering.producers["model.layers.1.post_attention_layernorm"] == "model.layers.1.self_attn.o_proj"
    assert "model.layers.0.post_attention_layernorm" in tapering.readers


def test_a_norm_left_in_every_layer_has_a_reason_true_of_each_layer():
    # the reason was kept by the norm's last name and told of layer 0's modules for every layer's norm
    tapering = taper_model(_model("olmoe"), "internal")
    reasons = {tapering.untapered[f"model.layers.{i}.self_attn.q_norm"] for i in range(2)}
    assert len(reasons) == 1, reasons
    reason = reasons.pop()
    assert "its layer's self_attn" in reason and "model.layers." not in reason, reason


def test_a_kimi_linear_directory_reads_its_experts_saved_one_by_one(cli, tmp_path):
    # save_pretrained writes the stacked experts back as experts.N.w1/w2/w3, under a pattern written as a regular
    # expression (r"\.experts.*.w1.weight"): inspect refused the directory, taking expert 0 for a gap
    _model("kimi_linear").save_pretrained(tmp_path / "plain")
    result = cli("inspect", tmp_path / "plain")
    assert result.exit_code == 0, result.stderr


def test_falcon_h1s_norms_fold_through_its_multipliers_and_its_grouped_gated_norm():
    # every layer has Mamba2 and attention side by side, each reading the input norm times a µP multiplier
    family = trace.traced_family(tiny_config("falcon_h1"), "falcon_h1")
    assert set(family.internal["input_layernorm"]) == {
        "mamba.in_proj",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
    }
    assert family.internal["mamba.norm"] == ("mamba.out_proj",)
    assert family.gated == {"mamba.norm": Gating("silu", True, 2)} and not family.untapered


@pytest.mark.parametrize("name", UNLISTED)
def test_unlisted_architectures_are_traced_and_taper_exactly_at_gate_1(name):
    model = _model(name)
    assert not is_registered(model.config.model_type)
    tapering = _tapered_all_at_gate_1(model)
    assert tapering.family.traced and tapering.family.final in tapering.norms


def _tapered_all_at_gate_1(model):
    """`model` with every norm tapered at g = 1, checked to compute what it did."""
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        tapering = taper_model(model, "all")
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    return tapering


def test_a_layernorm_with_gain_one_plus_weight_folds_and_its_baseline_keeps_the_offset(tmp_path):
    # Nemotron's LayerNorm1P computes (x - mean)/std·(1 + γ) + β: measured, and tapered with that offset (it was
    # refused: "TaperLN has no gain offset"). The baseline graph, made from the unfolded trace, restores 1 + γ
    from hf_models import tapered_tiny_model

    from taperfold.export import ExportOptions, export_checkpoint
    from taperfold.hf import save_hf_directory
    from taperfold.verify import verify_export

    family = trace.traced_family(tiny_config("nemotron"), "nemotron")
    assert (family.norm, family.gain_offset) == ("ln", 1.0)
    tapered = save_hf_directory(tapered_tiny_model("nemotron"), tmp_path / "tapered", step=3)
    out = export_checkpoint(tapered, tmp_path / "out", ExportOptions()).out_dir
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"] == 4
    assert manifest["artifacts"]["baseline"]["built_from"] == "unfolded"
    report = verify_export(out, threads=1)
    assert report.passed, report.failure_message()


def test_an_architecture_torch_export_cannot_take_is_refused_naming_the_guide():
    config = transformers.XLNetConfig(d_model=32, n_layer=2, n_head=4, d_inner=64, vocab_size=256)
    with pytest.raises(Exception) as refused:
        taper_model(transformers.AutoModelForCausalLM.from_config(config))
    message = str(refused.value)
    assert "\n" not in message and "torch.export cannot trace it" in message and trace.GUIDE in message


@pytest.mark.parametrize("name, family", [("llama4_text", "llama4"), ("deepseek_v2", "deepseek_v2")])
def test_a_complex_rotary_in_real_arithmetic_is_the_models_own(name, family):
    # what export traces instead of view_as_complex / polar (taperfold.hf.export_patches): Llama 4 holds its queries
    # as [batch, tokens, heads, dim], DeepSeek-V2 as [batch, heads, tokens, dim]
    import importlib

    from taperfold.hf.export_patches import export_patches

    model = _model(name)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = model(ids).logits
        with export_patches(name):
            real = model(ids).logits
    torch.testing.assert_close(real, own, rtol=1e-5, atol=1e-6)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")  # undone after the block
    assert modeling.apply_rotary_emb.__module__ == modeling.__name__
    assert "view_as_complex" in modeling.apply_rotary_emb.__code__.co_names


@pytest.mark.parametrize("name", ["qwen3_next", "bamba", "kimi_linear", "jamba"])
def test_a_hybrids_recurrence_as_a_scan_is_transformers_own(name):
    # what export traces instead of the loop over chunks that fixed the sequence length (taperfold.hf.export_patches)
    from taperfold.hf.export_patches import export_patches

    model = _model(name)
    for length in (1, 9, 40):
        ids = torch.randint(3, 256, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            own = model(ids).logits
            with export_patches(name):
                scanned = model(ids).logits
        torch.testing.assert_close(scanned, own, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name, gated_norm",
    [
        ("qwen3_next", "linear_attn.norm"),
        ("bamba", "mamba.norm"),
        ("falcon_h1", "mamba.norm"),
        ("olmo_hybrid", "linear_attn.o_norm"),
    ],
)
def test_a_hybrid_exports_a_graph_that_takes_every_length(tmp_path, name, gated_norm):
    # export refused them in one line ("fixed the sequence length of 'input_ids' to 8"); verify runs lengths 1 to
    # the model's longest, batch 1 and 4. The gated norm of layer 0 (the recurrent one) folds into its out_proj, the
    # gate kept: Bamba's normalizes gate·x, Qwen3-Next's each head before its gate, read with the heads joined,
    # Falcon-H1's 2 groups before its gate (and its input norm folds through the µP multipliers). OLMo hybrid's
    # attention layer has post-norms where its recurrent layer has pre-norms of the same name: each folds its way
    from hf_models import tapered_tiny_model

    from taperfold.export import ExportOptions, export_checkpoint
    from taperfold.hf import save_hf_directory
    from taperfold.verify import verify_export

    tapered = save_hf_directory(tapered_tiny_model(name), tmp_path / "tapered", step=3)
    out = export_checkpoint(tapered, tmp_path / "out", ExportOptions()).out_dir
    report = verify_export(out, threads=1)
    assert report.passed, report.failure_message()
    assert {"random 1x1", "random 4x16"} <= {row["input"] for pair in report.pairs for row in pair.per_input}
    fold = json.loads((out / "manifest.json").read_text())["artifacts"]["folded"]["reports"]["fold"]
    entries = {n["name"]: (n["status"], n["reason"]) for n in fold["norms"]}
    for norm in (f"model.layers.0.{gated_norm}", "model.layers.0.input_layernorm"):
        assert entries[norm] == ("folded", ""), entries  # a tapered norm, not "no norm module"
    if name == "olmo_hybrid":
        status, reason = entries["model.layers.1.post_attention_layernorm"]
        assert status == "folded" and "into its producer" in reason and "self_attn.o_proj" in reason, reason


def test_a_multimodal_model_exports_and_verifies_its_language_model(tmp_path):
    # Gemma 3's checkpoints are the multimodal model, its config.json has the language model's sizes in text_config
    # only (inspect refused it: "key 'vocab_size' is missing"). Its language model is exported and its norms fold; the
    # vision tower's and the projector's, which a text-only forward never calls, are left untapered, saying so
    from hf_models import tapered_tiny_model

    from taperfold.export import ExportOptions, export_checkpoint
    from taperfold.hf import save_hf_directory
    from taperfold.verify import verify_export

    model = tapered_tiny_model("gemma3")
    for norm in ("model.vision_tower.post_layernorm", "model.multi_modal_projector.mm_soft_emb_norm"):
        assert model.tapering.untapered[norm] == "not called by a text-only forward of 8 tokens"
    tapered = save_hf_directory(model, tmp_path / "tapered", step=3)
    out = export_checkpoint(tapered, tmp_path / "out", ExportOptions(decoders=("growing",))).out_dir
    report = verify_export(out, threads=1)
    assert report.passed, report.failure_message()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["vocab_size"] == 256 and manifest["config"]["n_layers"] == 2
    # per layer: the input and pre-feedforward norms into what reads them, the two post-norms into their producers
    assert manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"] == 8


@pytest.mark.parametrize("name, folds", [("dots3_note_text", 6), ("deepseek_v4", 8), ("mpt", 4)])
def test_a_plain_directory_of_the_newest_shapes_is_read(cli, tmp_path, name, folds):
    # dots.llm3: its layers differ in heads (per_layer_config), which transformers refuses to read on the whole config
    # (a traceback). DeepSeek-V4: its conversion mapping's `.norm.` -> `.kv_norm.` rule also renamed the
    # `model.norm.weight` save_pretrained wrote ("missing key"); from_pretrained keeps a key the model has as it is.
    # MPT: its context is max_seq_len ("key 'max_position_embeddings' is missing")
    plain = _plain(name, tmp_path / "plain")
    result = cli("inspect", plain, "--json")
    assert result.exit_code == 0, result.stderr
    norms = json.loads(result.stdout)["norms"]
    assert sum(1 for n in norms if n["folds_into"]) == folds, norms


def test_a_model_torch_onnx_fails_on_in_sdpa_exports_with_eager_attention(tmp_path):
    # Doge: torch.onnx's "Cannot view a tensor ... strides" on the reshape after its SDPA
    from hf_models import tapered_tiny_model

    from taperfold.export import ExportOptions, export_checkpoint
    from taperfold.hf import save_hf_directory
    from taperfold.verify import verify_export

    tapered = save_hf_directory(tapered_tiny_model("doge"), tmp_path / "tapered", step=3)
    stages = []
    out = export_checkpoint(tapered, tmp_path / "out", ExportOptions(decoders=("growing",)), stages.append).out_dir
    eager = [stage for stage in stages if "with eager attention" in stage]
    assert eager and all("Cannot view a tensor" in stage for stage in eager), stages
    graphs = json.loads((out / "manifest.json").read_text())["artifacts"]
    eager_graphs = {key for key, graph in graphs.items() if "Cannot view a tensor" in graph.get("eager_attention", "")}
    assert eager_graphs == {key for key, graph in graphs.items() if graph["kind"] == "onnx"} > {"folded"}, graphs
    report = verify_export(out, threads=1)
    assert report.passed, report.failure_message()


def test_a_model_that_branches_on_the_length_within_its_context_is_refused_in_one_line(cli, tmp_path):
    # Doge keeps the top keep_window_size keys once there are more: traced at 8 tokens, torch.export narrowed the
    # sequence to 16 at most without a word, and verify found other logits at 32
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("doge", keep_window_size=16))
    model.save_pretrained(tmp_path / "plain")
    result = cli("export", tmp_path / "plain", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
    assert "holds the sequence length of 'input_ids' to 16 at most (asked: 32)" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_model_whose_trace_assumes_a_length_it_was_traced_at_is_refused_in_one_line(cli, tmp_path):
    # DeepSeek-V4's compressor closes one window per 4 tokens (`if chunk_kv.shape[1] > 0`): traced at 8, torch.export
    # kept the windowed branch as a runtime assertion, which torch.onnx drops, and the graph failed in ONNX Runtime on
    # 1 to 3 tokens ("broadcast ... 256 by 1024") and computed other logits on others
    layers = ["compressed_sparse_attention", "heavily_compressed_attention"]
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("deepseek_v4", layer_types=layers))
    model.save_pretrained(tmp_path / "plain")
    result = cli("export", tmp_path / "plain", "-o", tmp_path / "out", "--no-baseline")
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "holds for some sequence lengths of 'input_ids' only: torch.export assumed" in last, result.stderr
    assert "false at sequence 1 (asked: 1 to 32)" in last, result.stderr
    assert not (tmp_path / "out").exists()


def test_a_position_table_with_a_padding_row_bounds_the_context(tmp_path):
    # RoBERTa-style: train ran 32-token windows and failed in the model ("index 32 is out of bounds"), a traceback
    from taperfold.sources import open_source

    plain = _plain("roberta-prelayernorm", tmp_path / "plain")
    assert open_source(plain).config.max_seq_len == 30
    model = transformers.AutoModelForCausalLM.from_pretrained(plain).eval()
    with torch.no_grad():
        model(torch.full((1, 30), 5))  # the longest input it takes
        with pytest.raises(RuntimeError, match="out of bounds"):
            model(torch.full((1, 31), 5))


def test_an_attention_free_model_exports_a_graph_of_any_length_up_to_the_recurrent_context(tmp_path):
    # Mamba's config states no heads and no context: inspect refused it ("key 'num_attention_heads' is missing")
    from hf_models import tapered_tiny_model

    from taperfold.export import ExportOptions, export_checkpoint
    from taperfold.hf import save_hf_directory
    from taperfold.hf.model import RECURRENT_CONTEXT
    from taperfold.verify import verify_export

    tapered = save_hf_directory(tapered_tiny_model("mamba"), tmp_path / "tapered", step=3)
    out = export_checkpoint(tapered, tmp_path / "out", ExportOptions()).out_dir
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["config"]["n_heads"], manifest["config"]["max_seq_len"]) == (0, RECURRENT_CONTEXT)
    assert manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"] == 2  # each layer's norm
    report = verify_export(out, threads=1)
    assert report.passed, report.failure_message()
    assert f"random 4x{RECURRENT_CONTEXT}" in {row["input"] for pair in report.pairs for row in pair.per_input}


def test_the_final_norm_is_kept_for_its_own_reason_beside_a_layer_norm_of_the_same_name():
    # Qwen3-Next's linear-attention layers have a gated `linear_attn.norm`, which a DyT cannot replace (it has no gate
    # input): left untapered with its own reason; the final `model.norm` was given a layer norm's reason
    from taperfold.hf import taper_model
    from taperfold.taper import FINAL_KEPT

    tapering = taper_model(_model("qwen3_next"), "internal", kind="dyt")
    assert tapering.untapered["model.norm"] == FINAL_KEPT
    assert "a DyT has no form with a gate input" in tapering.untapered["model.layers.0.linear_attn.norm"]
    assert (
        "model.layers.0.linear_attn.norm" not in tapering.readers and "model.layers.0.input_layernorm" in tapering.norms
    )


def test_kv_cached_decoders_of_a_hybrid_are_one_line_before_any_trace(cli, tmp_path):
    plain = _plain("qwen3_next", tmp_path / "plain")
    result = cli("export", plain, "-o", tmp_path / "out", "--kv-cache", "growing")
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert (
        "--kv-cache: the model's transformers cache keeps recurrent states (linear attention, Mamba)" in result.stderr
    )
    assert not (tmp_path / "out").exists()


def test_llama4_exports_and_verifies_with_the_norm_before_its_experts_folded(cli, tmp_path, corpus):
    # torch.onnx failed on the complex rotary embedding (a ConversionError on an unsqueeze): exported in its real form
    plain = _plain("llama4_text", tmp_path / "plain")
    tapered, out = tmp_path / "tapered", tmp_path / "out"
    trained = cli("train", "--from", plain, "--data", corpus, "--steps", "30", "--batch-size", "2", "--out", tapered)
    assert trained.exit_code == 0, trained.stderr
    exported = cli("export", tapered, "-o", out)
    assert exported.exit_code == 0, exported.stderr
    verified = cli("verify", out)
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    # the input norms, and the norms before the MoE: read by the router, the shared expert and, through each token's
    # copies scaled by its router score, the experts' [in, out] stack
    assert manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"] == 4
    family = json.loads((tapered / "config.json").read_text())["taperfold"]["family"]
    assert "feed_forward.experts.gate_up_proj" in family["internal"]["post_attention_layernorm"]


# ---- the command line ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join((ROOT / "taperfold" / f).read_text() for f in ("taper.py", "train.py", "export.py")))
    return path


def _plain(name, folder):
    model = _model(name)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norm gains away from 1: a wrong gain cannot pass unnoticed
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if "Norm" in type(module).__name__ and isinstance(weight, torch.Tensor):
                weight.copy_(torch.rand(weight.shape, generator=gen) + 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cohere", "persimmon", "olmoe", "gpt_oss", "deepseek_v3", "gemma4_text"])
def test_unlisted_architecture_through_the_command_line(cli, tmp_path, corpus, name):
    plain = _plain(name, tmp_path / "plain")
    shown = cli("inspect", plain, "--json")
    assert shown.exit_code == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert "found by tracing" in info["arch"] and info["would_fold"] > 0
    would_fold = {n["name"]: n["folds_into"] for n in info["norms"] if n["folds_into"]}
    tapered, out = tmp_path / "tapered", tmp_path / "out"
    trained = cli("train", "--from", plain, "--data", corpus, "--steps", "30", "--batch-size", "2", "--out", tapered)
    assert trained.exit_code == 0, trained.stderr
    block = json.loads((tapered / "config.json").read_text())["taperfold"]
    traced = trace.traced_family(transformers.AutoConfig.from_pretrained(plain), name)
    assert block["family"] == family_to_data(traced)  # recorded as data
    shown = json.loads(cli("inspect", tapered, "--json").stdout)
    tapered_norms = {n["name"]: n["folds_into"] for n in shown["norms"] if n["tapered"]}
    assert tapered_norms == would_fold and all(n["foldable"] for n in shown["norms"] if n["tapered"])
    assert cli("export", tapered, "-o", out).exit_code == 0
    verified = cli("verify", out)
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["family_traced"] is True and manifest["source"]["family"] == name
    assert manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"] == len(tapered_norms)
    left = detect_norms(ir.load(out / "model.onnx"))
    assert left.candidates == [] and len(left.real_norms) == len(manifest["source"]["untapered"])
    if name in ("gpt_oss", "deepseek_v3"):  # the norm before the experts folds into them too
        assert tapered_norms["model.layers.1.post_attention_layernorm"][-1].startswith("model.layers.1.mlp.")
        assert any("experts.gate_up_proj" in r for r in tapered_norms["model.layers.1.post_attention_layernorm"])
    if name == "persimmon":  # its per-head q/k LayerNorms read a per-head split: left, with the reason
        qk = {k: v for k, v in manifest["source"]["untapered"].items() if re.search(r"[qk]_layernorm$", k)}
        assert len(qk) == 4 and all("not only by linear layers" in why for why in qk.values())


@pytest.fixture(scope="module")
def tapered_unlisted(tmp_path_factory):
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    return save_hf_directory(tapered_tiny_model("starcoder2"), tmp_path_factory.mktemp("traced") / "tapered", step=3)


def test_export_reads_the_recorded_family_without_tracing(cli, tmp_path, tapered_unlisted, monkeypatch):
    def no_tracing(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(trace, "_trace", no_tracing)
    result = cli("export", tapered_unlisted, "-o", tmp_path / "out", "--no-baseline")
    assert result.exit_code == 0, result.stderr
    report = json.loads((tmp_path / "out" / "manifest.json").read_text())["artifacts"]["folded"]["reports"]["fold"][
        "summary"
    ]
    assert report["folded"] == 4  # two layers, two norms each


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("norm", "dyt", "must be one of"),
        ("gain_offset", 2.0, "must be 0 or 1"),
        ("layers", "model.blocks", "not a list of layers"),
        ("internal", {"input_layernorm": ["self_attn.no_such_proj"]}, "no_such_proj"),
        ("internal", {"input_layernorm": []}, "non-empty list"),
        ("post", {"input_layernorm": "mlp.c_proj"}, "which 'internal' names too"),
        ("final", "model.layers.0.self_attn.q_proj", "not a norm module"),
        ("norm_eps", -1, "(0, 1]"),
        pytest.param("norm_eps", 10**400, "(0, 1]", id="norm_eps-10**400"),  # past the largest float
        ("surprise", 1, "not a known key"),
        (
            "internal",
            {
                "input_layernorm": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.q_proj"],
                "post_attention_layernorm": ["mlp.c_fc"],
            },
            "lists 'self_attn.q_proj' twice",
        ),
        ("final", "model.layers.1.input_layernorm", "is a norm inside a layer, not the norm after the last layer"),
        ("head", "model.embed_tokens", "is the input embedding, not the output head"),
        (
            "layer_readers",
            {"0": {"no_such_norm": ["mlp.c_fc"]}},
            "names 'no_such_norm', which is not a norm module in layer 0",
        ),
        ("gated", {"input_layernorm": {"activation": "tanh", "norm_first": True, "groups": 1}}, "must be one of silu"),
        ("gated", {"input_layernorm": {"activation": "silu"}}, "must map norm paths to objects with"),
        (
            "gated",
            {"mlp.norm": {"activation": "silu", "norm_first": True, "groups": 1}},
            "which the family does not taper",
        ),
        ("heads", {"input_layernorm": 1}, "the number of heads (> 1)"),
        ("heads", {"mlp.norm": 2}, "which the family does not taper"),
        ("gain_offsets", {"input_layernorm": 2}, "must map norm paths in a layer to 0 or 1"),
        (
            "layer_readers",
            {"7": {"post_attention_layernorm": ["mlp.c_fc"]}},
            "names layer 7; this starcoder2 model has 2",
        ),
        ("layer_readers", {"1": {"post_attention_layernorm": ["mlp.no_such_proj"]}}, "no_such_proj"),
        ("layer_readers", {"x": {}}, "must map layer indices to objects"),
        (
            "layer_producers",
            {"5": {"post_attention_layernorm": "mlp.c_proj"}},
            "names layer 5; this starcoder2 model has 2",
        ),
        ("layer_producers", {"1": {"post_attention_layernorm": "mlp.no_such_proj"}}, "no_such_proj"),
        ("layer_producers", {"1": {"post_attention_layernorm": ["mlp.c_proj"]}}, "must map post-norm paths to their"),
    ],
)
def test_bad_recorded_family_is_one_line_naming_the_key(cli, tmp_path, tapered_unlisted, key, value, needle):
    folder = shutil.copytree(tapered_unlisted, tmp_path / "in")
    config = json.loads((folder / "config.json").read_text())
    config["taperfold"]["family"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    for args in (["inspect", folder], ["export", folder, "-o", tmp_path / "out"]):
        result = cli(*args)
        assert result.exit_code == 2, (result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(folder / "config.json") in lines[0], result.stderr
        assert f"'taperfold.family.{key}'" in lines[0] and needle in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_a_recorded_family_that_tapers_fewer_norms_than_the_weights_is_one_line(cli, tmp_path, tapered_unlisted):
    # the weights hold post_attention_layernorm's taper (its c and γ̃); the block no longer tapers it
    folder = shutil.copytree(tapered_unlisted, tmp_path / "in")
    config = json.loads((folder / "config.json").read_text())
    del config["taperfold"]["family"]["internal"]["post_attention_layernorm"]
    (folder / "config.json").write_text(json.dumps(config))
    for args in (["inspect", folder], ["export", folder, "-o", tmp_path / "out"]):
        result = cli(*args)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "unexpected key 'model.layers.0.post_attention_layernorm.c'" in result.stderr
    assert not (tmp_path / "out").exists()
