"""A newcomer's first hour, and the third round of hostile flags and signals (issue 21): defaults that fit the
model, a plain directory described, no diverged model saved, nothing left behind, one line for every failure."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from taperfold.errors import TaperfoldError

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def one_line(result, *needles) -> None:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("taperfold: error: "), result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


# ---- defaults that fit the model -------------------------------------------------------------------------


def test_bench_default_lengths_are_capped_at_the_context_and_say_so(tiny_export, tmp_path, cli):
    report = tmp_path / "b.json"
    r = cli("bench", tiny_export, "--engine", "ort", "--variants", "folded", "--batch", "1", "--iters", "1",
            "--warmup", "0", "--threads", "1", "--report", report)
    assert r.exit_code == 0, r.stderr
    assert "note: --seq: the defaults 128,256,512 are capped at the model's context (128): timing 128" in r.stderr
    assert {row["seq"] for row in json.loads(report.read_text())["results"]} == {128}
    r = cli("bench", tiny_export, "--engine", "ort", "--mode", "decode", "--variants", "folded", "--batch", "1",
            "--new-tokens", "4", "--iters", "1", "--warmup", "0", "--threads", "1", "--report", report)
    assert r.exit_code == 0, r.stderr
    assert "note: --prompt: the default 128 + --new-tokens 4 would pass the model's context (128): prompt 124" \
        in r.stderr
    one_line(cli("bench", tiny_export, "--engine", "ort", "--seq", "512"), "--seq 512 exceeds the model's context")


# ---- inspect on a plain Hugging Face directory ---------------------------------------------------------------


def test_inspect_describes_a_plain_hugging_face_directory_and_how_to_taper_it(tmp_path, cli):
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_config

    transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "plain")
    r = cli("inspect", tmp_path / "plain", "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["taper"] == "none" and info["foldable"] == 0 and info["how_to_taper"].startswith(
        f"`taperfold train --from {tmp_path / 'plain'}")
    layers = {n["name"]: n for n in info["norms"] if n["name"].startswith("model.layers.0.")}
    assert layers["model.layers.0.input_layernorm"]["folds_into"] == [
        f"model.layers.0.self_attn.{x}_proj" for x in "qkv"]
    assert info["would_fold"] == 2 * len({n.split(".")[2] for n in (m["name"] for m in info["norms"])
                                          if n.startswith("model.layers.")})
    r = cli("inspect", tmp_path / "plain")
    assert r.exit_code == 0 and "train --from" in r.stdout


# ---- training ---------------------------------------------------------------------------------------------


def test_train_steps_start_at_what_the_schedule_needs(cli, tmp_path):
    r = cli("train", "--steps", "29", "-o", tmp_path / "t.pt")
    assert r.exit_code == 2 and "'--steps': 29 is not in the range x>=30" in r.stderr
    assert "at least 30" in cli("train", "--help").stdout


@pytest.mark.parametrize("poison", ["validation loss", "weight"])
def test_a_model_that_diverged_by_its_last_step_is_not_returned_for_saving(monkeypatch, poison):
    """The per-step check sees the loss before the last update; the model after it can still be NaN (10 steps
    from scratch, as `train --steps 10` once saved). The last evaluation stands in for that here."""
    import taperfold.train
    from taperfold.models import preset_config
    from taperfold.train import TrainOptions, train

    def evaluate(model, tokens, opts, seq):
        if poison == "weight":
            with torch.no_grad():
                model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
            return 2.0
        return float("nan")

    monkeypatch.setattr(taperfold.train, "evaluate", evaluate)
    cfg = preset_config("tiny", arch="llama", taper="internal", n_layers=2, max_seq_len=32)
    with pytest.raises(TaperfoldError, match="diverged by its last step") as info:
        train(cfg, TrainOptions(steps=30, batch_size=2, eval_batches=1))
    assert ("model.layers.1.mlp.up_proj.weight" if poison == "weight" else "validation loss nan") in str(info.value)
    assert "nothing was saved" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
def test_train_lr_must_be_a_positive_finite_number(cli, tmp_path, value):
    r = cli("train", "--lr", value, "-o", tmp_path / "t.pt")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "'--lr'" in r.stderr
    assert not (tmp_path / "t.pt").exists()


# ---- flags and outputs ------------------------------------------------------------------------------------


def test_verify_refuses_a_nan_bound_and_writes_nothing(tiny_export, tmp_path, cli):
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    (export / "verify.json").unlink(missing_ok=True)
    for flag, value in (("--rtol", "nan"), ("--max-kl", "inf"), ("--min-top1", "nan"), ("--seed", "-1")):
        r = cli("verify", export, flag, value)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and f"'{flag}'" in r.stderr, r.stderr
    assert not (export / "verify.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_verify_on_cuda_without_a_gpu_is_one_line(tiny_export, cli):
    one_line(cli("verify", tiny_export, "--device", "cuda"), "--device cuda")


def test_bench_refuses_a_batch_no_graph_takes(tiny_export, cli):
    one_line(cli("bench", tiny_export, "--batch", str(10**12)), "--batch", "largest allowed, 4096")
    r = cli("bench", tiny_export, "--threads", str(10**12))
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "'--threads'" in r.stderr


def test_fold_output_with_a_trailing_slash_names_a_directory(tiny_export, tmp_path, cli):
    out = str(tmp_path / "new") + os.sep
    one_line(cli("fold", tiny_export / "unfolded.onnx", "-o", out), "is a directory; name a file")
    assert list(tmp_path.iterdir()) == []


def test_a_closed_pipe_ends_quietly(tiny_checkpoint):
    shell = f"{PY} -m taperfold inspect {tiny_checkpoint} | head -c1 > /dev/null; echo ${{PIPESTATUS[0]}}"
    r = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "141" and r.stderr == ""  # as `seq 1000000 | head -1`: SIGPIPE's status, no word


def test_a_gate_that_is_a_bool_is_refused(tiny_checkpoint, tmp_path, cli):
    obj = torch.load(tiny_checkpoint, weights_only=True)
    obj["gate"] = True  # a bool is an int in Python, and 0 <= True <= 1
    torch.save(obj, tmp_path / "g.pt")
    one_line(cli("inspect", tmp_path / "g.pt"), "key 'gate' must be a number in [0, 1], got True")


def test_export_needs_a_context_it_can_trace_and_a_short_one_exports(tmp_path, cli):
    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
    from taperfold.models import random_gate0_model

    for context in (1, 4):
        model = random_gate0_model("tiny", "gpt2", n_layers=1, d_model=32, n_heads=2, d_ff=64, max_seq_len=context)
        save_checkpoint(checkpoint_from_model(model, step=0), tmp_path / f"c{context}.pt")
    one_line(cli("export", tmp_path / "c1.pt", "-o", tmp_path / "e1"), "context is 1 token", "needs a context of 4")
    assert not (tmp_path / "e1").exists()
    assert cli("export", tmp_path / "c4.pt", "-o", tmp_path / "e4", "--kv-cache").exit_code == 0
    r = cli("verify", tmp_path / "e4", "--json")
    assert r.exit_code == 0, r.stderr
    decoders = [p for p in json.loads(r.stdout)["pairs"] if p["candidate"].endswith(".decoder")]
    assert decoders and all(p["status"] == "skipped" and "holds no prompt" in p["reason"] for p in decoders)


def test_a_kl_of_two_near_equal_rows_is_never_negative():
    from taperfold.compare import compare_logits

    rng = np.random.default_rng(0)
    reference = (rng.standard_normal((1, 256)) * 5).astype(np.float32)
    candidate = (reference.astype(np.float64) + rng.standard_normal(reference.shape) * 1e-8).astype(np.float32)
    assert compare_logits(reference, candidate, 1e-5).kl >= 0.0  # rounding made it -9e-17
    assert compare_logits(reference, reference, 1e-5).kl == 0.0


def test_fold_report_on_a_narrow_terminal_is_a_list_not_a_squeezed_table(tiny_export, tmp_path):
    env = {**os.environ, "COLUMNS": "80"}
    r = subprocess.run([PY, "-m", "taperfold", "fold", str(tiny_export / "unfolded.onnx"), "-o", str(tmp_path / "f.onnx"),
                        "--report", "-"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # stdout: the report
    lines = r.stderr.splitlines()
    assert all(len(line) <= 80 for line in lines)
    # one norm a line, whole: q, k and v read it, or their one fused projection (export fuses by default)
    fused = json.loads((tiny_export / "manifest.json").read_text())["export"]["fuse_projections"]
    assert f"  model.layers.0.input_layernorm: rms, folded, {1 if fused else 3} reader(s)" in lines


# ---- signals and what is left behind -----------------------------------------------------------------------


def test_a_signal_after_the_outputs_are_written_is_one_line_and_130(tiny_checkpoint, tmp_path):
    script = textwrap.dedent(f"""
        import atexit, os, signal, sys, time
        sys.argv = ["taperfold", "inspect", "--json", {str(tiny_checkpoint)!r}]
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))  # while the process ends
        from taperfold.cli import main
        main()
    """)
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 130 and r.stderr == "taperfold: interrupted (SIGINT)\n", r.stderr
    json.loads(r.stdout)  # what was printed before stays whole


def test_a_swallowed_interrupt_leaves_no_exception_ignored_noise(tiny_checkpoint, tiny_export, tmp_path):
    """Python prints an exception raised in a finalizer as "Exception ignored ..." and drops it; the recorded
    signal stops the export at its next stage, and the user sees one line, not that block too."""
    script = textwrap.dedent(f"""
        import signal, sys
        import onnx_ir
        import taperfold.export

        class Finalizer:
            def __del__(self):
                signal.raise_signal(signal.SIGINT)  # the handler raises here, inside __del__

        def export_to_ir(model, opts, decoder=False, **options):
            Finalizer()
            return onnx_ir.load({str(tiny_export / "unfolded.onnx")!r})

        taperfold.export.export_to_ir = export_to_ir
        sys.argv = ["taperfold", "export", {str(tiny_checkpoint)!r}, "-o", {str(tmp_path / "out")!r}, "--no-baseline"]
        from taperfold.cli import main
        main()
    """)
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 130 and r.stderr == "taperfold: interrupted (SIGINT)\n", r.stderr
    assert not (tmp_path / "out").exists()


def test_a_failed_demo_takes_the_folder_it_made_with_it(cli, tmp_path, monkeypatch):
    import taperfold.export

    def failing_export(*args, **kwargs):
        raise TaperfoldError("the export failed")

    monkeypatch.setattr(taperfold.export, "export_checkpoint", failing_export)
    r = cli("demo", "-o", tmp_path / "demo", "--steps", "30")
    assert r.exit_code == 2 and "the export failed" in r.stderr
    assert not (tmp_path / "demo").exists()


def test_a_test_run_leaves_the_temp_folder_as_it_found_it(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "test_probe.py").write_text(textwrap.dedent("""
        def test_writes(tmp_path, tmp_path_factory):
            (tmp_path / "x").write_bytes(b"0" * 1000)
            (tmp_path_factory.mktemp("shared") / "y").write_bytes(b"1")
    """))
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(ROOT / "tests")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    r = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "test_probe.py"],
                       cwd=probe, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(temp.iterdir()) == []


# ---- Hugging Face Hub ids -----------------------------------------------------------------------------------


def test_a_hub_model_id_resolves_through_the_local_cache_offline(tmp_path, monkeypatch, cli):
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_config

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants  # read once at import: what the environment says now
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)

    r = cli("inspect", "acme/tiny-llama", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["path"] == str(repo / "snapshots" / commit)
    r = cli("train", "--from", "acme/tiny-llama", "--steps", "30", "--batch-size", "2", "-o", tmp_path / "tapered",
            "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads((tmp_path / "tapered" / "config.json").read_text())["taperfold"]["gate"] == 0.0
    one_line(cli("inspect", "acme/not-cached"), "acme/not-cached: no such file or directory",
             "Hugging Face Hub cache")
