"""The runner interface: the base class's guards (load before run, feeds checked against the model's inputs,
one RunnerError naming the model) and its two timings (synced: one call waited for; pipelined: calls back to back,
one wait) hold for every real runner (torch, ONNX Runtime) and for fake ones; the engine registry opens each
engine's runner. TensorRT's runner is tested in test_trt.py (GPU only)."""

import importlib
import re
import shutil

import numpy as np
import pytest
import torch

from taperfold.artifacts import is_registered
from taperfold.engines import ENGINES, MODELS, changed_options, check_options
from taperfold.errors import TaperfoldError
from taperfold.exportdir import GROWING
from taperfold.models import build_model, preset_config
from taperfold.runners.base import InputSpec, Runner, RunnerError
from taperfold.runners.ort import OrtRunner, open_session, queued_run_options
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

    def _launcher(self, prepared):
        def call():
            self.calls["run"] += 1
            return {"y": prepared * 2}

        return call

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
    runner = TorchRunner(model, graph=GROWING, name="tiny (torch)")
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


@pytest.mark.parametrize("call", ["prepare", "run", "timed_run", "pipelined_run"])
def test_use_before_load_is_one_error_naming_the_model(case, call):
    runner, feeds, model_name, _, _ = case
    args = (feeds, 2) if call == "pipelined_run" else (feeds,)
    with pytest.raises(RunnerError, match=rf"^{re.escape(model_name)}: .*\.{call}\(\) called before load\(\)$"):
        getattr(runner, call)(*args)


def test_pipelined_runs_give_the_outputs_of_a_plain_run(case):
    runner, feeds, model_name, _, _ = case
    with runner:
        expected = runner.infer(feeds)
        outputs, per_call = runner.pipelined_run(runner.prepare(feeds), 3)
        assert per_call > 0 and set(outputs) == set(expected)
        for name, value in expected.items():
            np.testing.assert_array_equal(runner.to_numpy(outputs[name]), value)
        with pytest.raises(
            RunnerError,
            match=rf"^{re.escape(model_name)}: pipelined_run needs at least one call, "
            r"got 0$",
        ):
            runner.pipelined_run(runner.prepare(feeds), 0)


class RecordingClock:
    """Marks the log at start and end; 'measures' 1 ms per call launched in between plus 1 ms for the wait."""

    def __init__(self, log: list):
        self.log = log

    def start(self):
        self.log.append("start")
        self._mark = len(self.log)

    def stop(self, wait):
        launched = self.log[self._mark :].count("launch")
        self.log.append("end")
        wait()
        return (launched + 1) * 1e-3


class QueueRunner(EchoRunner):
    """An engine whose calls return before the work is done (as on a GPU): records, in order, the one-off set-up of
    an input, every launch, every wait and the clock's marks; launch number `fail_at` fails in the engine."""

    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.log, self.fail_at = [], fail_at

    def _launcher(self, prepared):
        self.log.append("setup")

        def launch():
            self.log.append("launch")
            if self.log.count("launch") == self.fail_at:
                raise self.error("the engine failed")
            return {"y": prepared * 2}

        return launch

    def _synchronize(self):
        self.log.append("synchronize")

    def _clock(self):
        return RecordingClock(self.log)


def test_pipelined_calls_are_queued_back_to_back_and_waited_for_once():
    runner = QueueRunner()
    with runner:
        prepared = runner.prepare({"x": np.ones((1, 2), np.float32)})
        _, per_call = runner.pipelined_run(prepared, 4)
        # set-up before the clock, queued work drained before it starts, then no wait until the last call is queued
        assert runner.log == ["setup", "synchronize", "start", *["launch"] * 4, "end", "synchronize"]
        assert per_call == pytest.approx(5e-3 / 4)
        runner.log.clear()
        _, seconds = runner.timed_run(prepared)
        assert runner.log == ["setup", "synchronize", "start", "launch", "end", "synchronize"]
        assert seconds == pytest.approx(2e-3)  # one call and its wait
        runner.log.clear()
        runner.run(prepared)
        assert runner.log == ["setup", "launch", "synchronize"]


@pytest.mark.parametrize(
    "fail_at, timing, what",
    [
        (1, lambda r, p: r.timed_run(p), "a synced call"),
        (2, lambda r, p: r.pipelined_run(p, 3), "a pipelined run of 3 calls"),  # the second of three queued calls
    ],
)
def test_an_engine_failure_while_timing_is_one_line_naming_the_model_and_the_timing(fail_at, timing, what):
    runner = QueueRunner(fail_at=fail_at)
    with runner, pytest.raises(RunnerError) as info:
        timing(runner, runner.prepare({"x": np.ones((1, 2), np.float32)}))
    assert str(info.value) == f"echo-model: the engine failed (during {what})"


class RecordingSession:
    """Stands in for an InferenceSession on CUDA (none here): logs each IOBinding run with its RunOptions."""

    def __init__(self, log: list):
        self.log = log

    def run_with_iobinding(self, binding, run_options=None):
        queued = (
            run_options is not None
            and run_options.get_run_config_entry("disable_synchronize_execution_providers") == "1"
        )
        self.log.append("run (queued)" if queued else "run (waits)")


class RecordingBinding:
    def __init__(self, log: list):
        self.log = log

    def synchronize_outputs(self):
        self.log.append("synchronize")

    def get_outputs(self):
        return ["device logits"]


def test_ort_on_cuda_queues_bound_runs_and_synchronizes_once(onnx_path):
    """The IOBinding path, checked on the CPU: runs are issued with RunOptions that skip ORT's wait at the end of a
    run, outputs stay bound, and the runner synchronizes once per measurement."""
    from taperfold.runners.ort import BoundInputs

    log = []
    with OrtRunner(onnx_path, threads=1) as runner:
        runner.device, runner.session = "cuda", RecordingSession(log)
        runner._queued, runner._sync_binding = queued_run_options(), RecordingBinding(log)
        prepared = BoundInputs(RecordingBinding(log), {})
        outputs, _ = runner.pipelined_run(prepared, 3)
        assert log == ["synchronize", *["run (queued)"] * 3, "synchronize"]
        assert outputs == {"logits": "device logits"}
        log.clear()
        runner.timed_run(prepared)
        assert log == ["synchronize", "run (queued)", "synchronize"]


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
    result = cli(
        "bench",
        export,
        "--engine",
        "ort",
        "--variants",
        "baseline,folded",
        "--batch",
        "1",
        "--seq",
        "8",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--report",
        tmp_path / "bench.json",
    )
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
        assert engine.name == name and (engine.runs == MODELS or is_registered(engine.runs))
        assert engine.default_device in engine.devices
        module = importlib.import_module(engine.module)  # what the row promises, its runner module provides
        assert callable(module.open_runner) and callable(module.unavailable)
    assert ENGINES["torch"].runs == MODELS and ENGINES["ort"].runs == "onnx" and ENGINES["trt"].runs == "tensorrt-plan"
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
