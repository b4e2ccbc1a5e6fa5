"""Shared fixtures and helpers."""

import contextlib
import io
import sys
from dataclasses import dataclass

import pytest


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
    code = 0
    sys.argv = ["taperfold", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli
