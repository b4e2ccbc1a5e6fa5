"""examples/gpu_table3.py without a GPU: the markdown and plot rendered from fixture reports (tests/data/gpu_table3:
invented numbers in the bench JSON format), the plan and its commands. The floors it prints are tested in
test_bench_floors.py."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "gpu_table3"


@pytest.fixture(scope="module")
def table3():
    spec = importlib.util.spec_from_file_location("gpu_table3", ROOT / "examples" / "gpu_table3.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_table3"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_table3"]


def test_markdown_from_fixture_reports(table3):
    reports = table3.load_reports(FIXTURE)
    assert len(reports) == 2  # runs.json is not a report
    md = table3.render_markdown(reports, table3.json.loads((FIXTURE / "runs.json").read_text()))
    assert "Measured on **NVIDIA H100 80GB HBM3**" in md and "H100 SXM5, 3.35 TB/s" in md
    # B1 T128 bf16: paper 48.7 (1.20x); floor 128 tokens / (77,479,936 B / 3.35 TB/s) = 5,534 k tok/s;
    # torch eager folded 26.0 k (26 / 24 = 1.083x), CUDA graph 210 k (1.050x); fastest / paper = 210 / 48.7
    assert "| 1 | 128 | 48.7 (1.20×) | 5,534 (memory) | 26.0 (1.083×) | 210.0 (1.050×) | 4.31× |" in md
    assert "| 4 | 512 | 615.9 (1.13×) | 13,873 (compute) |" in md
    assert "| B | prompt | floor | ORT CUDA | ORT CUDA graph |" in md  # decode: no paper column (bf16 prefill only)
    assert "**not met** (4.31–5.03×)" in md
    assert "folded within 1 % of nonorm on every engine: **met** (worst 0.990: ORT CUDA, fp16 decode B1 T128)" in md
    assert "Failed runs (their .log says why): ort-fp16-decode-eager-graph." in md
    assert "max 2.5 %" in md


def test_plot_and_render_write_files(table3, tmp_path):
    folder = shutil.copytree(FIXTURE, tmp_path / "gpu")
    table3.render(folder, folder / "t.md", folder / "t.png")
    assert (folder / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (folder / "t.md").read_text().startswith("Measured on")


def test_plan_covers_every_configuration(table3, tmp_path):
    names = [name for name, _ in table3.plan(tmp_path, iters=50, warmup=10, rounds=5)]
    assert names == [
        "torch-bf16-prefill-eager-graph",
        "torch-bf16-prefill-compile",
        "ort-bf16-prefill-eager-graph",
        "torch-bf16-decode-eager-graph",
        "torch-bf16-decode-compile",
        "torch-fp16-prefill-eager-graph",
        "torch-fp16-prefill-compile",
        "ort-fp16-prefill-eager-graph",
        "torch-fp16-decode-eager-graph",
        "torch-fp16-decode-compile",
        "ort-fp16-decode-eager-graph",
    ]
    argv = dict(table3.plan(tmp_path, 50, 10, 5))["torch-bf16-prefill-compile"]
    assert argv[1:3] == ["-m", "taperfold"] and "--compile-mode" in argv and "reduce-overhead" in argv
    assert argv[-2:] == ["--json", str(tmp_path / "torch-bf16-prefill-compile.json")]


def _parse_bench(argv):
    """A planned `taperfold bench ...` as taperfold takes it, without running it: click's parse (an unknown option or a
    value of the wrong type raises a click error), then the request's options (a variant, batch or sequence list it
    refuses, or more rounds than timed calls, raises TaperfoldError or ValueError)."""
    from taperfold.bench.request import BenchRequest
    from taperfold.cli import cli as taperfold_cli

    assert argv[3] == "bench", argv
    command = taperfold_cli.commands["bench"]
    with command.make_context("bench", list(argv[4:]), resilient_parsing=False) as ctx:
        params = ctx.params
    assert BenchRequest.from_cli(params).options().schedule.rounds >= 1
    return params


def test_every_planned_command_parses(table3, tmp_path):
    for name, argv in table3.plan(tmp_path, 50, 10, 5):
        params = _parse_bench(argv)
        assert params["device"] == "cuda" and params["json_path"] == str(tmp_path / f"{name}.json"), name


@pytest.mark.parametrize(
    "change, error",
    [
        (["--no-such-option"], "NoSuchOption"),
        (["--iters", "many"], "BadParameter"),
        (["--batch", "1,x"], "TaperfoldError"),
        (["--variants", "folded,nofold"], "TaperfoldError"),
        (["--iters", "2", "--rounds", "5"], "ValueError"),
    ],
)
def test_a_planned_command_taperfold_would_refuse_does_not_parse(table3, tmp_path, change, error):
    """What the two tests above rely on: _parse_bench raises for a command `taperfold bench` would refuse."""
    _, argv = table3.plan(tmp_path, 50, 10, 5)[0]
    with pytest.raises(Exception) as raised:  # the type is checked by name below
        _parse_bench([*argv, *change])
    assert type(raised.value).__name__ == error, raised.value


def test_every_device_step_parses_as_it_runs_on_the_gpu(table3, tmp_path):
    steps = table3.device_plan(tmp_path, cpu=False)
    assert [s.name for s in steps[:2]] == ["torch-bf16-decode-static-graph", "ort-decode-static-graph"]  # decode first
    for step in steps:
        params = _parse_bench(step.argv)
        assert params["device"] == "cuda" and params["json_path"] == str(tmp_path / f"{step.name}.json"), step.name
        assert params["cuda_graph"] or params["compile"], step.name  # every GPU row also times a graph or compile


def test_device_run_out_of_budget_skips_every_step_and_says_so(table3, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(table3, "write_model", lambda path, *a: ran.append(path))
    index = table3.device_run(tmp_path, budget_s=10, cpu=True, ort_parts=None)  # under MIN_RUN_S: nothing starts
    assert index and all(r.get("skipped", "").startswith(("budget", "export-")) for r in index.values()), index
    assert not list(tmp_path.glob("*.log"))
    assert (tmp_path / "device.json").is_file()


@pytest.mark.slow
def test_device_dry_run_on_the_cpu_writes_every_report(table3, tmp_path):
    """The device script end to end on the CPU (tiny preset): checkpoints, exports with the nonorm reference in every
    graph, every bench run exiting 0 and writing its JSON in the report format that render reads."""
    index = table3.device_run(tmp_path, budget_s=900, cpu=True, ort_parts=None)
    failed = {n: (tmp_path / f"{n}.log").read_text()[-300:] for n, r in index.items() if r.get("exit_code") != 0}
    assert not failed, failed
    steps = [s.name for s in table3.device_plan(tmp_path, cpu=True)]
    assert [r["_file"] for r in table3.load_reports(tmp_path)] == sorted(f"{n}.json" for n in steps)
    markdown = table3.render_markdown(table3.load_reports(tmp_path), index)
    assert "### decode, fp32" in markdown and "| 4 | 32 | – | " in markdown and "| fp32 | ORT CPU | 4 |" in markdown


@pytest.mark.slow
def test_add_nonorm_exports_the_reference_that_bench_runs(table3, tiny_export, tiny_checkpoint, tmp_path, cli):
    import json

    export = shutil.copytree(tiny_export, tmp_path / "export")
    table3.add_nonorm(export, tiny_checkpoint)
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["artifacts"]["nonorm"]["path"] == "nonorm.onnx"
    assert manifest["artifacts"]["nonorm.decoder"]["path"] == "nonorm.decoder.onnx"
    r = cli(
        "bench",
        export,
        "--engine",
        "ort",
        "--variants",
        "folded,nonorm",
        "--batch",
        "1",
        "--seq",
        "8",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--json",
        tmp_path / "b.json",
    )
    assert r.exit_code == 0, r.stderr
    assert [row["variant"] for row in json.loads((tmp_path / "b.json").read_text())["results"]] == ["folded", "nonorm"]


def test_a_failed_graph_run_is_rerun_eager_only_and_indexed(table3, tmp_path, monkeypatch):
    import json
    import subprocess
    import sys

    calls = []

    def fake_run(argv, stdout, stderr, env, timeout=None):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1 if "--cuda-graph" in argv else 0)

    monkeypatch.setattr(table3.subprocess, "run", fake_run)
    argv = [sys.executable, "-m", "taperfold", "bench", "DIR", "--cuda-graph", "--json", str(tmp_path / "x.json")]
    index = table3.run_benches(tmp_path, [("ort-bf16-prefill-eager-graph", argv)], env={})
    assert calls[1] == [a for a in argv[:-1] if a != "--cuda-graph"] + [
        str(tmp_path / "ort-bf16-prefill-eager-only.json")
    ]
    assert {n: r["exit_code"] for n, r in index.items()} == {
        "ort-bf16-prefill-eager-graph": 1,
        "ort-bf16-prefill-eager-only": 0,
    }
    assert json.loads((tmp_path / "runs.json").read_text()) == index
    assert (
        index["ort-bf16-prefill-eager-only"]["command"]
        == "taperfold bench DIR --json OUT/ort-bf16-prefill-eager-only.json"
    )
    assert str(tmp_path) not in json.dumps(index)  # a reader reruns it with their own OUT
