"""CUDA paths: torch on CUDA (timing, CUDA graphs, torch.compile), ONNX Runtime's CUDA execution provider (IOBinding,
CUDA graphs), `verify --device cuda`, and `bench --cuda-graph` end to end.

Tests marked `gpu` run on a machine with a CUDA device (see ../shared/gpu/README.md beside the repository:
`python -m pytest -m gpu`) and skip elsewhere, saying why. The rest check on the CPU what can be checked without a
GPU: option validation, how CUDA-graph rows are paired with eager rows and labelled (a fake runner), error lines,
`python -m taperfold`.
"""

import copy
import csv
import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import HANG_S

from taperfold.checkpoint import load_checkpoint
from taperfold.engines import CUDA_GRAPH, ENGINES, MODELS, Engine
from taperfold.errors import TaperfoldError
from taperfold.exportdir import GROWING
from taperfold.runners.base import InputSpec, Runner
from taperfold.runners.torch_runner import TorchRunner
from taperfold.variants import build_variants

ROOT = Path(__file__).resolve().parents[1]


def _ort_cuda() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device: torch sees none on this machine")
needs_ort_cuda = pytest.mark.skipif(
    not (HAS_CUDA and _ort_cuda()),
    reason="needs a CUDA device and onnxruntime's CUDA execution provider (onnxruntime-gpu; on the GPU machine "
    "install it from parts as ../shared/gpu/README.md, beside the repository, says)",
)


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint).build(gate=0.0)


@pytest.fixture(scope="module")
def tiny_source(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint)


# ---- what the CPU can check -------------------------------------------------------------------------------


def test_python_dash_m_taperfold_runs_the_cli():
    r = subprocess.run(
        [sys.executable, "-m", "taperfold", "bench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S
    )
    assert r.returncode == 0, r.stderr
    assert "--cuda-graph" in r.stdout and "--compile-mode" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "tiny", "--seq", "8", "--cuda-graph"], "--cuda-graph needs --device cuda"),
        (["--preset", "tiny", "--seq", "8", "--compile-mode", "reduce-overhead"], "--compile-mode needs --compile"),
        (
            ["--preset", "tiny", "--seq", "8", "--compile", "--cuda-graph", "--device", "cuda"],
            "--compile and --cuda-graph: choose one",
        ),
        (
            ["--preset", "tiny", "--seq", "8", "--engine", "ort", "--compile"],
            "--compile applies to --engine torch only",
        ),
        (
            ["--preset", "tiny", "--seq", "8", "--engine", "ort", "--compile-mode", "max-autotune"],
            "--compile-mode applies to --engine torch only",
        ),
    ],
)
def test_option_errors_are_one_line_and_exit_2(args, message, cli):
    r = cli("bench", *args)
    assert r.exit_code == 2, r.stderr
    assert r.stderr.startswith("taperfold: error: ") and message in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.skipif(HAS_CUDA, reason="checks the message of a machine without CUDA")
def test_cuda_request_without_cuda_is_one_line(cli):
    r = cli("bench", "--preset", "tiny", "--seq", "8", "--device", "cuda", "--cuda-graph", "--iters", "1")
    assert (r.exit_code, r.stderr) == (
        2,
        "taperfold: error: --device cuda: torch sees no CUDA device on this machine\n",
    )


def test_ort_cuda_graph_on_cpu_is_one_line(tiny_export, cli):
    r = cli("bench", tiny_export, "--engine", "ort", "--seq", "8", "--iters", "1", "--cuda-graph")
    assert (r.exit_code, r.stderr) == (2, "taperfold: error: --cuda-graph needs --device cuda\n")


def test_runners_refuse_cuda_graphs_off_cuda(tiny_model, tiny_export):
    from taperfold.runners.ort import OrtRunner

    with pytest.raises(TaperfoldError, match="--cuda-graph needs --device cuda"):
        OrtRunner(tiny_export / "model.onnx", device="cpu", cuda_graph=True)
    with pytest.raises(TaperfoldError, match="CUDA graphs need a CUDA device"):
        TorchRunner(tiny_model, device="cpu", cuda_graph=True)


def test_ort_cuda_graph_session_failure_is_one_line(tiny_export, monkeypatch):
    """ONNX Runtime refuses graph capture at session creation when a node would run on the CPU."""
    import onnxruntime as ort

    from taperfold.runners import ort as ort_runner

    seen = {}

    def refuse(path, sess_options=None, providers=None):
        seen["providers"] = providers
        raise RuntimeError(
            "This session cannot use the graph capture feature as requested by the user as all "
            "compute graph nodes have not been partitioned to the CUDA EP.\nStacktrace: ..."
        )

    monkeypatch.setattr(ort, "InferenceSession", refuse)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    path = tiny_export / "model.onnx"
    with pytest.raises(TaperfoldError) as info:
        ort_runner.open_session(path, device="cuda", cuda_graph=True)
    assert seen["providers"][0] == ("CUDAExecutionProvider", {"enable_cuda_graph": "1", "use_tf32": "0"})
    assert str(info.value) == (
        f"{path}: --cuda-graph: onnxruntime cannot capture this model as one CUDA graph "
        "(every node must run on the GPU; This session cannot use the graph capture feature "
        "as requested by the user as all compute graph nodes have not been partitioned to "
        "the CUDA EP.)"
    )
    decoder = tiny_export / "model.decoder.onnx"
    with pytest.raises(
        TaperfoldError,
        match=r"model\.decoder\.onnx: --cuda-graph: .*\(a KV-cached decoder: its past "
        r"grows every step.*docs/benchmarks\.md#ort-decode-and-cuda-graphs; "
        r"This session cannot use the graph capture",
    ):
        ort_runner.open_session(decoder, device="cuda", cuda_graph=True)


class CallClock:
    """`seconds` per call the runner launched between start and stop."""

    def __init__(self, runner, seconds: float):
        self.runner, self.seconds = runner, seconds

    def start(self):
        self.first = self.runner.launched

    def stop(self, wait):
        wait()
        return (self.runner.launched - self.first) * self.seconds


class FakeRunner(Runner):
    """Deterministic 'latencies' per variant and execution, and a logged capture per new shape in graph mode."""

    MS: ClassVar = {("baseline", False): 2.0, ("folded", False): 1.0, ("baseline", True): 1.0, ("folded", True): 0.8}

    def __init__(self, variant: str, cuda_graph: bool, vocab: int):
        super().__init__(f"fake {variant}", "cuda")
        self.variant, self.cuda_graph, self.vocab = variant, cuda_graph, vocab
        self._inputs, self._outputs = ["input_ids"], ["logits"]
        self._specs = {"input_ids": InputSpec(rank=2, floating=False)}
        self.setup_log: list = []
        self._captured = set()
        self.launched = 0

    @property
    def execution(self):
        return "cuda-graph" if self.cuda_graph else "eager"

    def _load(self):
        pass

    def _prepare(self, feeds):
        return feeds

    def _launcher(self, prepared):
        shape = prepared["input_ids"].shape
        if self.cuda_graph and shape not in self._captured:
            self._captured.add(shape)
            self.setup_log.append(("capture", shape, 0.5))

        def launch():
            self.launched += 1
            return {"logits": np.zeros((shape[0], self.vocab), np.float32)}

        return launch

    def _clock(self):
        return CallClock(self, self.MS[self.variant, self.cuda_graph] / 1e3)

    def to_numpy(self, value):
        return value


@pytest.fixture
def fake_engine(monkeypatch):
    def open_fake(model, *, device, threads, graph, logits, name, shapes=None, cuda_graph=False):
        return FakeRunner(name.split(" ")[0], cuda_graph, model.cfg.vocab_size)

    fake = Engine(
        "fake",
        "Fake",
        MODELS,
        default_device="cuda",
        devices=("cpu", "cuda"),
        decodes=False,
        options=(CUDA_GRAPH,),
        module=SimpleNamespace(open_runner=open_fake, unavailable=lambda device: None),
    )
    monkeypatch.setitem(ENGINES, "fake", fake)
    return fake


def test_cuda_graph_rows_sit_next_to_eager_rows_and_say_so(fake_engine, tmp_path, capsys):
    from taperfold.bench.measure import BenchOptions, load_bench, run_bench
    from taperfold.bench.report import CSV_COLUMNS, write_csv
    from taperfold.bench.source import resolve_source
    from taperfold.ui import print_bench, throughput_table

    opts = BenchOptions(
        engine="fake",
        variants=["baseline", "folded"],
        batches=[1],
        seqs=[8, 16],
        warmup=1,
        iters=2,
        rounds=1,
        device="cuda",
        engine_options={"cuda_graph": True},
    )
    with load_bench(resolve_source(None, None, "tiny"), opts) as loaded:
        assert list(loaded.runners) == ["baseline", "baseline (cuda graph)", "folded", "folded (cuda graph)"]
        report = run_bench(loaded)
    rows = {(r.label, r.seq): r for r in report.results}
    assert len(rows) == 8 and report.cuda_graph and report.executions == ["eager", "cuda-graph"]
    for (label, _seq), r in rows.items():
        graph = label.endswith("(cuda graph)")
        assert r.execution == ("cuda-graph" if graph else "eager")
        assert r.variant == label.split(" ")[0]
        # captured once per shape, before the timed calls, and reported apart from them
        assert r.setup_s == ({"capture": 0.5} if graph else {})
    # speedups against the baseline run the same way: eager 2.0 / 1.0 ms, graphs 1.0 / 0.8 ms
    assert rows["folded", 8].speedup_vs_baseline == pytest.approx(2.0)
    assert rows["folded (cuda graph)", 8].speedup_vs_baseline == pytest.approx(1.25)
    assert rows["baseline (cuda graph)", 16].speedup_vs_baseline == pytest.approx(1.0)
    assert report.setup_s == {"baseline (cuda graph)": {"capture": 1.0}, "folded (cuda graph)": {"capture": 1.0}}
    assert report.to_json()["setup_s"] == report.setup_s and report.to_json()["executions"] == report.executions

    write_csv(tmp_path / "b.csv", report)
    csv_rows = list(csv.DictReader((tmp_path / "b.csv").open()))
    assert list(csv_rows[0]) == CSV_COLUMNS
    assert [(r["variant"], r["execution"]) for r in csv_rows[:2]] == [("baseline", "eager"), ("baseline", "cuda-graph")]
    columns = [c.header for c in throughput_table(report, "prefill").columns]
    assert "folded (cuda graph)" in columns and "folded (cuda graph) ×" in columns and "folded ×" in columns
    print_bench(report)
    assert "rows marked (cuda graph) time replays of one captured CUDA graph per shape" in capsys.readouterr().out


# ---- on a CUDA device ---------------------------------------------------------------------------------------


def _ids(vocab, shape, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int64)


def _cpu_logits(model, ids):
    """The reference on the CPU, from a copy: a runner moves the model it runs to its device."""
    with torch.no_grad():
        return copy.deepcopy(model).cpu()(torch.from_numpy(ids)).numpy()


@pytest.mark.gpu
@needs_cuda
def test_torch_on_cuda_times_with_events_and_matches_the_cpu(tiny_source):
    model = build_variants(tiny_source, ["folded"], torch.float32)["folded"]
    ids = _ids(model.cfg.vocab_size, (2, 16))
    expected = _cpu_logits(model, ids)
    with TorchRunner(model, device="cuda") as runner:
        out, seconds = runner.timed_run(runner.prepare({"input_ids": ids}))
        assert out["logits"].is_cuda and 0 < seconds < 10
        np.testing.assert_allclose(runner.to_numpy(out["logits"]), expected, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_torch_cuda_graph_replays_new_inputs_of_a_shape(tiny_source):
    model = build_variants(tiny_source, ["baseline"], torch.float32)["baseline"]
    with TorchRunner(model, device="cuda", cuda_graph=True) as runner:
        assert runner.execution == "cuda-graph"
        for seed in (0, 1):  # the second set is copied into the static input and replayed
            ids = _ids(model.cfg.vocab_size, (1, 32), seed)
            out, _ = runner.timed_run(runner.prepare({"input_ids": ids}))
            np.testing.assert_allclose(runner.to_numpy(out["logits"]), _cpu_logits(model, ids), rtol=1e-3, atol=1e-4)
        assert [kind for kind, _, _ in runner.setup_log] == ["capture"]
        runner.timed_run(runner.prepare({"input_ids": _ids(model.cfg.vocab_size, (4, 16))}))
        assert len(runner.setup_log) == 2  # one graph per shape


@pytest.mark.gpu
@needs_cuda
def test_torch_cuda_graph_decoding_matches_eager(tiny_source):
    model = build_variants(tiny_source, ["folded"], torch.float32)["folded"]
    prompt = _ids(model.cfg.vocab_size, (2, 9))
    with TorchRunner(model, device="cuda", graph=GROWING) as eager:
        expected = eager.generate(prompt, steps=6, cfg=model.cfg, dtype="fp32")
    with TorchRunner(model, device="cuda", graph=GROWING, cuda_graph=True) as runner:
        first = runner.generate(prompt, steps=6, cfg=model.cfg, dtype="fp32")
        captures = len(runner.setup_log)
        again = runner.generate(prompt, steps=6, cfg=model.cfg, dtype="fp32")
        assert captures == 7 and len(runner.setup_log) == captures  # prompt + 6 steps, then replays only
    for gen in (first, again):
        np.testing.assert_array_equal(gen.tokens, expected.tokens)
        np.testing.assert_allclose(gen.last_logits, expected.last_logits, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_on_cuda_without_fallback(tiny_source, mode):
    from torch._dynamo.utils import counters

    models = build_variants(tiny_source, ["baseline", "folded"], torch.float32)
    before = counters["stats"]["unique_graphs"]
    for name, model in models.items():
        with TorchRunner(model, device="cuda", compile=True, compile_mode=mode, shapes=2, name=name) as runner:
            for shape in ((1, 16), (4, 32)):
                ids = _ids(model.cfg.vocab_size, shape)
                for _ in range(3):  # reduce-overhead records its CUDA graph on a later call
                    out, _ = runner.timed_run(runner.prepare({"input_ids": ids}))
                np.testing.assert_allclose(
                    runner.to_numpy(out["logits"]), _cpu_logits(model, ids), rtol=1e-3, atol=1e-3
                )
            assert [kind for kind, _, _ in runner.setup_log] == ["compile", "compile"]
    assert counters["stats"]["unique_graphs"] - before == 4


@pytest.mark.gpu
@needs_cuda
def test_compile_reduce_overhead_decoding_matches_eager(tiny_source):
    model = build_variants(tiny_source, ["folded"], torch.float32)["folded"]
    prompt = _ids(model.cfg.vocab_size, (2, 9))
    with TorchRunner(model, device="cuda", graph=GROWING) as eager:
        expected = eager.generate(prompt, steps=6, cfg=model.cfg, dtype="fp32")
    with TorchRunner(
        model, device="cuda", graph=GROWING, compile=True, compile_mode="reduce-overhead", shapes=7
    ) as runner:
        for _ in range(2):
            gen = runner.generate(prompt, steps=6, cfg=model.cfg, dtype="fp32")
            np.testing.assert_array_equal(gen.tokens, expected.tokens)
            np.testing.assert_allclose(gen.last_logits, expected.last_logits, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@needs_ort_cuda
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_ort_cuda_with_iobinding_matches_the_cpu(tiny_export, cuda_graph):
    from taperfold.runners.ort import OrtRunner

    ids = [_ids(256, (2, 16), seed) for seed in (0, 1)]
    with OrtRunner(tiny_export / "model.onnx") as cpu:
        expected = [cpu.infer({"input_ids": x})["logits"] for x in ids]
    with OrtRunner(tiny_export / "model.onnx", device="cuda", cuda_graph=cuda_graph) as runner:
        for x, want in zip(ids, expected):  # the second input of the same shape replays the captured graph
            out, seconds = runner.timed_run(runner.prepare({"input_ids": x}))
            np.testing.assert_allclose(runner.to_numpy(out["logits"]), want, rtol=1e-3, atol=1e-4)
            assert seconds > 0
        assert len(runner.setup_log) == (1 if cuda_graph else 0)


@pytest.mark.gpu
@needs_ort_cuda
def test_ort_refuses_cuda_graphs_of_a_kv_cached_decoder_in_one_line(tiny_export, cli):
    """ONNX Runtime 1.31 keeps the decoder's shape arithmetic on the CPU (seen on an H100), so its session refuses
    graph capture; the bench says why, in one line, and eager decoding on CUDA still runs."""
    from taperfold.runners.ort import OrtRunner

    with pytest.raises(TaperfoldError, match="a KV-cached decoder: its past grows every step"):
        OrtRunner(tiny_export / "model.decoder.onnx", device="cuda", cuda_graph=True).load()
    r = cli(
        "bench",
        tiny_export,
        "--engine",
        "ort",
        "--device",
        "cuda",
        "--mode",
        "decode",
        "--batch",
        "1",
        "--prompt",
        "4",
        "--new-tokens",
        "2",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--cuda-graph",
    )
    assert r.exit_code == 2 and "a KV-cached decoder" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli(
        "bench",
        tiny_export,
        "--engine",
        "ort",
        "--device",
        "cuda",
        "--mode",
        "decode",
        "--batch",
        "1",
        "--prompt",
        "4",
        "--new-tokens",
        "2",
        "--iters",
        "2",
        "--warmup",
        "1",
    )
    assert r.exit_code == 0, r.stderr


@pytest.mark.gpu
@needs_ort_cuda
def test_verify_on_cuda(tiny_export, tmp_path, cli):
    export = shutil.copytree(tiny_export, tmp_path / "export")
    r = cli("verify", export, "--device", "cuda", "--json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["device"] == "cuda" and report["passed"]


@pytest.mark.gpu
@needs_cuda
def test_bench_torch_cuda_graph_end_to_end(tmp_path, cli):
    out = tmp_path / "b.json"
    r = cli(
        "bench",
        "--preset",
        "tiny",
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        "--cuda-graph",
        "--batch",
        "1",
        "--seq",
        "16,32",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--json",
        out,
    )
    assert r.exit_code == 0, r.stderr
    report = json.loads(out.read_text())
    labels = {row["label"] for row in report["results"]}
    assert "folded (cuda graph)" in labels and "folded" in labels and report["device"] == "cuda"
    assert all(row["setup_s"].get("capture", 0) > 0 for row in report["results"] if row["execution"] == "cuda-graph")


@pytest.mark.gpu
@needs_ort_cuda
def test_bench_ort_cuda_graph_end_to_end(tiny_export, tmp_path, cli):
    export = shutil.copytree(tiny_export, tmp_path / "export")
    r = cli(
        "bench",
        export,
        "--engine",
        "ort",
        "--device",
        "cuda",
        "--cuda-graph",
        "--batch",
        "1,2",
        "--seq",
        "16",
        "--iters",
        "3",
        "--warmup",
        "1",
    )
    assert r.exit_code == 0, r.stderr
    report = json.loads((export / "bench.json").read_text())
    assert {row["execution"] for row in report["results"]} == {"eager", "cuda-graph"}


class _ReplayOnCpu:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay recomputes from the static inputs into the static
    outputs, as a replayed graph does, so the runner's bookkeeping (static buffers per shape, copies, the decode
    chain) can be checked without a GPU."""

    def __init__(self, runner, inputs, outputs):
        self.runner, self.inputs, self.outputs = runner, inputs, outputs

    def replay(self):
        fresh = self.runner._forward(self.inputs)
        with torch.inference_mode():
            for name, t in self.outputs.items():
                t.copy_(fresh[name])


def _graph_runner_on_cpu(model, **kwargs):
    from taperfold.runners import torch_runner

    runner = TorchRunner(model, **kwargs)
    runner.cuda_graph = True  # the constructor refuses it off CUDA; the capture below needs no CUDA

    def capture(prepared):
        outputs = runner._forward(prepared)
        return torch_runner._Graph(_ReplayOnCpu(runner, dict(prepared), outputs), dict(prepared), outputs)

    runner._capture = capture
    return runner


def test_graph_bookkeeping_prefill_copies_new_inputs_into_the_static_ones(tiny_source):
    model = build_variants(tiny_source, ["folded"], torch.float32)["folded"]
    with _graph_runner_on_cpu(model) as runner:
        assert runner.execution == "cuda-graph"
        statics = []
        for seed in (0, 1, 2):
            ids = _ids(model.cfg.vocab_size, (2, 12), seed)
            prepared = runner.prepare({"input_ids": ids})
            out, _ = runner.timed_run(prepared)
            statics.append(prepared["input_ids"])
            np.testing.assert_allclose(out["logits"].numpy(), _cpu_logits(model, ids), rtol=1e-5, atol=1e-6)
        assert statics[1] is statics[0] and statics[2] is statics[0]  # one static input buffer for the shape
        assert [kind for kind, _, _ in runner.setup_log] == ["capture"]


def test_graph_bookkeeping_decode_chains_steps_without_copies(tiny_source):
    model = build_variants(tiny_source, ["baseline"], torch.float32)["baseline"]
    prompt = _ids(model.cfg.vocab_size, (2, 7))
    with TorchRunner(model, graph=GROWING) as eager:
        expected = eager.generate(prompt, steps=4, cfg=model.cfg, dtype="fp32")
    with _graph_runner_on_cpu(model, graph=GROWING) as runner:
        for _ in range(2):
            gen = runner.generate(prompt, steps=4, cfg=model.cfg, dtype="fp32")
            np.testing.assert_array_equal(gen.tokens, expected.tokens)
            np.testing.assert_allclose(gen.last_logits, expected.last_logits, rtol=1e-5, atol=1e-6)
        assert len(runner.setup_log) == 5  # prompt + 4 step shapes, captured in the first generation only
        graphs = list(runner._graphs.values())
        for before, after in itertools.pairwise(graphs):  # each step reads the previous step's presents in place
            assert all(
                after.inputs[f"past_key_values.{i}.key"] is before.outputs[f"present.{i}.key"]
                for i in range(model.cfg.n_layers)
            )


def _ort_slots_on_cpu(path):
    from taperfold.runners.ort import OrtRunner

    runner = OrtRunner(path, device="cpu", threads=1)
    load = runner._load

    def load_on_cpu():  # a plain CPU session (no enable_cuda_graph), then slots kept on the CPU
        load()
        runner.cuda_graph, runner._slot_device = True, "cpu"  # the CPU EP ignores gpu_graph_id

    runner._load = load_on_cpu
    return runner


def test_ort_slot_bookkeeping_prefill(tiny_export):
    from taperfold.runners.ort import GraphSlot, OrtRunner

    ids = [_ids(256, (2, 10), seed) for seed in (0, 1, 2)]
    with OrtRunner(tiny_export / "model.onnx", threads=1) as plain:
        expected = [plain.infer({"input_ids": x})["logits"] for x in ids]
    with _ort_slots_on_cpu(tiny_export / "model.onnx") as runner:
        slots = []
        for x, want in zip(ids, expected):
            prepared = runner.prepare({"input_ids": x})
            out, _ = runner.timed_run(prepared)
            np.testing.assert_allclose(runner.to_numpy(out["logits"]), want, rtol=1e-5, atol=1e-6)
            slots.append(prepared)
        assert isinstance(slots[1], GraphSlot) and slots[2] is slots[1]  # one slot per shape, new values written in
        assert [kind for kind, _, _ in runner.setup_log] == ["capture"]
        assert slots[1].run_options.get_run_config_entry("gpu_graph_id") == "1"


def test_ort_slot_bookkeeping_decode_chains_steps(tiny_export):
    from taperfold.models import ModelConfig
    from taperfold.runners.ort import OrtRunner

    cfg = ModelConfig.from_dict(json.loads((tiny_export / "manifest.json").read_text())["config"])
    prompt = _ids(cfg.vocab_size, (2, 7))
    path = tiny_export / "model.decoder.onnx"
    with OrtRunner(path, threads=1) as plain:
        expected = plain.generate(prompt, steps=4, cfg=cfg, dtype="fp32")
    with _ort_slots_on_cpu(path) as runner:
        for _ in range(2):
            gen = runner.generate(prompt, steps=4, cfg=cfg, dtype="fp32")
            np.testing.assert_array_equal(gen.tokens, expected.tokens)
            np.testing.assert_allclose(gen.last_logits, expected.last_logits, rtol=1e-5, atol=1e-6)
        assert len(runner.setup_log) == 5  # the prompt and 4 step shapes, each with its own graph id
        slots = list(runner._slots.values())
        assert [s.run_options.get_run_config_entry("gpu_graph_id") for s in slots] == ["1", "2", "3", "4", "5"]
        for before, after in itertools.pairwise(slots):  # each step's cache inputs are the previous step's outputs
            assert after.inputs["past_key_values.0.key"] is before.outputs["present.0.key"]
