"""The export directory's contract: variant names and aliases, file names, and the typed manifest reading a
format_version 1 manifest.json as export wrote it, with one-line errors naming manifest.json and the key."""

import json

import pytest

from taperfold.errors import TaperfoldError
from taperfold.exportdir import (artifact_key, canonical_variant, canonical_variants, decoder_io_names, onnx_file,
                                 read_manifest)

# A manifest as `taperfold export --kv-cache` wrote it before exportdir.py existed (keys trimmed to the required
# ones and the artifacts).
MANIFEST_V1 = {
    "format": "taperfold-export", "format_version": 1, "created": "2026-01-01T00:00:00+0000",
    "checkpoint": {"path": "/ckpt/tiny.pt", "sha256": "ab" * 32, "step": 40},
    "config": {"arch": "llama", "n_layers": 2}, "gate": 0.0, "exported_gate": 0.0, "forced_gate0": False,
    "export": {"logits": "last", "dtype": "fp16", "opset": 20, "kv_cache": True, "inputs": ["input_ids"],
               "outputs": ["logits"]},
    "artifacts": {key: {"path": name, "bytes": 1, "external_data": None, "external_data_bytes": 0}
                  for key, name in (("baseline", "baseline.onnx"), ("unfolded", "unfolded.onnx"),
                                    ("folded", "model.onnx"), ("folded.decoder", "model.decoder.onnx"))},
}


@pytest.fixture
def export_dir(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST_V1))
    for entry in MANIFEST_V1["artifacts"].values():
        (tmp_path / entry["path"]).write_bytes(b"onnx")
    return tmp_path


def test_variant_names_and_files():
    assert canonical_variant("unfused") == "unfolded" and canonical_variant("folded") == "folded"
    assert canonical_variants(["unfused", "folded", "unfolded"]) == ["unfolded", "folded"]
    with pytest.raises(TaperfoldError, match=r"^unknown \['fast'\]; choose from baseline, unfolded, folded"):
        canonical_variants(["baseline", "fast"])
    assert [onnx_file(v) for v in ("baseline", "unfused", "folded")] == ["baseline.onnx", "unfolded.onnx", "model.onnx"]
    assert onnx_file("folded", decoder=True) == "model.decoder.onnx"
    assert artifact_key("unfused", decoder=True) == "unfolded.decoder"
    assert decoder_io_names(1) == (["input_ids", "past_key_values.0.key", "past_key_values.0.value"],
                                   ["logits", "present.0.key", "present.0.value"])


def test_reads_a_format_version_1_manifest(export_dir):
    manifest = read_manifest(export_dir)
    assert (manifest.dtype, manifest.logits, manifest.gate, manifest.forced_gate0) == ("fp16", "last", 0.0, False)
    assert manifest.checkpoint_sha256 == "ab" * 32 and str(manifest.checkpoint) == "/ckpt/tiny.pt"
    assert manifest.artifact("folded") == export_dir / "model.onnx"
    assert manifest.artifact("unfused") == export_dir / "unfolded.onnx"
    assert manifest.artifact("folded", decoder=True) == export_dir / "model.decoder.onnx"
    assert manifest.engines == {}
    manifest.data["note"] = "kept"
    manifest.write()  # keys the class does not model survive a rewrite
    assert json.loads((export_dir / "manifest.json").read_text()) == {**MANIFEST_V1, "note": "kept"}


def test_artifact_errors_name_the_manifest_and_the_key(export_dir):
    manifest = read_manifest(export_dir)
    with pytest.raises(TaperfoldError, match=r"manifest\.json: missing key 'artifacts\.baseline\.decoder\.path': "
                                             r"re-export with --kv-cache$"):
        manifest.artifact("baseline", decoder=True)
    (export_dir / "model.onnx").unlink()
    with pytest.raises(TaperfoldError, match=r"model\.onnx: missing \(manifest\.json lists it as artifacts\.folded\)$"):
        manifest.artifact("folded")
    with pytest.raises(TaperfoldError, match=r"no TensorRT engine for 'folded'"):
        manifest.engine_plan("folded")


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("gate"), "missing key 'gate'"),
    (lambda m: m["artifacts"].pop("folded"), "missing key 'artifacts.folded.path'"),
    (lambda m: m["export"].update(dtype="int8"), "key 'export.dtype' must be fp32, fp16 or bf16, got 'int8'"),
    (lambda m: m.update(format="other"), "not a taperfold export manifest"),
])
def test_bad_manifest_is_one_line(export_dir, change, message):
    data = json.loads(json.dumps(MANIFEST_V1))
    change(data)
    (export_dir / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(TaperfoldError) as info:
        read_manifest(export_dir)
    assert str(info.value).startswith(str(export_dir / "manifest.json")) and message in str(info.value)
    assert "\n" not in str(info.value)
