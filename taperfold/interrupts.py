"""SIGINT and SIGTERM stop a command cleanly: temporaries are removed, outputs stay as they were.

The handler records the signal before it raises, so an interrupt that some library swallows (a
KeyboardInterrupt raised inside a finalizer or a callback would be printed as "Exception ignored" and
dropped; `install` keeps that quiet) still stops the command at its next `check()`: every commit of an
output calls it with the signals blocked, so a command either commits whole before the signal or not at all.
A second signal while the first one's cleanup runs is not raised again (the command is already stopping).
Once the command is done (`finishing`), a signal ends the process at once with the same one line: nothing is
left to clean up, and an interpreter shutting down can neither drop it nor die of it without a word.
Exit codes: 130 for SIGINT, 143 for SIGTERM (128 + the signal number, as a shell reports them).

A child process whose own children must not outlive it (a contender's tool, vLLM's server and engine, the serving
benchmark) runs in a process group of its own (`process_group`, or `start_group` and `end_group` where it outlives a
block), ended whole however the command stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)
_received: int | None = None
_swallowed = False  # the last Interrupted raised was dropped by a finalizer or callback (see _unraisable)


class Interrupted(KeyboardInterrupt):
    """A handled signal; a KeyboardInterrupt so that every `finally` and cleanup runs as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


def _handle(signum, frame) -> None:
    """The first signal stops the command; a second (a double Ctrl-C) while the first one's cleanup runs is
    recorded, not raised: raised inside a `finally`, it would cut the cleanup short, leave temporaries behind and
    could escape the one-line handler (the process then dies by the signal). Where a library swallowed the first,
    nothing is stopping yet, and the next one is raised again."""
    global _received, _swallowed
    if _received is not None and not _swallowed:
        return
    _received, _swallowed = signum, False
    raise Interrupted(signum)


def _unraisable(hook):
    """sys.unraisablehook that drops a swallowed `Interrupted` (the next `check()` raises it again)."""

    def quiet(unraisable) -> None:
        global _swallowed
        if isinstance(unraisable.exc_value, Interrupted):
            _swallowed = True
        else:
            hook(unraisable)

    return quiet


def interrupted_line(e: KeyboardInterrupt) -> str:
    """The one line a stopped command prints: which signal stopped it (a plain Ctrl-C: SIGINT)."""
    return f"taperfold: interrupted ({signal.Signals(getattr(e, 'signum', signal.SIGINT)).name})"


def _end_now(signum, frame) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os.write(2, interrupted_line(Interrupted(signum)).encode() + b"\n")
    os._exit(128 + signum)


def install() -> None:
    """Handle SIGINT and SIGTERM alike; ignore SIGXFSZ so that a file-size limit is an EFBIG write error
    (one line, exit 2) rather than a core dump."""
    global _received, _swallowed
    _received, _swallowed = None, False
    if threading.current_thread() is not threading.main_thread():
        return
    for s in HANDLED:
        signal.signal(s, _handle)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sys.unraisablehook = _unraisable(sys.unraisablehook)


def finishing() -> None:
    """The command is done: from now until the process ends, a handled signal ends it at once (one line,
    128 + the signal number)."""
    if threading.current_thread() is threading.main_thread():
        for s in HANDLED:
            signal.signal(s, _end_now)


def check() -> None:
    """Raise `Interrupted` if a handled signal arrived, even if its first exception was swallowed."""
    if _received is not None:
        raise Interrupted(_received)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM while the body runs (a commit: a few renames), then deliver them."""
    check()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a pending signal is delivered here
    check()


def start_group(command: list[str], **popen: Any) -> subprocess.Popen:
    """`command` started (`popen`: subprocess.Popen's options) in a session of its own, so in a process group of its
    own, which `end_group` ends whole. A terminal's Ctrl-C then reaches taperfold alone, whose cleanup ends the group;
    the child keeps the signal handling it inherits (under a pytest-xdist worker, SIGINT ignored)."""
    return subprocess.Popen(command, start_new_session=True, **popen)


def end_group(process: subprocess.Popen, stop_signal: int | None = None, grace_s: float = 0) -> None:
    """End `process` and every process in its group (what it started: a shell's children, workers, an engine process):
    `stop_signal`, if given, to the group and up to `grace_s` for `process` to exit on it, then SIGKILL to what is
    left, even when a Ctrl-C cuts that wait short; `process` reaped. A group already gone is no error."""
    try:
        if stop_signal is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def process_group(
    command: list[str], *, stop_signal: int | None = None, grace_s: float = 0, **popen: Any
) -> Iterator[subprocess.Popen]:
    """`command` in a process group of its own (`start_group`), ended whole (`end_group`) however the block is left:
    done, by an error, a timeout or Ctrl-C; its pipes closed."""
    with start_group(command, **popen) as process:
        try:
            yield process
        finally:
            end_group(process, stop_signal, grace_s)
