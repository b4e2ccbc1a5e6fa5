#!/usr/bin/env bash
# Extra seeds for the three variants the paper's Table 2 compares (tiny llama):
#   bash examples/train_seeds.sh STEPS SEED... >> runs/variants.jsonl
set -euo pipefail
steps=$1; shift
mkdir -p runs
for seed in "$@"; do
  for variant in "none --no-aux" "internal --aux" "all --aux"; do
    set -- $variant
    out="runs/llama-$1$2-seed$seed.pt"
    [ -e "$out" ] && continue
    taperfold train --arch llama --preset tiny --taper "$1" "$2" --steps "$steps" --seed "$seed" -o "$out" --json \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); d["seed"]='"$seed"'; print(json.dumps(d))'
  done
done
