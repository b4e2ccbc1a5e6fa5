"""Atomic writes: a failed step never leaves a half-written artifact behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from taperfold.errors import TaperfoldError


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create `path` if needed and check we can write there; raise one clear error if not."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TaperfoldError(f"{p}: cannot create output directory ({e.strerror or e})") from None
    if not p.is_dir():
        raise TaperfoldError(f"{p}: output path exists and is not a directory")
    if not os.access(p, os.W_OK):
        raise TaperfoldError(f"{p}: output directory is not writable")
    return p


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, sidecars: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield a temporary path in dest's directory; on success rename it (and sidecars) over dest.

    `sidecars` are suffixes of files written next to the temporary path that must travel with it,
    e.g. ".data" for an ONNX model's external data (`tmp.onnx.data` -> `dest.onnx.data`).
    On any exception every temporary file is removed and dest is left as it was.
    """
    dest = Path(dest)
    ensure_writable_dir(dest.parent if str(dest.parent) else ".")
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        umask = os.umask(0)
        os.umask(umask)
        for suffix in sidecars:
            side, final = Path(str(tmp_path) + suffix), Path(str(dest) + suffix)
            if side.exists():
                os.replace(side, final)
            elif final.exists():  # the new file has no sidecar: a stale one would mislead
                final.unlink()
        if tmp_path.exists():
            os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600; give the usual mode
        os.replace(tmp_path, dest)
    finally:
        for p in [tmp_path, *(Path(str(tmp_path) + s) for s in sidecars)]:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Build a directory's files in a temporary sibling, then move each into dest on success."""
    dest = Path(dest)
    ensure_writable_dir(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent if str(dest.parent) else "."))
    try:
        yield tmp
        for item in sorted(tmp.iterdir()):
            os.replace(item, dest / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON file whose top level is an object; one clear error naming the file otherwise."""
    try:
        obj = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TaperfoldError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise TaperfoldError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(obj, dict):
        raise TaperfoldError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
