"""SIGINT and SIGTERM stop a command cleanly: temporaries are removed, outputs stay as they were.

The handler records the signal before it raises, so an interrupt that some library swallows (a
KeyboardInterrupt raised inside a finalizer or a callback is printed as "Exception ignored" and
dropped) still stops the command at its next `check()`: every commit of an output calls it with the
signals blocked, so a command either commits whole before the signal or not at all.
Exit codes: 130 for SIGINT, 143 for SIGTERM (128 + the signal number, as a shell reports them).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM)
_received: int | None = None


class Interrupted(KeyboardInterrupt):
    """A handled signal; a KeyboardInterrupt so that every `finally` and cleanup runs as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


def _handle(signum, frame) -> None:
    global _received
    _received = signum
    raise Interrupted(signum)


def install() -> dict:
    """Handle SIGINT and SIGTERM alike; ignore SIGXFSZ so that a file-size limit is an EFBIG write error
    (one line, exit 2) rather than a core dump. Returns the previous handlers for `restore`."""
    global _received
    _received = None
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {s: signal.getsignal(s) for s in (*HANDLED, signal.SIGXFSZ)}
    for s in HANDLED:
        signal.signal(s, _handle)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return previous


def restore(previous: dict) -> None:
    global _received
    _received = None
    for s, handler in previous.items():
        signal.signal(s, handler)


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
