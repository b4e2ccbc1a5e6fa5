"""examples/ort_placement.py: reading ONNX Runtime's verbose placement log, and a real session on the CPU."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ort_placement", ROOT / "examples" / "ort_placement.py")
ort_placement = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ort_placement)

# lines as onnxruntime-gpu 1.31.1 wrote them on an H100 for a paper-30m opset-23 decoder (prefixes shortened)
H100_LOG = """\
2026-11-23 06:37:10.148 [V:onnxruntime:, session_state.cc:1578 VerifyEachNodeIsAssignedToAnEp] Node placements
2026-11-23 06:37:10.148 [V:onnxruntime:, session_state.cc:1584 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on [CPUExecutionProvider]. Number of nodes: 3
2026-11-23 06:37:10.148 [V:onnxruntime:, session_state.cc:1586 VerifyEachNodeIsAssignedToAnEp]   Squeeze (node_sym_size_int_68)
2026-11-23 06:37:10.148 [V:onnxruntime:, session_state.cc:1586 VerifyEachNodeIsAssignedToAnEp]   Add (node_add_4)
2026-11-23 06:37:10.148 [V:onnxruntime:, session_state.cc:1586 VerifyEachNodeIsAssignedToAnEp]   Concat (node_Concat_38)
2026-11-23 06:37:10.148 [V:onnxruntime:, session_state.cc:1584 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on [CUDAExecutionProvider]. Number of nodes: 2
2026-11-23 06:37:10.148 [V:onnxruntime:, session_state.cc:1586 VerifyEachNodeIsAssignedToAnEp]   Shape (node_Shape_1)
2026-11-23 06:37:10.148 [V:onnxruntime:, session_state.cc:1586 VerifyEachNodeIsAssignedToAnEp]   Gather (node_embedding)
2026-11-23 06:37:10.149 [V:onnxruntime:, session.cc:12 Other] an unrelated verbose line
"""


def test_placements_split_nodes_by_provider():
    found = ort_placement.placements(H100_LOG)
    assert found["CPUExecutionProvider"] == {"count": 3, "nodes": [("Squeeze", "node_sym_size_int_68"),
                                                                   ("Add", "node_add_4"),
                                                                   ("Concat", "node_Concat_38")]}
    assert found["CUDAExecutionProvider"]["nodes"] == [("Shape", "node_Shape_1"), ("Gather", "node_embedding")]


def test_a_real_cpu_session_places_every_node_on_the_cpu(tiny_export):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "ort_placement.py"), str(tiny_export / "model.onnx")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    count = int(r.stdout.split("CPUExecutionProvider: ")[1].split()[0])
    assert count > 50 and "CUDAExecutionProvider" not in r.stdout
