#!/usr/bin/env bash
# The GPU half of docs/opsets.md: run on a machine with an NVIDIA GPU, onnxruntime-gpu and a CUDA build of torch,
# from the repository root. Writes docs/opsets/gpu-*.json; then update the table in taperfold/opsets.py and the
# "H100" section of docs/opsets.md with what they say (ratios per graph: prefill and decode, opset 20 vs 23).
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr -cd 'A-Za-z0-9-')
for dtype in fp16 fp32; do
  "$python" examples/opset_table.py --preset paper-30m --device cuda --dtype "$dtype" \
      --batch 1,4 --seq 128,512 --prompt 128 --new-tokens 32 --warmup 10 --iters 50 --rounds 5 \
      --out "docs/opsets/gpu-${gpu}-${dtype}.json"
done
