"""Shared fixtures and helpers."""

import contextlib
import io
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

TERMINAL_SIZE = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller: each worker gets the terminal size this process has (none when piped), which
    the CLI's tables follow; xdist's workers would otherwise see COLUMNS=80."""
    node.workerinput["terminal_size"] = {name: os.environ.get(name) for name in TERMINAL_SIZE}


def pytest_configure(config):
    """Every temporary file of the run under one folder that goes when the run ends: pytest's tmp_path folders
    (kept by default: GBs of exports per run), torch.compile's cache, and what the processes tests start write to
    their temporary folder (TMPDIR: vLLM's engine leaves a ZMQ socket and a vllm_dist_ file there per start)."""
    for name, value in getattr(config, "workerinput", {}).get("terminal_size", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if config.option.basetemp is None:
        config._taperfold_temp = tempfile.mkdtemp(prefix="taperfold-tests-")
        # pytest empties the base folder it is given on first use: the children's folder is beside it, not in it
        config.option.basetemp = os.path.join(config._taperfold_temp, "pytest")
        children = os.path.join(config._taperfold_temp, "tmp")
        os.mkdir(children)
        os.environ["TMPDIR"] = children  # xdist's workers and every child inherit it
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(config.option.basetemp, "torchinductor"))


def pytest_unconfigure(config):
    temp = getattr(config, "_taperfold_temp", None)
    if temp is not None:
        shutil.rmtree(temp, ignore_errors=True)


HANG_S = 3600
"""The limit on a child process a test starts (subprocess timeout=HANG_S): a guard against a hang, never a speed
check. The children here take seconds to a few minutes on a quiet 2-core machine; on a loaded one the suite ran 4x
slower, and one 300-step training more than 30x."""


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


def run_cli(*args) -> CliResult:
    """Run `taperfold ARGS` in this process through `taperfold.cli.main` (exit codes and error lines
    exactly as a user sees them), much faster than a subprocess that imports torch again."""
    from taperfold.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    # main() keeps its signal handling to the very end of the process; this process goes on
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ)}
    unraisable = sys.unraisablehook
    code = 0
    sys.argv = ["taperfold", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        sys.unraisablehook = unraisable
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return CliResult(code, out.getvalue(), err.getvalue())


def one_line(result: CliResult, *needles) -> None:
    """A refusal as the user sees it: exit 2, exactly one stderr line `taperfold: error: ...` holding each needle."""
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("taperfold: error: "), result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def is_running(pid: int) -> bool:
    """Whether process `pid` is alive (a zombie waiting for its reaper is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny llama trained through the whole taper (gate exactly 0), shared by the session.
    Small batches of short windows: the schedule is what matters here, not the loss."""
    from taperfold.checkpoint import save_checkpoint
    from taperfold.models import preset_config
    from taperfold.train import TrainOptions, train

    cfg = preset_config("tiny", arch="llama", taper="internal")
    result = train(cfg, TrainOptions(steps=40, eval_batches=2, batch_size=4, seq_len=32))
    return save_checkpoint(result.checkpoint, tmp_path_factory.mktemp("tiny") / "tiny.pt")


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory, tiny_checkpoint):
    """`taperfold export --kv-cache` of tiny_checkpoint (fp32, logits=last). Read-only: copy it before changing
    a file."""
    from taperfold.export import ExportOptions, export_checkpoint

    out = tmp_path_factory.mktemp("tiny-export") / "out"
    return export_checkpoint(tiny_checkpoint, out, ExportOptions(decoders=("growing",))).out_dir
