"""The extras install together: each install line docs/deployment.md prints resolves (pip's own resolver, a dry run
against the package index) to exactly one of the packages that write the `onnxruntime` module, and a CPU extra mixed
with a CUDA one resolves to two, which is why the guide keeps them apart. Skipped where the index cannot be reached."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_S, one_line, run_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# Distributions that install the `onnxruntime` Python module (onnxruntime-genai and -extensions install their own)
ORT_BUILDS = re.compile(r"onnxruntime(-gpu|-directml|-openvino|-qnn|-training)?\Z")


def documented_lines() -> list[str]:
    """The extras of every `pip install 'taperfold[...]'` line of docs/deployment.md."""
    return re.findall(r"pip install 'taperfold\[([^\]]+)\]'", (ROOT / "docs" / "deployment.md").read_text())


def resolved(extras: str, tmp_path: Path) -> list[str]:
    """The distributions pip would install for this checkout with `extras` into an empty environment (torch pinned
    to the CPU build, as scripts/setup-env.sh does: an unpinned torch would resolve to the CUDA wheels)."""
    report = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        "torch==2.13.0",
        f"{ROOT}[{extras}]",
    ]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.skip("pip's resolver did not answer: the package index is out of reach")
    if run.returncode != 0:
        if re.search(r"No matching distribution|Could not find a version|connection|resolve|network", run.stderr, re.I):
            pytest.skip(f"the package index cannot serve this install here: {run.stderr.strip().splitlines()[-1]}")
        pytest.fail(run.stderr)
    return [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]


def test_the_guide_prints_a_cpu_and_a_cuda_line():
    lines = documented_lines()
    assert len(lines) == 2 and "onnxruntime" in lines[0].split(",") and "onnxruntime-gpu" in lines[1].split(",")


@pytest.mark.parametrize("extras", documented_lines())
def test_each_documented_line_installs_one_onnxruntime(extras, tmp_path):
    names = resolved(extras, tmp_path)
    builds = [n for n in names if ORT_BUILDS.match(n)]
    assert len(builds) == 1, (extras, builds)
    assert "taperfold" in names and not any(n.startswith("nvidia-") for n in names if "gpu" not in extras)


def test_mixing_a_cpu_and_a_cuda_extra_installs_two(tmp_path):
    """What the check above guards against: genai's CUDA build pulls onnxruntime-gpu beside the CPU build."""
    builds = [n for n in resolved("onnxruntime,genai-cuda", tmp_path) if ORT_BUILDS.match(n)]
    assert sorted(builds) == ["onnxruntime", "onnxruntime-gpu"]


@pytest.mark.parametrize("command", [["verify"], ["bench", "--engine", "ort", "--batch", "1", "--seq", "8"]])
def test_without_onnxruntime_a_command_that_runs_a_graph_says_what_to_install(tiny_export, monkeypatch, command):
    """`pip install taperfold` alone has no ONNX Runtime (an extra chooses the build): one line naming both extras."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    result = run_cli(command[0], tiny_export, *command[1:])
    one_line(result, "onnxruntime is not installed", "taperfold[onnxruntime]", "taperfold[onnxruntime-gpu]")
