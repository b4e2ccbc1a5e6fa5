"""Outputs inside a Hugging Face Hub cache are refused before any work, in one line, by every command and by the
library's save functions: a snapshot's files are links into blobs/, so a write there would change the cached model
(every revision sharing the blob). The cache here is laid out as huggingface_hub lays it out (blobs, snapshot links,
refs) under tmp_path, HF_HUB_CACHE pointing at it; a folder of the same shape anywhere else is a cache too. Inputs
are files that do not exist: the refusal must come before anything is read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import one_line

from taperfold.errors import TaperfoldError
from taperfold.fsutil import Output, check_outputs

BLOBS = {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "}


def cached_model(cache: Path, repo: str = "models--org--tiny") -> Path:
    """A model cached as huggingface_hub does it: the files in blobs/ (named by hash), the snapshot's files links to
    them; the snapshot folder returned."""
    folder = cache / repo
    snapshot = folder / "snapshots" / "0123abcd"
    (folder / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0123abcd")
    for i, (name, data) in enumerate(BLOBS.items()):
        (folder / "blobs" / f"blob{i}").write_bytes(data)
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
    return snapshot


def cache_contents(cache: Path) -> dict[str, bytes | str]:
    """Every file of the cache: a link's target, a file's bytes."""
    return {
        str(p.relative_to(cache)): os.readlink(p) if p.is_symlink() else p.read_bytes()
        for p in sorted(cache.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """(HF_HUB_CACHE's snapshot, a snapshot-shaped folder outside every configured cache)."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    caches = [cache, tmp_path / "copied-cache"]
    inside, elsewhere = cached_model(caches[0]), cached_model(caches[1], "models--other--model")
    before = [cache_contents(c) for c in caches]
    yield inside, elsewhere
    assert [cache_contents(c) for c in caches] == before  # every blob byte-identical, every link as it was


def _commands(tmp_path: Path, out: Path) -> dict[str, list]:
    missing = tmp_path / "missing"
    return {
        "train -o DIR": ["train", "--steps", "30", "-o", out],
        "train -o FILE": ["train", "--steps", "30", "-o", out / "model.safetensors"],
        "train --from": ["train", "--from", "org/tiny", "-o", out],
        "export": ["export", missing / "ckpt.pt", "-o", out, "--overwrite"],
        "fold -o": ["fold", missing / "in.onnx", "-o", out / "model.onnx"],
        "fold --report": ["fold", missing / "in.onnx", "-o", tmp_path / "o.onnx", "--report", out / "config.json"],
        "demo": ["demo", "-o", out],
    }


@pytest.mark.parametrize("where", ["HF_HUB_CACHE", "snapshot-shaped"])
@pytest.mark.parametrize("command", list(_commands(Path(), Path())))
def test_every_command_refuses_an_output_inside_a_hub_cache_before_any_work(hub, tmp_path, cli, command, where):
    snapshot = hub[0] if where == "HF_HUB_CACHE" else hub[1]
    args = _commands(tmp_path, snapshot)[command]
    expected = f"the Hugging Face Hub cache {tmp_path / 'hub'}" if where == "HF_HUB_CACHE" else "models--other--model"
    one_line(cli(*args), expected, "choose a path outside it")
    assert not (tmp_path / "o.onnx").exists()


def test_a_directory_output_holding_the_hub_cache_is_refused(hub, tmp_path, cli):
    one_line(cli("export", tmp_path / "missing.pt", "-o", tmp_path, "--overwrite"), "holds the Hugging Face Hub cache")


def test_the_cache_reached_through_a_link_is_refused(hub, tmp_path, cli):
    link = tmp_path / "my-model"
    link.symlink_to(hub[0], target_is_directory=True)
    one_line(cli("fold", tmp_path / "missing.onnx", "-o", link / "model.onnx"), "is inside the Hugging Face Hub cache")


@pytest.mark.parametrize("output", [dict(sidecars=(".data",)), dict(stream=True), dict(directory="taperfold export")])
def test_check_outputs_refuses_every_kind_of_output_in_a_hub_cache(hub, output):
    with pytest.raises(TaperfoldError, match=r"--csv .*: is inside the Hugging Face Hub cache"):
        check_outputs([Output(hub[0] / "out", "--csv", **output)])


def test_the_library_save_functions_refuse_a_hub_cache(hub):
    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
    from taperfold.models import random_gate0_model

    ckpt = checkpoint_from_model(random_gate0_model("tiny", n_layers=1), 0)
    for path in (hub[0] / "model.safetensors", hub[1]):
        with pytest.raises(TaperfoldError, match="Hugging Face Hub cache"):
            save_checkpoint(ckpt, path)
    transformers = pytest.importorskip("transformers")
    from taperfold.hf import save_hf_directory

    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(TaperfoldError, match="Hugging Face Hub cache"):
        save_hf_directory(transformers.LlamaForCausalLM(config), hub[0], plain=True)
