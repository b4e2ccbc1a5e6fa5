"""The command line as a whole: `--help` stays quick, importing none of the heavy libraries a command's work needs."""

import json
import os
import subprocess
import sys

import pytest
from conftest import HANG_S

from taperfold.cli import cli

HEAVY = ("torch", "onnx", "onnx_ir", "onnxruntime", "tensorrt", "openvino", "transformers")

# `taperfold ARGS` in a fresh interpreter, then the heavy modules it imported, as JSON on the last line
HELP_IMPORTS = f"""
import json, sys
from taperfold.cli import main
sys.argv = ["taperfold", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print(json.dumps([name for name in {HEAVY!r} if name in sys.modules]))
"""


@pytest.mark.parametrize("command", ["", *sorted(cli.commands)])
def test_help_imports_no_torch_onnx_or_onnxruntime(command):
    args = [command, "--help"] if command else ["--help"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the taperfold this test imports
    run = subprocess.run(
        [sys.executable, "-c", HELP_IMPORTS, *args], env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert run.returncode == 0, run.stderr
    assert "Usage: taperfold" in run.stdout
    assert json.loads(run.stdout.splitlines()[-1]) == []
