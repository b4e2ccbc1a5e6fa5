"""manifest.json through its typed API: artifacts as records of registered kinds (each kind's own keys read into its
details type), reports kept with the artifact they describe, the source, timings and note read as typed fields, the
schema checked on read (one line naming the file and the key, every path kept inside the directory, a newer format
refused), a manifest read and written back byte for byte, and manifests of format_version 1 (taperfold before
artifact kinds) read by upgrading them: a hand-trimmed one, and one the previous version of `taperfold export`
wrote."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from taperfold.artifacts import ONNX, TENSORRT_PLAN
from taperfold.artifacts.base import ArtifactRecord, UnknownDetails
from taperfold.artifacts.tensorrt_plan import Profile, TensorrtDetails
from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.exportdir import GROWING, PREFILL, STATIC
from taperfold.fsutil import sha256_file
from taperfold.manifest import FORMAT_VERSION, read_manifest
from taperfold.models import random_gate0_model
from taperfold.verify import verify_export

DATA = Path(__file__).parent / "data" / "manifests"
# A manifest as `taperfold export --kv-cache` wrote it at format_version 1 (keys trimmed to the required ones and
# the artifacts), with a TensorRT engine as `export --trt` recorded it then: twice, under engines and artifacts.engine
MANIFEST_V1 = {
    "format": "taperfold-export",
    "format_version": 1,
    "created": "2026-01-01T00:00:00+0000",
    "checkpoint": {"path": "/ckpt/tiny.pt", "sha256": "ab" * 32, "step": 40},
    "config": {"arch": "llama", "n_layers": 2, "max_seq_len": 64},
    "gate": 0.0,
    "exported_gate": 0.0,
    "forced_gate0": False,
    "export": {
        "logits": "last",
        "dtype": "fp16",
        "opset": 20,
        "kv_cache": True,
        "inputs": ["input_ids"],
        "outputs": ["logits"],
    },
    "artifacts": {
        **{
            key: {"path": name, "bytes": 4, "external_data": None, "external_data_bytes": 0}
            for key, name in (
                ("baseline", "baseline.onnx"),
                ("unfolded", "unfolded.onnx"),
                ("folded", "model.onnx"),
                ("folded.decoder", "model.decoder.onnx"),
            )
        },
        "engine": {
            "path": "model.plan",
            "bytes": 4,
            "external_data": None,
            "external_data_bytes": 0,
            "variant": "folded",
            "format": "tensorrt-plan",
        },
    },
    "fold_report": {"summary": {"folded": 4}, "norms": []},
    "decoder_fold_report": {"summary": {"folded": 4}, "norms": []},
    "engines": {
        "folded": {
            "path": "model.plan",
            "onnx": "model.onnx",
            "bytes": 4,
            "tensorrt": "10.13.3",
            "gpu": "Fake GPU",
            "profile": {"input": "input_ids", "batch": [1, 1, 8], "sequence": [1, 64, 64]},
            "dtype": "fp16",
        }
    },
}


@pytest.fixture
def v1_dir(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST_V1))
    for name in ("baseline.onnx", "unfolded.onnx", "model.onnx", "model.decoder.onnx", "model.plan"):
        (tmp_path / name).write_bytes(b"onnx")
    return tmp_path


def write(folder: Path, data: dict) -> None:
    (folder / "manifest.json").write_text(json.dumps(data))


# ---- format_version 1 ------------------------------------------------------------------------------------------


def test_a_version_1_manifest_reads_as_artifact_records(v1_dir):
    manifest = read_manifest(v1_dir)
    assert (manifest.dtype, manifest.logits, manifest.gate, manifest.forced_gate0) == ("fp16", "last", 0.0, False)
    assert manifest.checkpoint_sha256 == "ab" * 32 and str(manifest.checkpoint) == "/ckpt/tiny.pt"
    assert [(r.key, r.kind, r.variant, r.graph, r.precision) for r in manifest.records()] == [
        ("baseline", ONNX, "baseline", PREFILL, "fp16"),
        ("unfolded", ONNX, "unfolded", PREFILL, "fp16"),
        ("folded", ONNX, "folded", PREFILL, "fp16"),
        ("folded.decoder", ONNX, "folded", GROWING, "fp16"),
        ("folded.plan", TENSORRT_PLAN, "folded", PREFILL, "fp16"),  # recorded once now
    ]
    assert manifest.artifact("folded") == v1_dir / "model.onnx"
    assert manifest.artifact("unfused") == v1_dir / "unfolded.onnx"
    assert manifest.artifact("folded", GROWING) == v1_dir / "model.decoder.onnx"
    assert manifest.artifact("folded", kind=TENSORRT_PLAN) == v1_dir / "model.plan"
    plan = manifest.record("folded.plan")
    assert plan.built_from == "folded" and plan.details.tensorrt == "10.13.3" and plan.details.gpu == "Fake GPU"
    assert plan.details.profile == Profile((1, 1, 8), (1, 64, 64)) and plan.unmodeled == {}  # no `dtype` left over
    # the fold reports sit with the graphs they made
    assert manifest.report("folded", "fold") == MANIFEST_V1["fold_report"]
    assert manifest.report("folded.decoder", "fold") == MANIFEST_V1["decoder_fold_report"]
    assert manifest.record("folded").built_from == "unfolded"
    assert manifest.to_json()["export"]["kv_cache"] == [GROWING]  # true meant the growing decoder


def test_rewriting_a_version_1_manifest_writes_version_2_and_keeps_unmodelled_keys(v1_dir):
    data = {**MANIFEST_V1, "note": "kept", "source": {"format": "huggingface"}}
    write(v1_dir, data)
    read_manifest(v1_dir).write()
    written = json.loads((v1_dir / "manifest.json").read_text())
    assert written["format_version"] == FORMAT_VERSION == 2
    assert written["note"] == "kept" and written["source"] == {"format": "huggingface"}  # absent keys stay absent
    assert not {"fold_report", "decoder_fold_report", "engines"} & set(written)
    assert "engine" not in written["artifacts"] and written["artifacts"]["folded.plan"]["kind"] == TENSORRT_PLAN
    assert read_manifest(v1_dir).to_json() == written  # and reads back as itself


@pytest.fixture(scope="module")
def exported_twice(tmp_path_factory):
    """One tiny g = 0 model exported by this version (growing and static decoders, a static cache of 64), and the
    same files under the manifest the previous version of `taperfold export` wrote for those options
    (tests/data/manifests, its checkpoint and config pointed at this model)."""
    root = tmp_path_factory.mktemp("manifests")
    ckpt = save_checkpoint(checkpoint_from_model(random_gate0_model("tiny"), step=0), root / "tiny.pt")
    current = export_checkpoint(ckpt, root / "v2", ExportOptions(decoders=(GROWING, STATIC), max_cache=64)).out_dir
    old = root / "v1"
    shutil.copytree(current, old)
    data = json.loads((DATA / "v1-growing-static.json").read_text())
    data["checkpoint"].update(path=str(ckpt), sha256=sha256_file(ckpt))
    data["config"] = json.loads((current / "manifest.json").read_text())["config"]
    write(old, data)
    return current, old


def test_a_manifest_the_previous_version_wrote_reads_as_this_version_writes_it(exported_twice):
    current, old = (read_manifest(d) for d in exported_twice)

    def shape(record: ArtifactRecord) -> tuple:
        # the previous version traced the baseline graphs; this one makes them from the unfolded ones
        built_from = None if record.variant in ("baseline", "baseline-decomposed") else record.built_from
        return (
            record.key,
            record.kind,
            record.path,
            record.variant,
            record.graph,
            record.precision,
            built_from,
            sorted(record.details.to_json()),
            sorted(record.reports),
        )

    assert [shape(r) for r in old.records()] == [shape(r) for r in current.records()]
    assert old.record("baseline.static").built_from is None
    assert current.record("baseline.static").built_from == "unfolded.static"
    assert old.max_cache == current.max_cache == 64
    for key in ("folded", "folded.decoder", "folded.static"):
        assert old.report(key, "fold")["summary"]["folded"] == current.report(key, "fold")["summary"]["folded"] == 8


def test_a_manifest_read_and_written_back_is_the_same_bytes(exported_twice):
    current = exported_twice[0]
    before = (current / "manifest.json").read_bytes()
    manifest = read_manifest(current)
    assert manifest.source is None and manifest.note is None  # a taperfold checkpoint, tapered
    timings = manifest.timings
    assert list(timings.stages)[:3] == ["torch_export_s", "passes_s", "write_s"] and timings.write_s > 0
    assert timings.total_s is not None and timings.total_s >= timings.counted_s and timings.build_s == {}
    assert manifest.find("folded").details.opset == 23  # the table's opset for ONNX Runtime
    manifest.write()
    assert (current / "manifest.json").read_bytes() == before


def test_verify_runs_an_export_the_previous_version_wrote(exported_twice):
    _, old = exported_twice
    before = (old / "manifest.json").read_bytes()
    report = verify_export(old, threads=1)
    assert report.passed, report.failure_message()
    assert {p.candidate for p in report.pairs} >= {"folded", "folded.decoder", "folded.static", "baseline.static"}
    assert (old / "manifest.json").read_bytes() == before  # read, never rewritten


# ---- the schema ------------------------------------------------------------------------------------------------


def entry(**changes) -> dict:
    base = {
        "kind": ONNX,
        "path": "model.onnx",
        "variant": "folded",
        "graph": PREFILL,
        "precision": "fp32",
        "bytes": 4,
        "external_data": None,
        "external_data_bytes": 0,
        "built_from": None,
        "reports": {},
    }
    return {**base, **changes}


def manifest_v2(**artifacts) -> dict:
    data = {
        key: value for key, value in MANIFEST_V1.items() if key not in ("fold_report", "decoder_fold_report", "engines")
    }
    return {
        **data,
        "format_version": 2,
        "export": {**data["export"], "kv_cache": []},
        "artifacts": artifacts or {"folded": entry()},
    }


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {**manifest_v2(), "format_version": 3},
            "key 'format_version' is 3; written by a newer taperfold; this taperfold reads versions 1, 2",
        ),
        ({**manifest_v2(), "format_version": "2"}, "key 'format_version' is '2'"),
        ({**manifest_v2(), "gate": "0"}, "key 'gate': expected a number, got '0'"),
        ({**manifest_v2(), "forced_gate0": 0}, "key 'forced_gate0': expected true or false"),
        ({**manifest_v2(), "config": "llama"}, "key 'config': expected an object, got str"),
        ({**manifest_v2(), "checkpoint": {"path": 7, "sha256": "ab"}}, "key 'checkpoint.path': expected a path"),
        (
            {**manifest_v2(), "export": {"logits": "last", "dtype": "int8"}},
            "key 'export.dtype': expected fp32, fp16, bf16",
        ),
        (
            {**manifest_v2(), "export": {"logits": "last", "dtype": "fp32", "max_cache": 10**12}},
            "key 'export.max_cache': expected null or an integer",
        ),
        (
            {**manifest_v2(), "export": {"logits": "last", "dtype": "fp32", "max_cache": "abc"}},
            "key 'export.max_cache': expected null or an integer",
        ),
        (
            manifest_v2(folded=entry(path="../outside/model.onnx")),
            "key 'artifacts.folded.path': expected a file name inside the export directory",
        ),
        (manifest_v2(folded=entry(path="/elsewhere/model.onnx")), "key 'artifacts.folded.path': expected a file name"),
        (manifest_v2(folded=entry(external_data="../model.onnx.data")), "key 'artifacts.folded.external_data'"),
        (manifest_v2(folded=entry(graph="decoder")), "key 'artifacts.folded.graph': expected null or one of prefill"),
        (manifest_v2(folded=entry(variant="fast")), "key 'artifacts.folded.variant': expected null or a variant"),
        (manifest_v2(folded=entry(bytes=-1)), "key 'artifacts.folded.bytes': expected a byte count"),
        (manifest_v2(folded=entry(opset="23")), "key 'artifacts.folded.opset' must be null or an integer, got '23'"),
        (manifest_v2(folded=entry(norm_ops={"RMSNormalization": "9"})), "key 'artifacts.folded.norm_ops' must be an"),
        (manifest_v2(folded=entry(kind=TENSORRT_PLAN)), "missing key 'artifacts.folded.tensorrt'"),
        (manifest_v2(folded=entry(kind=TENSORRT_PLAN, tensorrt="10")), "missing key 'artifacts.folded.profile'"),
        (
            manifest_v2(folded=entry(kind=TENSORRT_PLAN, tensorrt="10", profile={"batch": [8, 1, 1], "sequence": [1]})),
            "key 'artifacts.folded.profile.batch': need 1 <= min <= opt <= max, got min 8",
        ),
        (
            manifest_v2(folded=entry(), g=entry(kind="genai", path="g/genai_config.json", decoder="../model.onnx")),
            "key 'artifacts.g.decoder' must be a file name in the folder, got '../model.onnx'",
        ),
        ({**manifest_v2(), "timings": []}, "key 'timings' must be an object, got a list"),
        ({**manifest_v2(), "timings": {"passes_s": "fast"}}, "key 'timings.passes_s' must be a number, got 'fast'"),
        ({**manifest_v2(), "timings": {"build_s": {"onnx": None}}}, "key 'timings.build_s' must be an object of"),
        ({**manifest_v2(), "note": 3}, "key 'note' must be null or a string, got 3"),
        ({**manifest_v2(), "source": {"family_traced": "yes"}}, "key 'source.family_traced' must be null, true or"),
        ({**manifest_v2(), "source": {"untapered": {"model.norm": 3}}}, "key 'source.untapered' must be an object of"),
        (manifest_v2(folded="model.onnx"), "key 'artifacts.folded': expected an object, got str"),
        (
            manifest_v2(model_card=entry(kind="model-card", variant=None, graph=None, path="card.json")),
            "lists no ONNX graph",
        ),
    ],
)
def test_a_manifest_that_breaks_the_schema_is_one_line_naming_the_key(tmp_path, data, message):
    if "model_card" in data["artifacts"]:
        data["artifacts"].pop("folded", None)
    write(tmp_path, data)
    with pytest.raises(TaperfoldError) as info:
        read_manifest(tmp_path)
    text = str(info.value)
    assert text.startswith(str(tmp_path / "manifest.json")) and message in text and "\n" not in text


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.pop("gate"), "missing key 'gate'"),
        (lambda m: m["artifacts"].pop("folded"), "missing key 'artifacts.folded.path'"),
        (lambda m: m.update(format="other"), "not a taperfold export manifest"),
        (lambda m: m["engines"]["folded"].update(path="../model.plan"), "key 'artifacts.folded.plan.path'"),
    ],
)
def test_a_bad_version_1_manifest_is_one_line(v1_dir, change, message):
    data = json.loads(json.dumps(MANIFEST_V1))
    change(data)
    write(v1_dir, data)
    with pytest.raises(TaperfoldError) as info:
        read_manifest(v1_dir)
    assert str(info.value).startswith(str(v1_dir / "manifest.json")) and message in str(info.value)


def test_an_artifact_of_a_kind_not_registered_here_is_kept_and_named_when_used(tmp_path):
    card = entry(kind="model-card", variant=None, graph=None, path="card.json", words=120)
    write(tmp_path, manifest_v2(folded=entry(), model_card=card))
    manifest = read_manifest(tmp_path)
    assert manifest.record("model_card").details == UnknownDetails({"words": 120})
    manifest.write()
    assert json.loads((tmp_path / "manifest.json").read_text())["artifacts"]["model_card"] == card


def test_keys_of_an_entry_or_the_source_its_type_does_not_model_are_written_back(tmp_path):
    graph = entry(opset=23, opset_source="table", norm_ops={}, projections=None, made_by="a newer taperfold")
    source = {"format": "huggingface", "family": "llama", "revision": "abc"}
    write(tmp_path, {**manifest_v2(folded=graph), "source": source})
    manifest = read_manifest(tmp_path)
    folded = manifest.record("folded")
    assert (folded.details.opset, folded.details.norm_ops) == (23, {})
    assert folded.unmodeled == {"made_by": "a newer taperfold"}
    assert manifest.source.is_huggingface and manifest.source.family == "llama"
    assert manifest.source.unmodeled == {"revision": "abc"}
    manifest.write()
    written = json.loads((tmp_path / "manifest.json").read_text())
    assert written["artifacts"]["folded"] == graph and written["source"] == source
    with pytest.raises(TaperfoldError, match=r"artifact kind 'model-card' is not registered here"):
        manifest.artifact("folded", kind="model-card")


def test_missing_artifacts_name_the_manifest_key_and_the_command(v1_dir):
    manifest = read_manifest(v1_dir)
    with pytest.raises(
        TaperfoldError,
        match=r"manifest\.json: missing key 'artifacts\.baseline\.decoder': "
        r"re-export with --kv-cache$",
    ):
        manifest.artifact("baseline", GROWING)
    with pytest.raises(
        TaperfoldError,
        match=r"missing key 'artifacts\.folded\.static': re-export with --kv-cache "
        r"static$",
    ):
        manifest.artifact("folded", STATIC)
    (v1_dir / "model.onnx").unlink()
    with pytest.raises(TaperfoldError, match=r"model\.onnx: missing \(manifest\.json lists it as artifacts\.folded\)$"):
        manifest.artifact("folded")


def test_add_artifact_checks_the_record_against_its_kind(v1_dir):
    manifest = read_manifest(v1_dir)
    record = ArtifactRecord(
        key="baseline.plan",
        kind=TENSORRT_PLAN,
        path="baseline.plan",
        variant="baseline",
        graph=PREFILL,
        precision="fp16",
        bytes=4,
        built_from="baseline",
        details=TensorrtDetails(tensorrt=10, profile=Profile((1, 1, 8), (1, 8, 64))),  # type: ignore[arg-type]
    )
    with pytest.raises(TaperfoldError, match=r"key 'artifacts\.baseline\.plan\.tensorrt' must be a string"):
        manifest.add_artifact(record)
    record.details = TensorrtDetails(tensorrt="10.13.3", profile=Profile((1, 1, 8), (1, 8, 64)))
    manifest.add_artifact(record)
    added = manifest.find("baseline", kind=TENSORRT_PLAN)
    assert added is not None and added.details == record.details and added is not record  # read back, a copy
