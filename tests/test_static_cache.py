"""Static KV cache: the static decoder's export, its fixed shapes, its logits against the growing decoder and the
checkpoint at every step, the fold of its norms, the runners (ONNX Runtime with shared past/present buffers, torch
with the argmax on the device), verify, bench and the options' refusals. (That taperfold's own forward computes no
position tables per call is in test_models.py.)"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.exportdir import (
    CACHE_POSITION,
    GROWING,
    INPUT,
    NEXT_TOKEN,
    STATIC,
    decoder_io_names,
    graph_key,
    prompt_feeds,
    step_feeds,
)
from taperfold.manifest import read_manifest
from taperfold.models import random_gate0_model
from taperfold.runners.ort import OrtRunner
from taperfold.runners.torch_runner import TorchRunner
from taperfold.verify import DECODE_STEPS, decode_cases, verify_export

MAX_CACHE = 48  # shorter than the tiny preset's context (128): the cache length is --max-cache's
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device: torch sees none on this machine")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def static_export(request, tmp_path_factory):
    """A tiny g = 0 model of each built-in architecture exported with both decoders, the static one MAX_CACHE long."""
    root = tmp_path_factory.mktemp(f"static-{request.param}")
    model = random_gate0_model("tiny", arch=request.param)
    ckpt = save_checkpoint(checkpoint_from_model(model, step=0), root / "tiny.pt")
    opts = ExportOptions(decoders=(GROWING, STATIC), max_cache=MAX_CACHE)
    return export_checkpoint(ckpt, root / "out", opts).out_dir, model


def _ids(vocab: int, shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int64)


# ---- the export ------------------------------------------------------------------------------------------


def test_static_decoder_has_fixed_cache_shapes_and_named_tensors(static_export):
    out, model = static_export
    cfg = model.cfg
    manifest = read_manifest(out)
    assert manifest.to_json()["export"]["kv_cache"] == [GROWING, STATIC] and manifest.max_cache == MAX_CACHE
    graph = onnx.load(manifest.artifact("folded", STATIC), load_external_data=False).graph
    inputs, outputs = decoder_io_names(cfg.n_layers, STATIC)
    assert [i.name for i in graph.input] == inputs and inputs[:2] == ["input_ids", CACHE_POSITION]
    assert [o.name for o in graph.output] == outputs

    def dims(value):
        return [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]

    for value in [*graph.input[2:], *graph.output[1:]]:
        assert dims(value)[1:] == [cfg.kv_heads, MAX_CACHE, cfg.head_dim]  # only the batch is dynamic
    assert len(dims(graph.input[1])) == 1 and graph.input[1].type.tensor_type.elem_type == onnx.TensorProto.INT64


def test_folded_static_decoder_keeps_no_tapered_norm(static_export):
    out, model = static_export
    manifest = read_manifest(out)
    report, growing = manifest.report("folded.static", "fold"), manifest.report("folded.decoder", "fold")
    tapered = len(model.tapered_norms())
    assert report["summary"]["folded"] == tapered == growing["summary"]["folded"]
    assert report["summary"]["kept"] == 0 and report["summary"]["not_foldable"] == 0
    record = manifest.record(graph_key("folded", STATIC))
    assert sum(record.details.norm_ops.values()) == 1  # the final norm, kept as the scale anchor (Internal-Taper)
    assert record.path == "model.static.onnx" and record.built_from == "unfolded.static"


def test_static_steps_share_one_shape_and_update_the_cache_in_place(static_export):
    out, model = static_export
    cfg = model.cfg
    path = read_manifest(out).artifact("folded", STATIC)
    with OrtRunner(path, threads=1) as runner:
        ids = _ids(cfg.vocab_size, (2, 10))
        out_ = runner.run(runner.prepare(prompt_feeds(cfg, ids[:, :6], "fp32", MAX_CACHE)))
        present = [n for n in runner.output_names if n.startswith("present.")]
        buffers = [out_[n].data_ptr() for n in present]
        shapes = []
        for k in range(6, 10):
            feeds = step_feeds(cfg, ids[:, k : k + 1], out_, k, static=True)
            shapes.append({n: tuple(v.shape()) for n, v in feeds.items() if n.startswith("past_")})
            out_ = runner.run(runner.prepare(feeds))
            assert [out_[n].data_ptr() for n in present] == buffers  # present is the past's buffer, written in place
        assert all(s == shapes[0] for s in shapes)
        assert set(shapes[0].values()) == {(2, cfg.kv_heads, MAX_CACHE, cfg.head_dim)}


def test_static_logits_match_the_growing_decoder_and_the_checkpoint_at_every_step(static_export):
    out, model = static_export
    cfg, manifest = model.cfg, read_manifest(out)
    with (
        OrtRunner(manifest.artifact("folded", STATIC), threads=1) as static,
        OrtRunner(manifest.artifact("folded", GROWING), threads=1) as growing,
        TorchRunner(model, graph=GROWING) as checkpoint,
    ):
        for case in decode_cases(cfg.vocab_size, MAX_CACHE):
            got = static.decode_logits(case.ids, DECODE_STEPS, cfg, "fp32", MAX_CACHE)
            assert len(got) == DECODE_STEPS + 1
            for reference in (growing, checkpoint):
                want = reference.decode_logits(case.ids, DECODE_STEPS, cfg, "fp32")
                for step, (a, b) in enumerate(zip(got, want)):
                    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), f"{case.label} step {step}"


def test_verify_covers_the_static_decoders(static_export):
    out, _ = static_export
    report = verify_export(out, threads=1)
    static = {p.candidate: p for p in report.pairs if p.candidate.endswith(".static")}
    assert set(static) == {
        graph_key(v, STATIC)
        for v in ("baseline", "baseline-decomposed", "unfolded", "folded")
        if read_manifest(out).has_artifact(v, STATIC)
    }
    assert all(p.status == "pass" for p in static.values()) and report.passed
    steps = {r["input"].rsplit(" ", 2)[-1] for r in static[graph_key("folded", STATIC)].per_input}
    assert steps == {"prompt", *(str(k) for k in range(1, DECODE_STEPS + 1))}


# ---- the runners -----------------------------------------------------------------------------------------


def test_torch_static_runner_takes_the_argmax_on_the_device_and_matches_the_growing_one(static_export):
    _, model = static_export
    cfg, prompt = model.cfg, _ids(model.cfg.vocab_size, (2, 7))
    with TorchRunner(model, graph=GROWING) as growing:
        expected = growing.generate(prompt, 6, cfg, "fp32")
    with TorchRunner(model, graph=STATIC) as runner:
        assert runner.output_names[-1] == NEXT_TOKEN and CACHE_POSITION in runner.input_names
        got = runner.generate(prompt, 6, cfg, "fp32", cache_len=MAX_CACHE)
        out = runner.run(runner.prepare(prompt_feeds(cfg, prompt, "fp32", MAX_CACHE)))
        assert isinstance(out[NEXT_TOKEN], torch.Tensor) and out[NEXT_TOKEN].shape == (2, 1)
        fed = runner.prepare(step_feeds(cfg, out[NEXT_TOKEN], out, 7, static=True))
        assert fed[INPUT] is out[NEXT_TOKEN] and fed["past_key_values.0.key"] is out["present.0.key"]
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_allclose(got.last_logits, expected.last_logits, rtol=1e-5, atol=1e-5)


def test_runners_never_write_into_the_callers_cache_arrays(static_export):
    out, model = static_export
    cfg = model.cfg
    feeds = prompt_feeds(cfg, _ids(cfg.vocab_size, (1, 5)), "fp32", MAX_CACHE)
    with (
        TorchRunner(model, graph=STATIC) as torch_runner,
        OrtRunner(read_manifest(out).artifact("folded", STATIC), threads=1) as ort_runner,
    ):
        for runner in (torch_runner, ort_runner):
            runner.infer(feeds)
            assert not any(v.any() for n, v in feeds.items() if n.startswith("past_"))


class _ReplayOnCpu:
    """Stands in for torch.cuda.CUDAGraph on the CPU: a replay runs the captured forward on the static inputs and
    writes into the static outputs (what a real replay does on the device)."""

    def __init__(self, runner, inputs, outputs):
        self.runner, self.inputs, self.outputs = runner, inputs, outputs

    def replay(self):
        fresh = self.runner._forward(self.inputs)
        with torch.inference_mode():
            for name, value in fresh.items():
                if value is not self.outputs[name]:  # a static cache's present is its input, already written
                    self.outputs[name].copy_(value)


def test_torch_graph_bookkeeping_one_graph_serves_every_static_step(static_export):
    from taperfold.runners import torch_runner

    _, model = static_export
    cfg, prompt = model.cfg, _ids(model.cfg.vocab_size, (2, 7))
    with TorchRunner(model, graph=STATIC) as eager:
        expected = eager.generate(prompt, 5, cfg, "fp32", cache_len=MAX_CACHE)
    runner = TorchRunner(model, graph=STATIC)
    runner.cuda_graph = True  # the constructor refuses it off CUDA; the capture below needs no CUDA

    def capture(prepared):
        outputs = runner._forward(prepared)
        return torch_runner._Graph(_ReplayOnCpu(runner, dict(prepared), outputs), dict(prepared), outputs)

    runner._capture = capture
    with runner:
        for _ in range(2):
            got = runner.generate(prompt, 5, cfg, "fp32", cache_len=MAX_CACHE)
            np.testing.assert_array_equal(got.tokens, expected.tokens)
            np.testing.assert_allclose(got.last_logits, expected.last_logits, rtol=1e-5, atol=1e-6)
        assert len(runner.setup_log) == 2  # the prompt's graph and one for every step, in the first generation only
        prompt_graph, step_graph = runner._graphs.values()
        assert step_graph.inputs["past_key_values.0.key"] is prompt_graph.outputs["present.0.key"]
        assert step_graph.outputs["present.0.key"] is step_graph.inputs["past_key_values.0.key"]  # written in place


def test_ort_slot_bookkeeping_one_slot_serves_every_static_step(static_export):
    out, model = static_export
    cfg, prompt = model.cfg, _ids(model.cfg.vocab_size, (2, 7))
    path = read_manifest(out).artifact("folded", STATIC)
    with OrtRunner(path, threads=1) as plain:
        expected = plain.generate(prompt, 5, cfg, "fp32", cache_len=MAX_CACHE)
    runner = OrtRunner(path, device="cpu", threads=1)
    load = runner._load

    def load_on_cpu():  # a plain CPU session (no enable_cuda_graph), then slots kept on the CPU
        load()
        runner.cuda_graph, runner._slot_device = True, "cpu"  # the CPU EP ignores gpu_graph_id

    runner._load = load_on_cpu
    with runner:
        for _ in range(2):
            got = runner.generate(prompt, 5, cfg, "fp32", cache_len=MAX_CACHE)
            np.testing.assert_array_equal(got.tokens, expected.tokens)
            np.testing.assert_allclose(got.last_logits, expected.last_logits, rtol=1e-5, atol=1e-6)
        assert len(runner.setup_log) == 2  # a slot for the prompt, one for all the steps
        prompt_slot, step_slot = runner._slots.values()
        assert [s.run_options.get_run_config_entry("gpu_graph_id") for s in (prompt_slot, step_slot)] == ["1", "2"]
        for name in (n for n in runner.output_names if n.startswith("present.")):
            past = name.replace("present.", "past_key_values.")
            assert step_slot.outputs[name].data_ptr() == step_slot.inputs[past].data_ptr()  # one buffer, past/present
            assert step_slot.inputs[past].data_ptr() == prompt_slot.inputs[past].data_ptr()  # shared with the prompt


@needs_cuda
@pytest.mark.gpu
def test_static_decoding_on_cuda_matches_the_cpu(static_export):
    from taperfold.runners.ort import unavailable

    out, model = static_export
    cfg, prompt = model.cfg, _ids(model.cfg.vocab_size, (2, 7))
    with TorchRunner(model.copy(), decoder=STATIC) as cpu:
        expected = cpu.generate(prompt, 5, cfg, "fp32", cache_len=MAX_CACHE)
    with TorchRunner(model.copy(), decoder=STATIC, device="cuda", cuda_graph=True) as graphs:
        got = graphs.generate(prompt, 5, cfg, "fp32", cache_len=MAX_CACHE)
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    if unavailable("cuda") is None:
        with OrtRunner(read_manifest(out).artifact("folded", STATIC), device="cuda", cuda_graph=True) as ort_graphs:
            got = ort_graphs.generate(prompt, 5, cfg, "fp32", cache_len=MAX_CACHE)
        np.testing.assert_array_equal(got.tokens, expected.tokens)


# ---- bench and the command line ------------------------------------------------------------------------------


def test_bench_decodes_with_the_growing_cache_on_the_cpu_unless_told(static_export, tmp_path, cli):
    """On the CPU the growing cache is the default where the export has both (it was as fast or faster there); the
    report says why; --kv-cache static decodes with the static one."""
    out, model = static_export
    args = (
        "bench",
        out,
        "--mode",
        "decode",
        "--batch",
        "1",
        "--prompt",
        "8",
        "--new-tokens",
        "3",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--variants",
        "folded",
    )
    r = cli(*args, "--report", tmp_path / "growing.json")
    assert r.exit_code == 0, r.stderr
    report = json.loads((tmp_path / "growing.json").read_text())
    assert report["kv_cache"] == GROWING and "CPU default" in report["kv_cache_basis"]
    assert "decoders: growing KV cache (the CPU default" in r.stdout
    r = cli(*args, "--kv-cache", "static", "--report", tmp_path / "static.json")
    assert r.exit_code == 0, r.stderr
    assert f"decoders: static KV cache of {MAX_CACHE} positions" in r.stdout
    report = json.loads((tmp_path / "static.json").read_text())
    assert (report["kv_cache"], report["cache_length"], report["kv_cache_basis"]) == (STATIC, MAX_CACHE, "--kv-cache")
    r = cli(*args, "--engine", "torch", "--kv-cache", "static", "--report", tmp_path / "torch.json")
    assert r.exit_code == 0, r.stderr
    torch_report = json.loads((tmp_path / "torch.json").read_text())
    assert (torch_report["kv_cache"], torch_report["cache_length"]) == (STATIC, MAX_CACHE)
    # torch decodes with the projections fused as the export's static decoders are: q/k/v and gate/up in every
    # llama layer; GPT-2's c_attn and c_fc are one layer each already
    groups = 2 * model.cfg.n_layers if model.cfg.arch == "llama" else 0
    assert torch_report["fused_projections"] and torch_report["projection_groups"] == {"folded": groups}
    assert report["projection_groups"] == {"folded": groups}


@pytest.mark.parametrize(
    "args, message",
    [
        (("--max-cache", "32"), "--max-cache 32: only a static cache has a length; add --kv-cache static"),
        (
            ("--kv-cache", "static", "--max-cache", "129"),
            "--max-cache 129 exceeds the model's context (max_seq_len 128)",
        ),
        (("--kv-cache", "static", "--max-cache", "3"), "--max-cache must be 4 or more"),
        (("--kv-cache", "paged"), "--kv-cache must be growing or static (or both, comma-separated), got paged"),
    ],
)
def test_export_refuses_bad_cache_options_in_one_line(tiny_checkpoint, tmp_path, cli, args, message):
    r = cli("export", tiny_checkpoint, "-o", tmp_path / "out", *args)
    assert r.exit_code == 2 and r.stderr.startswith(f"taperfold: error: {message}") and r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_bench_refuses_a_static_cache_the_export_lacks_in_one_line(tiny_export, tmp_path, cli):
    r = cli(
        "bench",
        tiny_export,
        "--mode",
        "decode",
        "--kv-cache",
        "static",
        "--prompt",
        "8",
        "--new-tokens",
        "2",
        "--report",
        tmp_path / "r.json",
    )
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "missing key 'artifacts.baseline.static': re-export with --kv-cache static" in r.stderr
    r = cli("bench", tiny_export, "--kv-cache", "static", "--seq", "8", "--report", tmp_path / "r.json")
    assert r.exit_code == 2 and "--kv-cache chooses the decoders' cache: it needs --mode decode" in r.stderr


def test_bench_refuses_a_generation_longer_than_the_static_cache(static_export, cli):
    out, _ = static_export
    r = cli("bench", out, "--mode", "decode", "--kv-cache", "static", "--prompt", "40", "--new-tokens", "9")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert f"--prompt 40 + --new-tokens 9 exceeds the static cache ({MAX_CACHE} positions" in r.stderr


def test_bench_fits_the_default_prompt_to_the_static_cache(static_export, tmp_path, cli):
    # the default prompt (128) + 3 new tokens fits the context (128) of neither: with a static cache of 48, the
    # prompt is 45; with the growing cache it is capped by the context alone
    out, _ = static_export
    args = (
        "bench",
        out,
        "--mode",
        "decode",
        "--batch",
        "1",
        "--new-tokens",
        "3",
        "--warmup",
        "1",
        "--iters",
        "1",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--variants",
        "folded",
    )
    r = cli(*args, "--kv-cache", "static", "--report", tmp_path / "static.json")
    assert r.exit_code == 0, r.stderr
    assert (
        f"note: --prompt: the default 128 + --new-tokens 3 would pass the static cache (export --max-cache) "
        f"({MAX_CACHE}): prompt {MAX_CACHE - 3}"
    ) in r.stderr
    assert json.loads((tmp_path / "static.json").read_text())["settings"]["prompt"] == MAX_CACHE - 3
    r = cli(*args, "--kv-cache", "growing", "--report", tmp_path / "growing.json")
    assert r.exit_code == 0 and "would pass the model's context (128): prompt 125" in r.stderr
    assert json.loads((tmp_path / "growing.json").read_text())["settings"]["prompt"] == 125


# ---- the shortest static cache (--max-cache 4, the documented minimum) ----------------------------------------


@pytest.fixture(scope="module")
def shortest_cache_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("static-4")
    ckpt = save_checkpoint(checkpoint_from_model(random_gate0_model("tiny"), step=0), root / "tiny.pt")
    return export_checkpoint(ckpt, root / "out", ExportOptions(decoders=(STATIC,), max_cache=4)).out_dir


def test_verify_decodes_a_4_position_static_cache_with_2_prompt_tokens_and_2_steps(shortest_cache_export):
    report = verify_export(shortest_cache_export, threads=1)
    static = [p for p in report.pairs if p.candidate.endswith(".static")]
    assert static and all(p.status == "pass" for p in static) and report.passed
    assert {r["input"] for r in static[0].per_input} == {
        "decode 1x2+2 prompt",
        "decode 1x2+2 step 1",
        "decode 1x2+2 step 2",
    }


@pytest.mark.parametrize(
    "args, note, prompt, new_tokens",
    [
        (
            (),
            "--prompt: the default 128 + --new-tokens 32 would pass the static cache (export --max-cache) (4): "
            "prompt 2, --new-tokens 2",
            2,
            2,
        ),
        (
            ("--prompt", "3"),
            "--new-tokens: the default 32 after --prompt 3 would pass the static cache "
            "(export --max-cache) (4): 1 step",
            3,
            1,
        ),
        (
            ("--new-tokens", "2"),
            "--prompt: the default 128 + --new-tokens 2 would pass the static cache (export --max-cache) (4): prompt 2",
            2,
            2,
        ),
    ],
)
def test_bench_decodes_a_4_position_static_cache_with_default_lengths(
    shortest_cache_export, tmp_path, cli, args, note, prompt, new_tokens
):
    r = cli(
        "bench",
        shortest_cache_export,
        "--mode",
        "decode",
        "--kv-cache",
        "static",
        "--batch",
        "1",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--threads",
        "1",
        "--variants",
        "folded",
        *args,
        "--report",
        tmp_path / "r.json",
    )
    assert r.exit_code == 0, r.stderr
    assert f"note: {note}\n" in r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["settings"]["prompt"], report["settings"]["new_tokens"]) == (prompt, new_tokens)


def test_bench_says_why_it_decodes_with_the_static_cache_of_an_export_without_a_growing_one(
    shortest_cache_export, tmp_path, cli
):
    r = cli(
        "bench",
        shortest_cache_export,
        "--mode",
        "decode",
        "--batch",
        "1",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--threads",
        "1",
        "--variants",
        "folded",
        "--report",
        tmp_path / "r.json",
    )
    assert r.exit_code == 0, r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["kv_cache"] == STATIC
    assert report["kv_cache_basis"] == "the CPU default (growing) is not there for every variant timed"


def test_a_static_decoder_file_that_is_a_growing_one_is_one_line(static_export, tmp_path, cli):
    import shutil

    out = shutil.copytree(static_export[0], tmp_path / "out")
    manifest = read_manifest(out)
    growing, static = (manifest.record(graph_key("folded", g)) for g in (GROWING, STATIC))
    for name in ("path", "external_data"):
        if getattr(growing, name):
            shutil.copyfile(out / getattr(growing, name), out / getattr(static, name))
    for command in (
        (
            "bench",
            out,
            "--mode",
            "decode",
            "--kv-cache",
            "static",
            "--prompt",
            "4",
            "--new-tokens",
            "2",
            "--variants",
            "folded",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--report",
            tmp_path / "r.json",
        ),
        ("verify", out),
    ):
        r = cli(*command)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
        assert (
            f"{out / static.path}: is a growing KV-cache decoder (its inputs lack cache_position) where a static "
            "one was asked for"
        ) in r.stderr


# ---- transformers models -------------------------------------------------------------------------------------


def test_a_transformers_model_exports_and_verifies_a_static_decoder(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    folder = save_hf_directory(tapered_tiny_model("llama"), tmp_path / "tapered")
    out = export_checkpoint(folder, tmp_path / "out", ExportOptions(baseline=False, decoders=(STATIC,))).out_dir
    manifest = read_manifest(out)
    assert manifest.has_artifact("folded", STATIC) and not manifest.has_artifact("folded", GROWING)
    assert manifest.report("folded.static", "fold")["summary"]["kept"] == 0
    report = verify_export(out, threads=1)
    static = [p for p in report.pairs if p.candidate.endswith(".static")]
    assert {p.candidate for p in static} == {"unfolded.static", "folded.static"} and report.passed


def test_a_transformers_model_whose_cache_holds_an_indexers_keys_is_refused_in_one_line(tmp_path, cli):
    """dots.llm3's indexed-attention layer caches its indexer's keys beside the keys and values, which a static
    decoder does not carry (sliding-window layers, which keep every position here, take a static cache)."""
    pytest.importorskip("transformers")
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    folder = save_hf_directory(tapered_tiny_model("dots3_note_text"), tmp_path / "tapered")
    r = cli("export", folder, "-o", tmp_path / "out", "--kv-cache", "static")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "--kv-cache static: the model's transformers cache has layers that hold more than keys" in r.stderr
    assert not (tmp_path / "out").exists()
