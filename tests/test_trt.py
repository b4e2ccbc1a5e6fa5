"""TensorRT path: one clear line (exit 2, nothing written) without TensorRT, the optimization profile's
checks, and build_engine's call sequence against fake `tensorrt` modules shaped like TensorRT 10 and 11
(the real one cannot be installed here). The GPU test runs only where tensorrt and a CUDA GPU exist."""

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HANG_S

from taperfold import trt_support
from taperfold.artifacts import tensorrt_plan as tftrt
from taperfold.checkpoint import Checkpoint, save_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.manifest import read_manifest
from taperfold.models import build_model, preset_config

has_tensorrt_and_gpu = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory):
    torch.manual_seed(0)
    cfg = preset_config("tiny", arch="llama", taper="internal", n_layers=2, max_seq_len=32)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for norm in model.tapered_norms().values():
            norm.weight_tilde.uniform_(0.5, 1.5)  # random gains: tools that drop Mul(x, ones) would hide bugs
            norm.c.uniform_(0.5, 1.5)
    model.set_gate(0.0)
    return save_checkpoint(Checkpoint(cfg, model.state_dict(), 0.0, 1, {}), tmp_path_factory.mktemp("ck") / "t.pt")


# ---- without TensorRT --------------------------------------------------------------------------------


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` raise ImportError


def test_export_trt_without_tensorrt_says_so_and_writes_nothing(tmp_path, ckpt_path):
    # a `tensorrt` package that fails to import stands in for a machine without TensorRT, even on one with it
    fake = tmp_path / "fake"
    (fake / "tensorrt").mkdir(parents=True)
    (fake / "tensorrt" / "__init__.py").write_text("raise ImportError('simulated: no TensorRT')\n")
    out = tmp_path / "out"
    env = {"PYTHONPATH": f"{fake}:{REPO}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "taperfold.cli", "export", str(ckpt_path), "--trt", "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=HANG_S,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"taperfold: error: {trt_support.NOT_INSTALLED}"]
    assert not out.exists() or not any(out.iterdir())


def test_runner_without_tensorrt_raises_the_same_line(no_tensorrt):
    from taperfold.runners.trt import TrtRunner

    with pytest.raises(TaperfoldError, match=r"^tensorrt is not installed: pip install 'taperfold\[trt\]'"):
        TrtRunner("model.plan")


def test_build_without_tensorrt_raises(no_tensorrt, export_dir):
    with pytest.raises(TaperfoldError, match="tensorrt is not installed"):
        build_engines(export_dir)


def test_tensorrt_without_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    monkeypatch.setattr(trt_support, "gpu", lambda: None)
    with pytest.raises(TaperfoldError, match=r"^no CUDA GPU found: TensorRT engines need an NVIDIA GPU$"):
        trt_support.require_tensorrt()


# ---- profile -----------------------------------------------------------------------------------------


def test_profile_defaults_and_flags():
    p = tftrt.make_profile(512)
    assert p.batch == (1, 1, 8) and p.sequence == (1, 128, 512)
    assert p.shapes() == ((1, 1), (1, 128), (8, 512))
    assert tftrt.make_profile(32).sequence == (1, 32, 32)  # opt never above max_seq_len
    q = tftrt.make_profile(512, batch="1/4/16", sequence="8,64,256")
    assert q.batch == (1, 4, 16) and q.sequence == (8, 64, 256)
    assert tftrt.Profile.from_dict(q.to_dict()) == q


@pytest.mark.parametrize(
    "batch, sequence, message",
    [
        ((4, 2, 8), None, r"^batch: need 1 <= min <= opt <= max, got min 4, opt 2, max 8$"),
        ((1, 9, 8), None, "batch: need 1 <= min <= opt <= max, got min 1, opt 9, max 8"),
        ((0, 1, 8), None, "batch: need 1 <= min"),
        ("1/8", None, r"batch: expected three integers min/opt/max, got '1/8'"),
        ("a/b/c", None, "batch: expected three integers"),
        (None, (1, 128, 1024), "sequence: max 1024 exceeds the model's max_seq_len 512"),
        (None, (1, 600, 600), "sequence: max 600 exceeds"),
    ],
)
def test_profile_errors(batch, sequence, message):
    with pytest.raises(TaperfoldError, match=message):
        tftrt.make_profile(512, batch=batch, sequence=sequence)


# ---- build_engine against fake TensorRT 10 and 11 -----------------------------------------------------


def fake_tensorrt(version, strongly_typed_flag=True, parse_ok=True, plan=b"PLAN", cache_ok=True):
    """A `tensorrt` module with just the calls build_engine makes, recording them in `mod.calls`."""
    mod = types.ModuleType("tensorrt")
    mod.__version__ = version
    calls = mod.calls = []

    class Flag:
        pass

    if strongly_typed_flag:
        Flag.STRONGLY_TYPED = 1  # nvinfer1::NetworkDefinitionCreationFlag::kSTRONGLY_TYPED
    mod.NetworkDefinitionCreationFlag = Flag

    class Logger:
        WARNING = "WARNING"

        def __init__(self, severity):
            calls.append(("Logger", severity))

    class ParserError:
        def desc(self):
            return "Unsupported\n operator RMSNormalization"

        def node(self):
            return 7

    class OnnxParser:
        num_errors = 0 if parse_ok else 2

        def __init__(self, network, logger):
            calls.append(("OnnxParser",))

        def parse_from_file(self, path):
            calls.append(("parse_from_file", Path(path).name))
            return parse_ok

        def get_error(self, i):
            return ParserError()

    class TimingCache:
        def __init__(self, blob):
            self.blob = blob

        def serialize(self):
            return b"CACHE"

    class Config:  # no set_flag: a call for FP16/BF16 builder flags (gone in TensorRT 11) would fail here
        def add_optimization_profile(self, profile):
            calls.append(("add_optimization_profile", profile.shapes))

        def create_timing_cache(self, blob):
            calls.append(("create_timing_cache", bytes(blob)))
            return TimingCache(bytes(blob))

        def set_timing_cache(self, cache, ignore_mismatch):
            calls.append(("set_timing_cache", cache.blob, ignore_mismatch))
            return cache_ok or cache.blob == b""

    class OptimizationProfile:
        def set_shape(self, name, lo, opt, hi):
            self.shapes = (name, lo, opt, hi)

    class Builder:
        def __init__(self, logger):
            calls.append(("Builder",))

        def create_network(self, flags):
            calls.append(("create_network", flags))
            return object()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return OptimizationProfile()

        def build_serialized_network(self, network, config):
            calls.append(("build_serialized_network",))
            return plan

    mod.Logger, mod.OnnxParser, mod.Builder = Logger, OnnxParser, Builder
    return mod


def _onnx_model():
    """A one-node ONNX model (x · w), its weight inline; the fake parsers below never read it."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [w],
    )
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 20)])


def build_engines(out_dir, variants=("folded",), profile=None, on_stage=lambda stage: None):
    """The engines of `variants` built into an export folder through its manifest, as docs/tensorrt.md prints it."""
    manifest = read_manifest(out_dir)
    manifest.build("tensorrt-plan", tftrt.TensorrtRequest(tuple(variants), profile), on_stage)
    return manifest


@pytest.fixture
def export_dir(tmp_path, monkeypatch):
    import onnx

    monkeypatch.setattr(trt_support, "gpu", lambda: {"gpu": "Fake GPU", "compute_capability": "9.0"})
    for name in ("model", "unfolded", "baseline"):
        onnx.save(_onnx_model(), tmp_path / f"{name}.onnx")
    manifest = {
        "format": "taperfold-export",
        "format_version": 1,
        "checkpoint": {"path": "x.pt", "sha256": "0"},
        "gate": 0.0,
        "forced_gate0": False,
        "config": {"max_seq_len": 64},
        "export": {"dtype": "fp16", "logits": "last"},
        "artifacts": {
            v: {"path": f"{f}.onnx", "bytes": 4, "external_data": None, "external_data_bytes": 0}
            for v, f in (("folded", "model"), ("unfolded", "unfolded"), ("baseline", "baseline"))
        },
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def use(monkeypatch, mod):
    monkeypatch.setitem(sys.modules, "tensorrt", mod)
    return mod


@pytest.mark.parametrize("version, flags", [("10.13.3.9", 1 << 1), ("11.0.0.1", 0)])
def test_build_call_sequence(monkeypatch, export_dir, version, flags):
    trt = use(monkeypatch, fake_tensorrt(version))
    manifest = build_engines(export_dir, on_stage=lambda s: None)
    names = [c[0] for c in trt.calls]
    assert names == [
        "Logger",
        "Builder",
        "create_network",
        "OnnxParser",
        "parse_from_file",
        "add_optimization_profile",
        "create_timing_cache",
        "set_timing_cache",
        "build_serialized_network",
    ]
    assert ("create_network", flags) in trt.calls  # TRT 10 opts in to strong typing; TRT 11 always is
    assert ("parse_from_file", "model.onnx") in trt.calls
    assert ("add_optimization_profile", ("input_ids", (1, 1), (1, 64), (8, 64))) in trt.calls
    assert (export_dir / "model.plan").read_bytes() == b"PLAN"
    assert (export_dir / "trt.timing-cache").read_bytes() == b"CACHE"
    engine = manifest.record("folded.plan")
    assert (engine.kind, engine.path, engine.built_from, engine.precision) == (
        "tensorrt-plan",
        "model.plan",
        "folded",
        "fp16",
    )
    assert engine.details.tensorrt == version and engine.details.gpu == "Fake GPU"
    assert engine.details.profile.to_dict() == {"input": "input_ids", "batch": [1, 1, 8], "sequence": [1, 64, 64]}
    written = json.loads((export_dir / "manifest.json").read_text())
    assert written == manifest.to_json() and written["format_version"] == 2  # a version-1 manifest, rewritten
    assert "engines" not in written and "engine" not in written["artifacts"]  # recorded once
    assert read_manifest(export_dir).artifact("folded", kind="tensorrt-plan") == export_dir / "model.plan"


def test_tensorrt_11_without_the_deprecated_flag(monkeypatch, export_dir):
    trt = use(monkeypatch, fake_tensorrt("11.4.1", strongly_typed_flag=False))
    build_engines(export_dir)
    assert ("create_network", 0) in trt.calls


def test_tensorrt_10_without_strong_typing_is_refused(monkeypatch, export_dir):
    use(monkeypatch, fake_tensorrt("10.0.0", strongly_typed_flag=False))
    with pytest.raises(TaperfoldError, match=r"TensorRT 10\.0\.0 is too old: taperfold needs TensorRT 10 or 11"):
        build_engines(export_dir)


def test_timing_cache_reused_and_mismatch_replaced(monkeypatch, export_dir):
    trt = use(monkeypatch, fake_tensorrt("10.13.3"))
    (export_dir / "trt.timing-cache").write_bytes(b"OLD")
    build_engines(export_dir)
    assert ("create_timing_cache", b"OLD") in trt.calls
    trt = use(monkeypatch, fake_tensorrt("10.13.3", cache_ok=False))  # e.g. a cache from another GPU
    build_engines(export_dir)
    assert [c for c in trt.calls if c[0] == "set_timing_cache"] == [
        ("set_timing_cache", b"CACHE", False),
        ("set_timing_cache", b"", False),
    ]


def test_parser_error_is_one_line_naming_the_file(monkeypatch, export_dir):
    use(monkeypatch, fake_tensorrt("10.13.3", parse_ok=False))
    with pytest.raises(TaperfoldError) as e:
        build_engines(export_dir)
    assert str(e.value) == (
        f"{export_dir / 'model.onnx'}: TensorRT cannot parse it: node 7: "
        "Unsupported operator RMSNormalization (and 1 more); TensorRT 10.13.3 is older than "
        "10.15, whose parser the --target trt graphs assume (docs/opsets.md): upgrade it, or "
        "export with --opset 20"
    )
    assert not (export_dir / "model.plan").exists()
    use(monkeypatch, fake_tensorrt("10.15.1", parse_ok=False))
    with pytest.raises(TaperfoldError, match=r"\(and 1 more\)$"):  # new enough: the parser's word alone
        build_engines(export_dir)


def test_external_data_outside_the_folder_is_refused_before_tensorrt_reads_it(monkeypatch, export_dir):
    import onnx

    model = _onnx_model()
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../secret.bin")
    onnx.save(model, export_dir / "model.onnx")
    trt = use(monkeypatch, fake_tensorrt("10.15.1"))
    with pytest.raises(TaperfoldError, match=r"model\.onnx.*outside"):
        build_engines(export_dir)
    assert not any(c[0] == "parse_from_file" for c in trt.calls) and not (export_dir / "model.plan").exists()


def test_failed_build_leaves_no_plan(monkeypatch, export_dir):
    use(monkeypatch, fake_tensorrt("11.0.0", plan=None))
    with pytest.raises(TaperfoldError, match=r"model\.onnx: TensorRT could not build an engine"):
        build_engines(export_dir)
    assert not (export_dir / "model.plan").exists()
    assert "folded.plan" not in json.loads((export_dir / "manifest.json").read_text())["artifacts"]


def test_bench_engines_share_the_profile_and_build_once(monkeypatch, export_dir):
    use(monkeypatch, fake_tensorrt("10.13.3"))
    build_engines(export_dir, profile=tftrt.make_profile(64, batch="1/2/4"))
    trt = use(monkeypatch, fake_tensorrt("10.13.3"))
    paths = tftrt.ensure_engines(read_manifest(export_dir), ["baseline", "unfolded", "folded"])
    assert paths == {
        v: export_dir / f"{stem}.plan"
        for v, stem in (("baseline", "baseline"), ("unfolded", "unfolded"), ("folded", "model"))
    }
    built = [c[1] for c in trt.calls if c[0] == "parse_from_file"]
    assert built == ["baseline.onnx", "unfolded.onnx"]  # folded was fresh
    artifacts = json.loads((export_dir / "manifest.json").read_text())["artifacts"]
    engines = {a["variant"]: a for a in artifacts.values() if a["kind"] == "tensorrt-plan"}
    assert {v: e["profile"]["batch"] for v, e in engines.items()} == {v: [1, 2, 4] for v in paths}
    trt = use(monkeypatch, fake_tensorrt("10.14.1"))  # another TensorRT: every engine is stale
    tftrt.ensure_engines(read_manifest(export_dir), ["folded"])
    assert [c[1] for c in trt.calls if c[0] == "parse_from_file"] == ["model.onnx"]


def test_unknown_variant_and_missing_engine(monkeypatch, export_dir):
    use(monkeypatch, fake_tensorrt("10.13.3"))
    with pytest.raises(TaperfoldError, match=r"no ONNX model for variant 'folded\.decoder'"):
        build_engines(export_dir, variants=("folded.decoder",))
    with pytest.raises(TaperfoldError, match=r"missing key 'artifacts\.baseline\.plan'"):
        read_manifest(export_dir).artifact("baseline", kind="tensorrt-plan")


# ---- on a GPU with TensorRT -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not has_tensorrt_and_gpu, reason="needs tensorrt and an NVIDIA GPU (not installable here)")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_engine_matches_onnxruntime(tmp_path, ckpt_path, cuda_graph):
    import onnxruntime as ort

    from taperfold.runners.trt import TrtRunner

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "taperfold.cli", "export", str(ckpt_path), "--trt", "-o", str(out), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["artifacts"]["folded.plan"]["path"] == "model.plan"
    ids = np.random.default_rng(0).integers(0, 256, size=(2, 16), dtype=np.int64)
    ref = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids}
    )[0]
    with TrtRunner(out / "model.plan", cuda_graph=cuda_graph) as runner:
        assert runner.input_names == ["input_ids"] and runner.output_names == ["logits"]
        got = runner.infer({"input_ids": ids})["logits"]
        prepared = runner.prepare({"input_ids": ids})
        outputs, seconds = runner.timed_run(prepared)
        assert seconds > 0 and np.array_equal(runner.to_numpy(outputs["logits"]), got)
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2)  # TF32 is on by default in TensorRT
