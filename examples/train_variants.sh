#!/usr/bin/env bash
# Trains the paper's Table 1 variants on the tiny preset and prints one JSON line per run.
# Used for docs/training.md:  bash examples/train_variants.sh [STEPS] [ARCH...] >> runs/variants.jsonl
# A run whose checkpoint already exists is skipped.
set -euo pipefail
steps=${1:-600}; shift || true
archs=${*:-llama gpt2}
mkdir -p runs
for arch in $archs; do
  for variant in "none --no-aux" "internal --aux" "all --aux" "internal --no-aux" "all --no-aux"; do
    set -- $variant
    out="runs/$arch-$1$2.pt"
    [ -e "$out" ] && continue
    taperfold train --arch "$arch" --preset tiny --taper "$1" "$2" --steps "$steps" -o "$out" --json \
      | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))'
  done
done
