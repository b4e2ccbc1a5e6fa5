"""examples/ort_placement.py: reading ONNX Runtime's verbose placement log, and a real session on the CPU."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import onnx
import onnxruntime as ort
from conftest import HANG_S

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ort_placement", ROOT / "examples" / "ort_placement.py")
ort_placement = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ort_placement)

PREFIX = "2026-11-23 06:37:10.148 [V:onnxruntime:, session_state.cc:{line} VerifyEachNodeIsAssignedToAnEp]"


def verbose_log(placed: dict[str, list[tuple[str, str]]], all_on: str | None = None) -> str:
    """ONNX Runtime's "Node placements" section as its logger writes it (format of onnxruntime 1.31)."""
    lines = [f"{PREFIX.format(line=1578)} Node placements"]
    if all_on:
        lines.append(f"{PREFIX.format(line=1580)}  All nodes placed on [{all_on}]. Number of nodes: 7")
    for provider, nodes in placed.items():
        lines.append(f"{PREFIX.format(line=1584)}  Node(s) placed on [{provider}]. Number of nodes: {len(nodes)}")
        lines += [f"{PREFIX.format(line=1586)}   {op} ({name})" for op, name in nodes]
    lines.append("2026-11-23 06:37:10.149 [V:onnxruntime:, session.cc:12 Other] an unrelated verbose line")
    return "\n".join(lines) + "\n"


def test_placements_give_each_provider_its_count_and_its_nodes_in_order():
    placed = {
        "CPUExecutionProvider": [("Squeeze", "any name"), ("Add", "n/2 (x)"), ("Concat", "c")],
        "CUDAExecutionProvider": [("Shape", "s"), ("Gather", "g"), ("MatMul", "m")],
    }
    found = ort_placement.placements(verbose_log(placed))
    assert found == {provider: {"count": len(nodes), "nodes": nodes} for provider, nodes in placed.items()}


def test_a_single_provider_session_is_one_count_without_a_node_list():
    found = ort_placement.placements(verbose_log({}, all_on="CPUExecutionProvider"))
    assert found == {"CPUExecutionProvider": {"count": 7, "nodes": []}}


def test_a_real_cpu_session_places_every_node_of_its_graph_on_the_cpu(tiny_export, tmp_path):
    model = tiny_export / "model.onnx"
    options = ort.SessionOptions()  # the graph as the session runs it: after ONNX Runtime's own optimizations
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    nodes = len(onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node)
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ort_placement.py"), str(model), "--json"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert r.returncode == 0, r.stderr
    assert {provider: placed["count"] for provider, placed in json.loads(r.stdout).items()} == {
        "CPUExecutionProvider": nodes
    }
