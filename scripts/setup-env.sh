#!/usr/bin/env bash
# Creates .venv once and installs taperfold into it with the local CPU build of torch.
# Sourced by scripts/demo and scripts/test; re-runs the install only when pyproject.toml or this script changes.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
stamp="$venv/.taperfold-installed"
want=$(cat "$root/pyproject.toml" "$root/scripts/setup-env.sh" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "setting up $venv (first run only) ..." >&2
  "$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" >&2 || true
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    # Pin the CPU build first: an unpinned torch would pull several GB of CUDA wheels.
    "$venv/bin/python" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" >&2 || true
    "$venv/bin/python" -c "import torch" 2>/dev/null || { echo "torch install failed" >&2; exit 1; }
  fi
  # The CPU build of ONNX Runtime: a .venv made before taperfold took it from an extra has onnxruntime-gpu, which
  # writes the same module, so that goes first.
  if "$venv/bin/python" -m pip show -q onnxruntime-gpu >/dev/null 2>&1; then
    "$venv/bin/python" -m pip uninstall -q -y onnxruntime-gpu onnxruntime >&2  # both: they share files
  fi
  # PYTHONWARNINGS quiets setuptools' notices about editable installs; errors still show.
  PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install -q -e "$root[onnxruntime,genai,openvino,dev,hf]" 2>&1 | grep -v "is ignored" >&2 || true
  "$venv/bin/python" -c "import taperfold, onnx, onnxruntime, onnx_ir, onnxruntime_genai, openvino" || { echo "install failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
