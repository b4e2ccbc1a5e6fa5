"""The runner interface: the base class's guards (load before run, feeds checked against the model's inputs,
one RunnerError naming the model) hold for every real runner (torch, ONNX Runtime) and for a fake one;
the engine registry opens each engine's runner. TensorRT's runner is tested in test_trt.py (GPU only)."""

import importlib
import re
import shutil
import time

import numpy as np
import pytest
import torch

from taperfold.engines import ENGINES, GRAPHS, MODELS, changed_options, check_options
from taperfold.errors import TaperfoldError
from taperfold.models import build_model, preset_config
from taperfold.runners.base import InputSpec, Runner, RunnerError
from taperfold.runners.ort import OrtRunner, open_session
from taperfold.runners.torch_runner import TorchRunner


class EchoRunner(Runner):
    """A fake engine: doubles `x` (float, rank 2) and counts what the base class let through."""

    name = "echo"

    def __init__(self):
        super().__init__("echo-model")
        self._inputs, self._outputs = ["x"], ["y"]
        self._specs = {"x": InputSpec(rank=2, floating=True)}
        self.calls = {"load": 0, "prepare": 0, "run": 0, "close": 0}

    def _load(self):
        self.calls["load"] += 1

    def _prepare(self, feeds):
        self.calls["prepare"] += 1
        return feeds["x"]

    def _run(self, prepared):
        self.calls["run"] += 1
        return {"y": prepared * 2}

    def _timed_run(self, prepared):
        t0 = time.perf_counter()
        out = self._run(prepared)
        return out, time.perf_counter() - t0

    def to_numpy(self, value):
        return np.asarray(value)

    def _close(self):
        self.calls["close"] += 1


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return build_model(preset_config("tiny", n_layers=1, max_seq_len=16)).eval()


@pytest.fixture(scope="module")
def onnx_path(tiny_export):
    return tiny_export / "model.onnx"


# One factory per runner: (runner, good feeds, the name its errors start with, a float and an int input)
def _echo(request):
    return EchoRunner(), {"x": np.ones((2, 3), np.float32)}, "echo-model", "x", None


def _torch(request):
    model = request.getfixturevalue("tiny_model")
    runner = TorchRunner(model, decoder=True, name="tiny (torch)")
    feeds = {"input_ids": np.zeros((1, 2), np.int64)}
    cfg = model.cfg
    feeds.update({n: np.zeros((1, cfg.kv_heads, 0, cfg.head_dim), np.float32) for n in runner.input_names[1:]})
    return runner, feeds, "tiny (torch)", runner.input_names[1], "input_ids"


def _ort(request):
    path = request.getfixturevalue("onnx_path")
    return OrtRunner(path, threads=1), {"input_ids": np.zeros((1, 4), np.int64)}, str(path), None, "input_ids"


RUNNERS = {"echo": _echo, "torch": _torch, "ort": _ort}


@pytest.fixture(params=list(RUNNERS))
def case(request):
    return RUNNERS[request.param](request)


def test_runs_and_times_after_load(case):
    runner, feeds, _, _, _ = case
    with runner:
        assert runner.is_loaded
        outputs, seconds = runner.timed_run(runner.prepare(feeds))
        assert set(outputs) == set(runner.output_names) and seconds >= 0
        host = runner.infer(feeds)
        assert all(isinstance(v, np.ndarray) for v in host.values())
    assert not runner.is_loaded


@pytest.mark.parametrize("call", ["prepare", "run", "timed_run"])
def test_use_before_load_is_one_error_naming_the_model(case, call):
    runner, feeds, model_name, _, _ = case
    with pytest.raises(RunnerError, match=rf"^{re.escape(model_name)}: .*\.{call}\(\) called before load\(\)$"):
        getattr(runner, call)(feeds)


def test_feed_names_are_checked(case):
    runner, feeds, model_name, _, _ = case
    with runner:
        with pytest.raises(RunnerError, match=rf"^{re.escape(model_name)}: feeds do not match .*unknown \['bogus'\]"):
            runner.prepare({"bogus": np.zeros((1, 1), np.int64)})
        extra = {**feeds, "bogus": np.zeros(1)}
        with pytest.raises(RunnerError, match=r"unknown \['bogus'\]"):
            runner.prepare(extra)


def test_feed_rank_and_type_are_checked(case):
    runner, feeds, model_name, float_input, int_input = case
    with runner:
        name = int_input or float_input
        wrong_rank = {**feeds, name: feeds[name][0]}
        with pytest.raises(RunnerError, match=rf"^{re.escape(model_name)}: input '{name}' needs rank"):
            runner.prepare(wrong_rank)
        if int_input:
            as_float = {**feeds, int_input: feeds[int_input].astype(np.float32)}
            with pytest.raises(RunnerError, match=rf"input '{int_input}' needs integer values, got float32"):
                runner.prepare(as_float)
        if float_input:
            as_int = {**feeds, float_input: feeds[float_input].astype(np.int64)}
            with pytest.raises(RunnerError, match=rf"input '{float_input}' needs floating-point values, got int64"):
                runner.prepare(as_int)


def test_guards_stop_bad_feeds_before_the_engine():
    runner = EchoRunner()
    with runner:
        with pytest.raises(RunnerError):
            runner.prepare({"x": np.ones(3, np.float32)})
        assert runner.calls["prepare"] == 0
        runner.prepare({"x": np.ones((1, 3), np.float32)})
        assert runner.calls["prepare"] == 1
    assert runner.calls == {"load": 1, "prepare": 1, "run": 0, "close": 1}
    runner.close()  # closing twice releases once
    assert runner.calls["close"] == 1


def test_a_runner_failure_reaches_the_user_as_one_line_and_exit_2(tiny_export, tmp_path, cli):
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    (export / "model.onnx").write_bytes(b"\x08\x07garbage" * 10)  # the folded graph, corrupt
    result = cli("bench", export, "--engine", "ort", "--variants", "baseline,folded", "--batch", "1", "--seq", "8",
                 "--iters", "1", "--warmup", "0", "--report", tmp_path / "bench.json")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert str(export / "model.onnx") in result.stderr and "not a readable ONNX model" in result.stderr
    assert not (tmp_path / "bench.json").exists()


def test_torch_runner_matches_the_model(tiny_model):
    ids = np.random.default_rng(0).integers(0, tiny_model.cfg.vocab_size, (2, 5))
    with TorchRunner(tiny_model, logits="all") as runner:
        logits = runner.infer({"input_ids": ids})["logits"]
    with torch.no_grad():
        expected = tiny_model(torch.from_numpy(ids), logits="all").numpy()
    np.testing.assert_array_equal(logits, expected)


def test_ort_session_is_built_apart_from_the_runner(onnx_path, tmp_path):
    session = open_session(onnx_path, optimization="disable", threads=1)
    assert [i.name for i in session.get_inputs()] == ["input_ids"]
    with pytest.raises(TaperfoldError, match="no such file"):
        open_session(tmp_path / "none.onnx")


# ---- the registry ----------------------------------------------------------------------------------------


def test_registry_describes_every_engine():
    assert set(ENGINES) >= {"torch", "ort", "trt"}
    for name, engine in ENGINES.items():
        assert engine.name == name and engine.runs in (MODELS, GRAPHS)
        assert engine.default_device in engine.devices
        module = importlib.import_module(engine.module)  # what the row promises, its runner module provides
        assert callable(module.open_runner) and callable(module.unavailable)
        assert callable(getattr(module, "files", None)) == (engine.runs == GRAPHS)
    assert ENGINES["trt"].default_device == "cuda" and not ENGINES["trt"].decodes


def test_registry_opens_runners_that_apply_their_options(tiny_model, onnx_path):
    import onnxruntime as ort

    torch_runner = ENGINES["torch"].runner(tiny_model, compile=True, compile_mode="max-autotune", name="m")
    assert torch_runner.execution == "compile:max-autotune" and torch_runner.device == "cpu"
    with ENGINES["ort"].runner(onnx_path, threads=1, optimization="basic") as ort_runner:
        options = ort_runner.session.get_session_options()
        assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        assert options.intra_op_num_threads == 1


def test_options_belong_to_their_engine():
    assert changed_options({"compile": False, "optimization": "all", "cuda_graph": True}) == {"cuda_graph": True}
    check_options(ENGINES["ort"], {"optimization": "basic"})
    with pytest.raises(TaperfoldError, match=r"^--compile applies to --engine torch only$"):
        check_options(ENGINES["ort"], {"compile": True})
    with pytest.raises(TaperfoldError, match=r"^--ort-optimization applies to --engine ort only$"):
        check_options(ENGINES["torch"], {"optimization": "basic"})
