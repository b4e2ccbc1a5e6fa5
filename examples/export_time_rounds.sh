#!/bin/bash
# Export time of two checkouts of taperfold side by side, alternated in rounds (docs/benchmarks.md, "One trace per
# graph kind"): each checkpoint exported with growing and static decoders by each checkout in turn; prints the wall
# time and the export's own line (torch export, passes, writing).
#
#   examples/export_time_rounds.sh BEFORE_CHECKOUT AFTER_CHECKOUT ROUNDS CKPT [CKPT ...]
#
# A checkout is a directory holding the taperfold package (e.g. `git worktree add ../before 1e49eb9`); both run with
# this environment's python.
set -euo pipefail
before=$1 after=$2 rounds=$3
shift 3
python=${PYTHON:-python}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for round in $(seq "$rounds"); do
  for ckpt in "$@"; do
    for checkout in "$before" "$after"; do
      start=$(date +%s.%N)
      line=$(cd "$checkout" && PYTHONPATH="$checkout" "$python" -m taperfold export "$ckpt" -o "$scratch/out" \
        --kv-cache growing,static --overwrite 2>&1 | tail -1)
      end=$(date +%s.%N)
      printf 'round %s %s %s: wall %.1f s | %s\n' "$round" "$(basename "$ckpt")" "$checkout" "$(echo "$end - $start" | bc)" "$line"
    done
  done
done
