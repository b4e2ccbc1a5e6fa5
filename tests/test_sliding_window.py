"""Models whose layers attend through a window shorter than their context (Mistral, Gemma 2/3, gpt-oss, Qwen2 with
use_sliding_window): every KV-cached decoder and deployment artifact decodes right past the window, verify's decode
cases cross it, and the artifacts that cannot are refused in one line before anything is traced."""

from __future__ import annotations

import pytest
from conftest import one_line, run_cli

pytest.importorskip("transformers")

WINDOW, CONTEXT = 8, 48


def _windowed(model_type: str, **changes):
    """A tapered tiny `model_type` attending through a WINDOW-token window in a CONTEXT-token context, its queries
    scaled up so that attention is sharp: which keys a query sees, and at which positions, moves its logits."""
    import torch
    from hf_models import tapered_tiny_model

    model = tapered_tiny_model(model_type, sliding_window=WINDOW, max_position_embeddings=CONTEXT, **changes)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("q_proj.weight"):
                parameter.mul_(8.0)
    return model


WINDOWED = {
    "mistral": {},  # a window on every layer, no layer_types
    "gemma2": {},  # sliding and full layers alternating
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"]},
    "qwen2": {"use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"]},
    "gpt_oss": {},  # sliding and full layers alternating, MoE experts
}


@pytest.mark.parametrize("model_type", sorted(WINDOWED))
def test_the_torch_decoder_of_a_windowed_model_gives_its_prefill_logits_past_the_window(tmp_path, model_type):
    """The decoder every artifact is traced from (and verify's reference decodes with) fed its own cache back as
    tensors, step by step from a prompt shorter than the window to twice past it: each step's present holds every
    position so far, and its logits are the whole sequence's at that position. transformers' window layers crop the
    cache (present shorter than past + new, which runtimes feed back as it is: ONNX Runtime failed in a Slice, genai's
    folders did not run) and, for Gemma 3, lose the positions with it (wrong logits)."""
    import torch

    from taperfold.hf import save_hf_directory
    from taperfold.sources import open_source

    source = open_source(save_hf_directory(_windowed(model_type, **WINDOWED[model_type]), tmp_path / "tapered"))
    assert source.config.window == WINDOW
    model = source.build(gate=0.0)
    ids = torch.randint(0, source.config.vocab_size, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    prompt = WINDOW // 2
    with torch.no_grad():
        whole = model(ids, logits="all")
        logits, present = model(ids[:, :prompt], past_key_values=None, use_cache=True)
        worst = (logits - whole[:, prompt - 1]).abs().max()
        for t in range(prompt, ids.shape[1]):
            logits, present = model(ids[:, t : t + 1], past_key_values=present, use_cache=True)
            worst = max(worst, (logits - whole[:, t]).abs().max())
            # the decoders' contract (docs/design.md): present = past + new, what every runtime feeds back
            assert {keys.shape[2] for keys, _ in present} == {t + 1}, (model_type, t)
    assert worst <= 1e-4 * whole.abs().max(), f"{model_type}: decoder off its prefill by {float(worst):.3g}"


def test_a_model_without_a_window_or_one_as_long_as_its_context_has_none():
    from hf_models import tiny_config

    from taperfold.hf.config_values import attention_window

    assert attention_window(tiny_config("llama")) is None
    assert attention_window(tiny_config("mistral", sliding_window=None)) is None
    # Qwen2's window is off unless use_sliding_window set its layer_types
    assert attention_window(tiny_config("qwen2", sliding_window=WINDOW)) is None
    assert attention_window(tiny_config("gemma3_text", sliding_window=WINDOW)) == WINDOW


def test_verify_decode_cases_cross_the_window():
    """A prompt that ends short of the window and steps that pass it, beside the cases every decoder gets: where a
    cache that crops to the window starts cropping."""
    from taperfold.verify.inputs import decode_cases, decode_steps

    steps = decode_steps(128)
    for window in (2, 5, 32, 100, 127):
        prompts = [c.ids.shape[1] - steps for c in decode_cases(256, 128, window=window)]
        # the prompt's past is within the window, the last step's (prompt + steps - 1 tokens) reaches it
        assert any(p < window <= p + steps - 1 for p in prompts), (window, prompts)
    assert [c.label for c in decode_cases(256, 128)] == [c.label for c in decode_cases(256, 128, window=128)]
    labels = [c.label for c in decode_cases(256, 128, window=18)]  # 16 + 4 steps cross 18 already: no twin label
    assert len(labels) == len(set(labels))


# ---- every artifact of a windowed model, exported and verified -------------------------------------------------


@pytest.fixture(scope="module")
def windowed_export(tmp_path_factory):
    """A windowed Gemma 3 (a sliding and a full layer) exported with every KV-cached artifact: growing and static
    decoders, their int4 forms, onnxruntime-genai folders, the stateful OpenVINO IR."""
    from taperfold.hf import save_hf_directory

    root = tmp_path_factory.mktemp("windowed")
    source = save_hf_directory(_windowed("gemma3_text", **WINDOWED["gemma3_text"]), root / "tapered")
    result = run_cli(
        "export", source, "-o", root / "out", "--no-baseline", "--kv-cache", "growing,static", "--genai",
        "--openvino", "--quantize", "int4",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return root / "out"


def test_every_decoder_and_deployment_artifact_of_a_windowed_model_decodes_right_past_the_window(windowed_export):
    from taperfold.verify import verify_export

    """Each decoder (growing, static, int4, genai folders, OpenVINO IR) judged on the decode cases, the one that
    crosses the window among them, and within its bound."""
    report = verify_export(windowed_export, threads=1)
    assert report.passed, report.failure_message()
    decoders = {p.candidate: p for p in report.pairs if any(row["input"].startswith("decode") for row in p.per_input)}
    assert {
        "folded.decoder", "folded.static", "folded.decoder.int4", "folded.static.int4", "folded.decoder.genai",
        "folded.decoder.int4.genai", "folded.decoder.openvino", "folded.decoder.int4.openvino",
    } <= set(decoders)  # fmt: skip
    crossing = f"decode 1x{WINDOW - 2}+4"
    for key, pair in decoders.items():
        assert pair.status == "pass", (key, pair.reason)
        assert any(row["input"].startswith(crossing) for row in pair.per_input), (key, pair.per_input)


# ---- the builder route: refused before tracing, or declined by auto with a note --------------------------------


def _builder_sized(model_type: str, **changes):
    """Head size 16: what the builder's attention takes on the CPU, so that only the limit under test stands."""
    from hf_models import tapered_tiny_model

    return tapered_tiny_model(model_type, hidden_size=64, intermediate_size=128, head_dim=16, **changes)


BUILDER_LIMITS = {
    "window": (lambda: _builder_sized("mistral", sliding_window=WINDOW), "attends through a window of 8 tokens"),
    "architecture": (lambda: _builder_sized("mixtral"), "builder does not build MixtralForCausalLM"),
    "special tokens": (
        lambda: _builder_sized("llama", bos_token_id=None, eos_token_id=None),
        "bos_token_id is in neither config.json nor the tokenizer's files",
    ),
    "no eos": (
        lambda: _builder_sized("llama", eos_token_id=None),
        "eos_token_id is in neither config.json nor the tokenizer's files, and the builder stops without it",
    ),
    # SmolLM3's NoPE layers (every 4th of the full-size model): the builder failed on them after the whole export
    "NoPE layer": (
        lambda: _builder_sized("smollm3", no_rope_layers=[1, 0]),
        "layer 1 has no rotary embedding (NoPE)",
    ),
}


@pytest.mark.parametrize("limit", sorted(BUILDER_LIMITS))
def test_the_builder_route_refuses_what_the_builder_cannot_make_before_tracing(tmp_path, limit, monkeypatch):
    """--genai-route builder of a model the builder would fail on (after the whole export) or make wrong: one line,
    nothing written, and torch.export never called."""
    pytest.importorskip("onnxruntime_genai")
    import torch

    from taperfold.hf import save_hf_directory

    build, needle = BUILDER_LIMITS[limit]
    source = save_hf_directory(build(), tmp_path / "tapered")

    def no_tracing(*args, **kwargs):
        raise AssertionError("traced before refusing")

    monkeypatch.setattr(torch.export, "export", no_tracing)
    result = run_cli("export", source, "-o", tmp_path / "out", "--genai", "--genai-route", "builder")
    one_line(result, needle, "--genai-route traced")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("limit", sorted(BUILDER_LIMITS))
def test_the_auto_route_takes_the_traced_route_for_what_the_builder_cannot_make(tmp_path, limit):
    """What the export asks of the model before tracing: the auto route needs the growing decoders (the traced
    route) for such a model, where it needs none for the builder's."""
    pytest.importorskip("onnxruntime_genai")
    from taperfold.artifacts.genai_folder import GENAI_FOLDER, GenaiRequest
    from taperfold.exportdir import GROWING
    from taperfold.hf import save_hf_directory
    from taperfold.sources import open_source

    build, _ = BUILDER_LIMITS[limit]
    source = open_source(save_hf_directory(build(), tmp_path / "tapered"))
    planned = GENAI_FOLDER.plan(GenaiRequest(), source, source.build(gate=0.0), "fp32")
    assert planned.route == "traced" and planned.declined and GENAI_FOLDER.needed_graphs(planned) == (GROWING,)


def test_the_builder_route_refuses_norms_read_by_experts_where_it_knows_the_architecture(tmp_path, monkeypatch):
    """A builder that built Mixtral still could not take taperfold's fold: its norms are read by the experts' fused
    weights, no linear layer."""
    pytest.importorskip("onnxruntime_genai")
    from taperfold.artifacts import genai_builder
    from taperfold.hf import save_hf_directory

    monkeypatch.setattr(genai_builder, "builder_architectures", lambda: {"MixtralForCausalLM"})
    source = save_hf_directory(_builder_sized("mixtral"), tmp_path / "tapered")
    result = run_cli("export", source, "-o", tmp_path / "out", "--genai", "--genai-route", "builder")
    one_line(result, "model.layers.0.post_attention_layernorm is read by", "no linear layer (MoE experts)")
    assert not (tmp_path / "out").exists()


def test_auto_exports_a_windowed_mistral_by_the_traced_route_with_a_note_and_it_verifies(tmp_path):
    """What used to exit 0 with folders that fail in GroupQueryAttention: the traced route, the reason in the
    manifest and on the console, and folders that decode past the window (with ONNX Runtime's fusions too)."""
    pytest.importorskip("onnxruntime_genai")
    from taperfold.hf import save_hf_directory
    from taperfold.manifest import read_manifest
    from taperfold.verify import verify_export

    source = save_hf_directory(_windowed("mistral", hidden_size=64, intermediate_size=128, head_dim=16), tmp_path / "t")
    result = run_cli("export", source, "-o", tmp_path / "out", "--no-baseline", "--genai", "--ort-fusions")
    assert result.exit_code == 0, result.stderr
    assert "note: onnxruntime-genai folders by the traced route, not the builder's: the model attends" in result.stdout
    (record,) = read_manifest(tmp_path / "out").records("genai")
    assert record.details.route == "traced" and "window of 8 tokens" in record.details.builder_declined
    report = verify_export(tmp_path / "out", threads=1)
    assert report.passed, report.failure_message()
    assert "checkpoint -> folded.decoder.genai" in {p.name for p in report.pairs}
    # nor is the builder's own graph of it a contender: bench --against refuses before any timing
    result = run_cli("bench", tmp_path / "out", "--engine", "genai", "--mode", "decode", "--against", "genai-builder")
    one_line(result, "--against genai-builder: the model attends through a window of 8 tokens")
    assert not (tmp_path / "out" / "against").exists()


def test_a_window_in_the_config_that_no_layer_uses_gives_builder_folders_that_decode_past_it(tmp_path):
    """SmolLM3 with `sliding_window` set and use_sliding_window false (every layer full attention): onnxruntime-genai's
    builder still wrote a `sliding_window` section listing no layer, which genai reads as every layer, and the folders
    failed in GroupQueryAttention once the past passed the window. The route drops the section (the graph's attention
    has no window), the folders decode past the window, and so does bench's contender, the builder's own folder of the
    plain model; a folder that has the section back is one line before onnxruntime-genai reads it."""
    pytest.importorskip("onnxruntime_genai")
    import json

    from taperfold.errors import TaperfoldError
    from taperfold.genai_config import check_genai_folder
    from taperfold.hf import save_hf_directory
    from taperfold.verify import verify_export

    model = _builder_sized("smollm3", sliding_window=WINDOW, max_position_embeddings=CONTEXT)
    assert model.config.use_sliding_window is False and model.config.sliding_window == WINDOW
    source = save_hf_directory(model, tmp_path / "tapered")
    result = run_cli("export", source, "-o", tmp_path / "out", "--no-baseline", "--genai", "--genai-route", "builder")
    assert result.exit_code == 0, result.stderr
    folder = tmp_path / "out" / "genai" / "folded"
    config = json.loads((folder / "genai_config.json").read_text())
    assert "sliding_window" not in config["model"]["decoder"]
    report = verify_export(tmp_path / "out", threads=1)
    assert report.passed, report.failure_message()
    (pair,) = [p for p in report.pairs if p.name == "checkpoint -> folded.decoder.genai"]
    prompts = {int(row["input"].split("x")[1].split("+")[0]) for row in pair.per_input}
    assert max(prompts) > WINDOW, prompts  # genai's decode steps there attend past the window
    # the builder's own folder of the plain model, bench's contender, is made so too: timed past the window
    args = ("bench", tmp_path / "out", "--engine", "genai", "--mode", "decode", "--against", "genai-builder",
            "--variants", "folded", "--batch", "1", "--prompt", str(WINDOW + 2), "--new-tokens", "3", "--warmup", "1",
            "--iters", "1", "--rounds", "1", "--threads", "1")  # fmt: skip
    result = run_cli(*args)
    assert result.exit_code == 0, result.stderr
    contender = json.loads((tmp_path / "out" / "against" / "genai-builder-fp32" / "genai_config.json").read_text())
    assert "sliding_window" not in contender["model"]["decoder"]
    config["model"]["decoder"]["sliding_window"] = {"window_size": WINDOW, "layers": []}
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(TaperfoldError, match=r"keeps every layer.s .* cache as a window of 8 tokens.* has no window"):
        check_genai_folder(folder)


@pytest.mark.parametrize("window", ["32", 0, True, 2.5])
def test_a_manifest_window_that_is_no_positive_integer_is_refused(window):
    """The manifest's `config.window` is input (verify reads it back for its decode cases): ValueError, which the
    manifest turns into one line naming key 'config'."""
    from taperfold.hf.model import HFModelInfo

    shape = dict(arch="mistral", family="mistral", vocab_size=256, d_model=32, n_layers=2, n_heads=4, kv_heads=2,
                 head_dim=8, max_seq_len=48, taper="internal", norm_kind="rms", tie_embeddings=False)  # fmt: skip
    assert HFModelInfo.from_dict({**shape, "window": 8}).window == 8
    with pytest.raises(ValueError, match="window must be null or a positive integer"):
        HFModelInfo.from_dict({**shape, "window": window})
