"""Files taperfold reads that a user, a checkpoint or a model folder handed it: each must be a regular file, checked
before anything opens it for its content (a FIFO would block the reader forever, /dev/zero never ends), and at most
a stated size where taperfold reads it whole. Every refusal is one line naming the file.

Beside taperfold.fsutil, which writes (its names of special files are this module's too).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from taperfold.errors import TaperfoldError
from taperfold.fsutil import SPECIAL


def _what_it_is(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    return f"a {SPECIAL.get(stat.S_IFMT(mode), 'socket')}"


def _too_big(path: Path, size: int, limit: int, what: str) -> TaperfoldError:
    return TaperfoldError(f"{path}: {size} bytes, more than the {limit} bytes taperfold reads as {what}")


def check_plain_file(path: str | os.PathLike, what: str = "a file", limit: int | None = None) -> int:
    """The size of `path` (symlinks followed), a regular file of at most `limit` bytes, for a reader that opens it
    itself (a runtime); one line naming it otherwise. Nothing is opened."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TaperfoldError(f"{path}: no such file") from None
    except OSError as e:
        raise TaperfoldError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise TaperfoldError(f"{path}: is {_what_it_is(st.st_mode)}, not a regular file ({what})")
    if limit is not None and st.st_size > limit:
        raise _too_big(path, st.st_size, limit, what)
    return st.st_size


def read_plain_file(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The whole content of `path`, a regular file of at most `limit` bytes; one line naming it otherwise."""
    data = _read(Path(path), what, limit, limit + 1)
    if len(data) > limit:  # it grew since the check
        raise _too_big(Path(path), len(data), limit, what)
    return data


def read_file_head(path: str | os.PathLike, what: str, size: int) -> bytes:
    """The first `size` bytes of `path`, a regular file of any size (to tell what it is)."""
    return _read(Path(path), what, None, size)


def _read(path: Path, what: str, limit: int | None, size: int) -> bytes:
    """At most `size` bytes of `path` once it is checked (check_plain_file). Opened without blocking and checked
    again on the open descriptor, so a file swapped for a FIFO after the check cannot hang the read."""
    check_plain_file(path, what, limit)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise TaperfoldError(f"{path}: cannot read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise TaperfoldError(f"{path}: is {_what_it_is(mode)}, not a regular file ({what})")
        try:
            return f.read(size)
        except OSError as e:
            raise TaperfoldError(f"{path}: cannot read ({e.strerror or e})") from None
