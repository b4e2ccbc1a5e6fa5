"""onnxruntime-genai output: `export --genai` writes a folder per variant that `onnxruntime_genai.Model` loads, whose
greedy generations are the checkpoint's, which verify judges and `bench --engine genai` times; and the requests genai
cannot serve are refused in one line before the export's work. Skipped where onnxruntime-genai is not installed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import one_line, run_cli

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.exportdir import GROWING
from taperfold.manifest import read_manifest
from taperfold.models import baseline_of, random_gate0_model
from taperfold.runners.torch_runner import TorchRunner

og = pytest.importorskip(
    "onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'taperfold[genai]')"
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def genai_export(tmp_path_factory):
    """A tiny llama at g = 0 with random weights (its greedy tokens vary, so they can disagree) exported with
    --genai: folders for the folded and the baseline decoders."""
    root = tmp_path_factory.mktemp("genai")
    model = random_gate0_model("tiny", arch="llama")
    ckpt = save_checkpoint(checkpoint_from_model(model, step=0), root / "tiny.pt")
    result = run_cli("export", ckpt, "-o", root / "out", "--genai")
    assert result.exit_code == 0, result.stderr
    return root / "out", model, ckpt


def _genai_greedy(folder, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """genai's own loop, as a user runs it: the prompt, then generate_next_token until `steps` + 1 tokens; the tokens
    and the last logits."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, batch_size=prompt.shape[0], max_length=prompt.shape[1] + steps + 1)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt.astype(np.int32))
    tokens = []
    for _ in range(steps + 1):
        generator.generate_next_token()
        tokens.append(generator.get_next_tokens().copy())
    return np.stack(tokens, axis=1), np.asarray(generator.get_output("logits"))[:, -1, :]


def test_export_writes_genai_folders_of_the_folded_model_and_the_baseline(genai_export):
    out, model, _ = genai_export
    manifest = read_manifest(out)
    records = {r.variant: r for r in manifest.records("genai")}
    assert set(records) == {"folded", "baseline"}  # of the four decoders exported, what a user deploys
    cfg = model.cfg
    for variant, record in records.items():
        folder = manifest.file(record).parent
        decoder = manifest.find(variant, GROWING)
        assert record.graph == GROWING and record.built_from == decoder.key and folder == out / "genai" / variant
        config = json.loads((folder / "genai_config.json").read_text())
        section = config["model"]["decoder"]
        assert config["model"]["type"] == "decoder" and section["filename"] == decoder.path
        assert (section["num_hidden_layers"], section["num_key_value_heads"], section["head_size"]) == (
            cfg.n_layers,
            cfg.kv_heads,
            cfg.head_dim,
        )
        assert config["search"]["past_present_share_buffer"] is False
        # the weights are the export's, in a file of the folder's own (a link would make onnx-ir refuse both)
        copy, own = folder / decoder.external_data, out / decoder.external_data
        assert copy.read_bytes() == own.read_bytes() and not os.path.samefile(copy, own)


@pytest.mark.parametrize("variant", ["folded", "baseline"])
def test_genai_generates_the_checkpoints_greedy_tokens(genai_export, variant):
    out, model, _ = genai_export
    reference = model if variant == "folded" else baseline_of(model)
    prompt = np.random.default_rng(3).integers(0, model.cfg.vocab_size, (2, 11), dtype=np.int64)
    with TorchRunner(reference, graph=GROWING) as runner:
        expected = runner.generate(prompt, 12, model.cfg, "fp32")
    tokens, last_logits = _genai_greedy(out / "genai" / variant, prompt, 12)
    np.testing.assert_array_equal(tokens, expected.tokens)
    # random weights repeat a token: the logits of the last step (position 23) are what a wrong position would change
    np.testing.assert_allclose(last_logits, expected.last_logits, rtol=1e-4, atol=1e-4)


def test_genai_runner_logits_match_the_torch_decoder(genai_export):
    from taperfold.runners.genai import GenaiRunner

    out, model, _ = genai_export
    ids = np.random.default_rng(4).integers(0, model.cfg.vocab_size, (3, 9), dtype=np.int64)
    with TorchRunner(model, graph=GROWING) as runner:
        expected = runner.decode_logits(ids, 4, model.cfg, "fp32")
    with GenaiRunner(out / "genai" / "folded" / "genai_config.json", threads=1) as runner:
        got = runner.decode_logits(ids, 4, model.cfg, "fp32")
    assert len(got) == 5
    for want, have in zip(expected, got):
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-4)


def test_verify_judges_every_genai_folder(genai_export):
    from taperfold.verify import verify_export

    out, _, _ = genai_export
    report = verify_export(out, threads=1)
    genai = {p.candidate: p for p in report.pairs if p.candidate.endswith(".genai")}
    assert set(genai) == {r.key for r in read_manifest(out).records("genai")} and "folded.decoder.genai" in genai
    assert all(p.status == "pass" for p in genai.values()), [(p.candidate, p.status, p.reason) for p in genai.values()]
    assert report.passed


def test_verify_fails_a_genai_folder_whose_decoder_is_wrong(genai_export, tmp_path):
    """The baseline's folder made to run the folded decoder (a copy, named in its genai_config.json) fails its pair."""
    import shutil

    from taperfold.verify import verify_export

    out, _, _ = genai_export
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    folded, baseline = copy / "genai" / "folded", copy / "genai" / "baseline"
    for name in ("model.decoder.onnx", "model.decoder.onnx.data"):
        shutil.copyfile(folded / name, baseline / name)
    config = json.loads((baseline / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "model.decoder.onnx"
    (baseline / "genai_config.json").write_text(json.dumps(config))
    report = verify_export(copy, threads=1)
    pair = next(p for p in report.pairs if p.candidate == "baseline.decoder.genai")
    assert pair.status == "fail" and not report.passed


def test_bench_builds_a_missing_folder_and_times_genai_generations(genai_export, tmp_path):
    import shutil

    out, _, _ = genai_export
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    result = run_cli(
        "bench", copy, "--engine", "genai", "--mode", "decode", "--batch", "1,2", "--prompt", "8",
        "--new-tokens", "4", "--warmup", "1", "--iters", "2", "--rounds", "1", "--threads", "1", "--json", "-",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["engine"] == "genai" and report["kv_cache"] == GROWING
    rows = {(r["variant"], r["batch"]) for r in report["results"]}
    assert rows == {(v, b) for v in ("baseline", "unfolded", "folded") for b in (1, 2)}
    # a genai folder does not say how its projections run: the report claims nothing about fusion
    assert report["fused_projections"] is None and report["projection_groups"] == {}
    # the unfolded model's folder was built for the run and recorded
    assert read_manifest(copy).find("unfolded", GROWING, "genai") is not None


def test_bench_genai_refuses_what_it_cannot_time(genai_export):
    out, _, _ = genai_export
    one_line(run_cli("bench", out, "--engine", "genai"), "whole generations", "--mode decode")
    one_line(
        run_cli("bench", out, "--engine", "genai", "--mode", "decode", "--kv-cache", "static"),
        "onnxruntime-genai",
        "growing",
    )


@pytest.mark.parametrize(
    ("flags", "needles"),
    [(("--dtype", "bf16"), ("bfloat16", "bf16")), (("--logits", "all"), ("--logits last",))],
)
def test_export_refuses_a_genai_folder_genai_cannot_read(genai_export, tmp_path, flags, needles):
    _, _, ckpt = genai_export
    result = run_cli("export", ckpt, "-o", tmp_path / "out", "--genai", *flags)
    one_line(result, *needles)
    assert not (tmp_path / "out").exists()


def test_a_transformers_source_gives_its_folder_its_tokens_and_tokenizer(tmp_path):
    """A plain Hugging Face Llama (its export: the baseline): the folder carries the directory's bos/eos/pad ids and
    tokenizer files, and genai's greedy tokens are transformers' own."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    source = tmp_path / "plain"
    model.save_pretrained(source)
    tokenizer = {"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, "unk_token": "a"}}
    (source / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = run_cli("export", source, "-o", tmp_path / "out", "--genai")
    assert result.exit_code == 0, result.stderr
    folder = tmp_path / "out" / "genai" / "baseline"
    written = json.loads((folder / "genai_config.json").read_text())["model"]
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, [2, 3], 0)
    assert written["decoder"]["num_key_value_heads"] == 2 and written["context_length"] == 64
    assert (folder / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    prompt = np.random.default_rng(5).integers(4, 256, (1, 9), dtype=np.int64)
    ids = torch.from_numpy(prompt)
    with torch.inference_mode():
        for _ in range(8):  # transformers' greedy loop, never stopping at eos (as the runner's generations)
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    from taperfold.runners.genai import GenaiRunner

    with GenaiRunner(folder, threads=1) as runner:
        generation = runner.generate(prompt, 7, None, "fp32")
    np.testing.assert_array_equal(generation.tokens, ids[:, 9:].numpy())


# ---- the builder route: onnxruntime-genai's own builder, the tapered norms replaced after it -------------------------


@pytest.fixture(scope="module")
def builder_export(tmp_path_factory):
    """A tiny tapered Hugging Face Llama at g = 0 (its norm parameters away from their defaults), with a tokenizer (the
    builder saves one), exported with --genai: the builder route, chosen by default for such a source."""
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from taperfold.hf import taper_model
    from taperfold.hf.save import save_hf_directory

    root = tmp_path_factory.mktemp("genai-builder")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=48,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip  (head size 16: ONNX Runtime's GroupQueryAttention on the CPU takes multiples of 16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tapering = taper_model(model, "internal")
    with torch.no_grad():
        for norm in tapering.norms.values():
            norm.weight_tilde.uniform_(0.5, 1.5)
            norm.c.uniform_(0.5, 2.0)
            norm.calibrated.fill_(True)
    tapering.set_gate(0.0)
    vocab = {f"<{i}>": i for i in range(model.config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<0>")))
    tokenizer.save_pretrained(root / "tokenizer")
    save_hf_directory(model, root / "tapered", tokenizer_from=root / "tokenizer")
    result = run_cli("export", root / "tapered", "-o", root / "out", "--genai", "--no-fuse-projections")
    assert result.exit_code == 0, result.stderr
    return root / "out", model


def _op_types(path) -> list[str]:
    import onnx

    return [node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node]


def test_builder_route_folders_are_the_builders_graph_minus_the_tapered_norms(builder_export):
    out, model = builder_export
    manifest = read_manifest(out)
    records = {r.variant: r for r in manifest.records("genai")}
    assert set(records) == {"folded", "baseline"} and {r.details.route for r in records.values()} == {"builder"}
    # the builder builds from the source: no traced decoder was exported for it (issue 27's export time)
    assert not [r for r in manifest.records("onnx") if r.graph != "prefill"]
    layers = model.config.num_hidden_layers
    norms = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
    baseline, folded = (_op_types(out / "genai" / v / "model.onnx") for v in ("baseline", "folded"))
    assert "GroupQueryAttention" in folded and "GroupQueryAttention" in baseline
    assert sum(op in norms for op in baseline) == 2 * layers + 1  # two per layer and the final norm
    assert sum(op in norms for op in folded) == 1  # the final norm, which Internal-Taper keeps
    assert "Mul" not in set(folded) - set(baseline)  # no constant scale left in front of the MatMuls


def test_verify_holds_every_builder_folder_to_its_torch_model(builder_export):
    from taperfold.verify import verify_export

    out, _ = builder_export
    report = verify_export(out, threads=1)
    genai = [p for p in report.pairs if p.candidate.endswith(".genai")]
    assert {p.candidate for p in genai} == {"folded.decoder.genai", "baseline.decoder.genai"}
    assert all(p.status == "pass" for p in genai), [(p.candidate, p.status, p.reason) for p in genai]


def test_verify_fails_a_builder_folder_whose_norms_went_without_the_fold(builder_export, tmp_path):
    """The baseline's graph (plain weights) with the tapered norms dropped, as the folded folder: the fold is missing
    from its weights, and verify says so."""
    import shutil

    from taperfold.artifacts.genai_builder import BuilderRoute, replace_tapered_norms
    from taperfold.sources import open_source
    from taperfold.verify import verify_export

    out, _ = builder_export
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copyfile(copy / "genai" / "baseline" / name, copy / "genai" / "folded" / name)
    scales = BuilderRoute(open_source(read_manifest(copy).checkpoint), "test").scales
    replace_tapered_norms(copy / "genai" / "folded" / "model.onnx", scales, keep_scale=False)
    report = verify_export(copy, threads=1)
    pair = next(p for p in report.pairs if p.candidate == "folded.decoder.genai")
    assert pair.status == "fail" and not report.passed


def test_bench_builds_the_unfolded_folder_by_the_builder_too(builder_export, tmp_path):
    """One graph form for every variant timed: the unfolded model's folder, built on demand, is the builder's graph
    with each tapered norm a Mul by c·γ̃."""
    import shutil

    out, model = builder_export
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    result = run_cli(
        "bench", copy, "--engine", "genai", "--mode", "decode", "--batch", "1", "--prompt", "8", "--new-tokens", "4",
        "--warmup", "1", "--iters", "2", "--rounds", "1", "--threads", "1", "--json", "-",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    record = read_manifest(copy).find("unfolded", GROWING, "genai")
    assert record is not None and record.details.route == "builder"
    unfolded = _op_types(copy / "genai" / "unfolded" / "model.onnx")
    assert unfolded.count("Mul") - _op_types(copy / "genai" / "folded" / "model.onnx").count("Mul") == 2 * (
        model.config.num_hidden_layers
    )


def test_builder_route_quantizes_with_the_builders_own_int4(builder_export, tmp_path):
    """`--quantize int4` on the builder route: the builder's `-p int4` on the plain and the folded weights (MatMulNBits,
    blocks of 32, GroupQueryAttention kept), the tapered norms replaced as in fp32; verify holds each folder to its
    torch model within int4's bounds."""
    import shutil

    from taperfold.compare import QUANTIZED_TOLERANCES
    from taperfold.verify import verify_export

    out, _ = builder_export
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    from taperfold.artifacts.genai_folder import GenaiRequest

    records = read_manifest(copy).build("genai", GenaiRequest(precisions=("int4",)))
    assert {(r.key, r.path) for r in records} == {
        (f"{v}.decoder.int4.genai", f"genai/{v}-int4/genai_config.json") for v in ("folded", "baseline")
    }
    assert all(r.details.route == "builder" and r.reports["quantize"]["block_size"] == 32 for r in records)
    folded = _op_types(copy / "genai" / "folded-int4" / "model.onnx")
    assert "MatMulNBits" in folded and "GroupQueryAttention" in folded
    norms = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
    assert sum(op in norms for op in folded) == 1  # the final norm only
    report = verify_export(copy, threads=1)
    pairs = {p.candidate: p for p in report.pairs if p.candidate.endswith(".int4.genai")}
    assert set(pairs) == {"folded.decoder.int4.genai", "baseline.decoder.int4.genai"}
    for pair in pairs.values():
        assert pair.tolerance == QUANTIZED_TOLERANCES["int4"] and pair.status == "pass", pair.violations


def test_bench_against_genai_builder_times_the_builders_own_untapered_model(builder_export, tmp_path):
    """`--against genai-builder`: the builder on the source's plain model (its norms real), built once into
    DIR/against/, timed in the same rounds; the report names tool, version, precision and command. On the builder
    route it is the very graph of the baseline folder."""
    import shutil

    import onnxruntime_genai

    out, _ = builder_export
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    args = (
        "bench", copy, "--engine", "genai", "--mode", "decode", "--against", "genai-builder", "--variants",
        "baseline,folded", "--batch", "1", "--prompt", "8", "--new-tokens", "3", "--warmup", "1", "--iters", "2",
        "--rounds", "1", "--threads", "1", "--json", "-",
    )  # fmt: skip
    result = run_cli(*args)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert {row["variant"] for row in report["results"]} == {"baseline", "folded", "genai-builder"}
    (made,) = report["against"]
    assert made["version"] == onnxruntime_genai.__version__ and made["precision"] == "fp32"
    assert made["tool"] == "onnxruntime-genai model builder" and "-p fp32 -e cpu" in made["command"]
    folder = copy / "against" / "genai-builder-fp32"
    assert made["folder"] == str(folder)
    for name in ("model.onnx", "model.onnx.data"):
        assert (folder / name).read_bytes() == (copy / "genai" / "baseline" / name).read_bytes()
    stamp = (folder / "model.onnx").stat().st_mtime_ns
    assert run_cli(*args).exit_code == 0 and (folder / "model.onnx").stat().st_mtime_ns == stamp  # built once


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--mode", "decode", "--against", "genai-builder"], ["builds from a Hugging Face directory"]),
        (["--against", "genai-builder"], ["--against genai-builder runs whole generations", "--mode decode"]),
        (["--mode", "decode", "--against", "llama.cpp"], ["--against must be one of", "genai-builder"]),
    ],
)
def test_bench_against_refusals_are_one_line(genai_export, tmp_path, args, needles):
    out, _, _ = genai_export
    result = run_cli("bench", out, "--engine", "ort", "--iters", "1", *args)
    one_line(result, *needles)
    assert not (out / "against").exists()


def test_builder_route_refuses_a_source_the_builder_does_not_read(genai_export, tmp_path):
    _, _, ckpt = genai_export
    result = run_cli("export", ckpt, "-o", tmp_path / "out", "--genai", "--genai-route", "builder")
    one_line(result, "builder reads a Hugging Face directory", "--genai-route traced")
    assert not (tmp_path / "out").exists()


def test_builder_route_takes_a_byte_level_directory_and_gives_its_folder_a_byte_tokenizer(tmp_path):
    """A directory with no tokenizer (taperfold's byte-level models, `train --from` of one): the builder needs a
    tokenizer, so the plain directory it reads gets the byte tokenizer, and genai's own Tokenizer in the folder encodes
    text to its bytes."""
    transformers = pytest.importorskip("transformers")
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    config = dict(hidden_size=64, intermediate_size=128, head_dim=16)  # GQA on the CPU: head size 16
    source = save_hf_directory(tapered_tiny_model("llama", **config), tmp_path / "tapered")
    assert not any(p.name.startswith("tokenizer") for p in source.iterdir())
    result = run_cli("export", source, "-o", tmp_path / "out", "--genai", "--no-baseline", "--genai-route", "builder")
    assert result.exit_code == 0, result.stderr
    folder = tmp_path / "out" / "genai" / "folded"
    assert transformers and (folder / "tokenizer.json").is_file()
    text = "héllo, wörld\n\t€"
    assert og.Tokenizer(og.Model(str(folder))).encode(text).tolist() == list(text.encode())


def test_builder_route_checks_the_folders_the_builder_wrote_before_keeping_them(tmp_path, monkeypatch):
    """The builder adds the tokenizer's end-of-turn id to the config's end-of-sequence ids, and for a model whose
    tokenizer is larger than its vocabulary that id is no token (a tiny Qwen2): export kept such a folder, exit 0, and
    only verify refused it. Each folder is checked as verify checks it, and none is kept."""
    pytest.importorskip("transformers")
    from hf_models import tapered_tiny_model

    from taperfold.artifacts.genai_builder import BuilderRoute
    from taperfold.hf import save_hf_directory

    config = dict(hidden_size=64, intermediate_size=128, head_dim=16)  # GQA on the CPU: head size 16
    source = save_hf_directory(tapered_tiny_model("llama", **config), tmp_path / "tapered")
    build = BuilderRoute.build

    def with_a_turn_end_past_the_vocabulary(self, folders, *args, **kwargs):
        build(self, folders, *args, **kwargs)
        for folder in folders.values():
            written = json.loads((folder / "genai_config.json").read_text())
            written["model"]["eos_token_id"] = [written["model"]["vocab_size"], 2]
            (folder / "genai_config.json").write_text(json.dumps(written))

    monkeypatch.setattr(BuilderRoute, "build", with_a_turn_end_past_the_vocabulary)
    result = run_cli("export", source, "-o", tmp_path / "out", "--genai", "--no-baseline", "--genai-route", "builder")
    one_line(result, "genai_config.json: key 'model.eos_token_id'", "no token of the vocabulary",
             "--genai-route traced")  # fmt: skip
    assert str(tmp_path / "out" / "genai") in result.stderr and ".tmp" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_builder_route_refuses_a_model_with_a_linear_layer_as_wide_as_the_vocabulary(tmp_path):
    """onnxruntime-genai 0.18's builder takes every linear layer with vocab_size outputs for the LM head: a byte-level
    model of hidden size 256 (q_proj 256 -> 256) came out wrong at every length (verify caught it). The builder route
    refuses it in one line; auto takes the traced route instead, and bench --against genai-builder refuses it."""
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    model = tapered_tiny_model("llama", hidden_size=256, intermediate_size=64, head_dim=64)
    source = save_hf_directory(model, tmp_path / "tapered")
    result = run_cli("export", source, "-o", tmp_path / "out", "--genai", "--genai-route", "builder")
    one_line(result, "model.layers.0.self_attn.q_proj has vocab_size (256) outputs", "--genai-route traced")
    assert not (tmp_path / "out").exists()
    result = run_cli("export", source, "-o", tmp_path / "out", "--genai", "--no-baseline")
    assert result.exit_code == 0, result.stderr
    assert {r.details.route for r in read_manifest(tmp_path / "out").records("genai")} == {"traced"}
    # nor is the builder's own graph of it a contender: bench --against refuses before any timing
    result = run_cli("bench", tmp_path / "out", "--engine", "genai", "--mode", "decode", "--against", "genai-builder")
    one_line(result, "model.layers.0.self_attn.q_proj has vocab_size outputs", "would be wrong")
