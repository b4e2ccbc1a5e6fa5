"""Safe outputs: checked before the work, written whole or not at all, never clobbering (docs/guarantees.md).

- `check_outputs` is called by every command before any work: each output's directory must exist and
  take a new file, no output may be (or overwrite, through a sidecar such as `.data`) an input or
  another output, and devices, FIFOs and directories are only accepted where they make sense.
- `atomic_path` writes to a temporary file beside the destination and renames it into place; a
  symlink is written through (its target is replaced, the link stays), a character device or FIFO is
  written directly once the content is complete, and `-` means stdout.
- `atomic_dir` builds a directory in a temporary sibling and swaps it in whole, so that a directory
  describes exactly one run (no stale files from an earlier one).
- Any write failure (disk full, quota, file-size limit, I/O error) becomes one `TaperfoldError`
  naming the destination, which is left as it was; commits run with SIGINT / SIGTERM held.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from taperfold import interrupts
from taperfold.errors import TaperfoldError, first_line

STDOUT = "-"
SPECIAL = {stat.S_IFCHR: "character device", stat.S_IFBLK: "block device", stat.S_IFIFO: "FIFO"}
# Messages of write failures that libraries raise as something other than OSError: torch.save's zip writer
# ("PytorchStreamWriter failed writing file", "[enforce fail at inline_container.cc] unexpected pos",
# "basic_ios::clear: iostream error"), safetensors' "IoError(Os { code: 28 ... })".
_WRITE_FAILURE = re.compile(
    r"no space left|disk quota|file too large|write failed|failed writing|inline_container|"
    r"iostream error|i/?o ?error|errno \d+|os error \d+",
    re.IGNORECASE,
)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def resolve(path: str | os.PathLike) -> Path:
    """Where a write to `path` lands: symlinks followed (a dangling one to its target's path)."""
    return Path(os.path.realpath(path))


def _kind(path: Path) -> str | None:
    """None (absent), 'file', 'directory', one of SPECIAL's names, or 'socket'; symlinks followed."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise TaperfoldError(f"{path}: cannot stat ({e.strerror})") from None
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    return SPECIAL.get(stat.S_IFMT(mode), "socket")


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


# ---- checking a command's outputs before any work ------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """One output of a command, as the command will write it."""

    path: str | os.PathLike | None  # None: not requested
    option: str  # how errors name it: "-o", "--report", "verify.json"
    sidecars: tuple[str, ...] = ()  # files written beside it: ".data" for an ONNX model's weights
    stream: bool = False  # written in one piece (JSON, CSV, PNG): "-" is stdout; a device or FIFO is written to
    directory: str | None = None  # a directory written whole: what it holds, e.g. "taperfold export"
    owned: Callable[[Path], bool] | None = None  # for a directory: is an existing one of ours (replaceable)?
    overwrite: bool | None = None  # for a directory: replace a non-empty one that is not ours (None: no such option)
    # a file taperfold keeps inside a directory of its own (DIR/verify.json): written there only, never through a
    # link or mount planted on the way (check_inside)
    within: str | os.PathLike | None = None


class OutputPlan:
    """The checked outputs of one command."""

    def __init__(self, outputs: list[Output]):
        self.outputs = outputs

    @property
    def uses_stdout(self) -> bool:
        return any(str(o.path) == STDOUT for o in self.outputs)

    def human_output(self):
        """Tables and messages go to stderr while an output is stdout, so that stdout stays parseable."""
        return contextlib.redirect_stdout(sys.stderr) if self.uses_stdout else contextlib.nullcontext()


def files_in(folder: str | os.PathLike | None, keep: Path | None = None) -> list[Path]:
    """The files directly in `folder` (none where it is None or not a directory), `keep` left out: what a command
    reads from an export directory, which its outputs there (but `keep`, the one it replaces) must not overwrite."""
    directory = Path(folder) if folder else None
    if directory is None or not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.is_file() and p != keep]


def check_outputs(outputs: Iterable[Output], inputs: Iterable[str | os.PathLike | None] = ()) -> OutputPlan:
    """Raise one `TaperfoldError` for the first output that cannot or must not be written."""
    requested = [(o, o.path) for o in outputs if o.path is not None]
    sources = [(str(i), resolve(i)) for i in inputs if i is not None and str(i) != STDOUT]
    if sum(str(path) == STDOUT for _, path in requested) > 1:
        names = " and ".join(o.option for o, path in requested if str(path) == STDOUT)
        raise TaperfoldError(f"{names} are both '-' (stdout); give one of them a file name")
    targets: list[tuple[Path, str]] = []  # every file a regular-file output will replace, and who writes it
    for o, path in requested:
        if str(path) == STDOUT:
            if not o.stream:
                raise TaperfoldError(f"{o.option} -: stdout is only for text and JSON outputs; name a file")
            continue
        refuse_hub_cache(path, f"{o.option} {path}", whole=bool(o.directory))
        if o.within is not None:
            check_inside(path, o.within)
        if o.directory:
            _check_directory(o, path, sources)
            continue
        real = _check_file(o, path)
        if real is None:  # a device or FIFO: written to, never replaced
            continue
        files = [
            (real, "", o.option),
            *((Path(str(real) + s), f"its {s} file ", f"{o.option}'s {s} file") for s in o.sidecars),
        ]
        for file, subject, who in files:
            for label, source in sources:
                if _same(file, source):
                    raise TaperfoldError(
                        f"{o.option} {path}: {subject}would overwrite the input {label}; choose another output path"
                    )
            for other, other_who in targets:
                if _same(file, other):
                    raise TaperfoldError(
                        f"{o.option} {path}: {subject}is the same file as {other_who} ({file}); "
                        "give each output its own path"
                    )
            targets.append((file, who))
    return OutputPlan([o for o, _ in requested])


_CACHED_REPO = re.compile(r"(models|datasets|spaces)--.+")  # huggingface_hub's folder of one cached repository


def hub_caches() -> list[Path]:
    """The Hugging Face Hub caches huggingface_hub may use here: HF_HUB_CACHE (its older name too), HF_HOME/hub, and
    the default under XDG_CACHE_HOME or ~/.cache, read from the environment now (not when huggingface_hub was
    imported)."""
    env = os.environ
    homes = [env.get("HF_HOME"), os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")]
    found = [env.get("HF_HUB_CACHE"), env.get("HUGGINGFACE_HUB_CACHE"), *(h and os.path.join(h, "hub") for h in homes)]
    return [Path(os.path.abspath(os.path.expanduser(p))) for p in found if p]


def _cached_repo_holding(path: Path) -> Path | None:
    """The folder of a cached repository holding `path`, wherever it is: a `models--org--name` folder with a
    snapshots/ or blobs/ folder, huggingface_hub's layout (a snapshot's files are links into blobs/)."""
    for folder in (path, *path.parents):
        if _CACHED_REPO.fullmatch(folder.name) and any((folder / d).is_dir() for d in ("snapshots", "blobs")):
            return folder
    return None


def refuse_hub_cache(path: str | os.PathLike, name: str, whole: bool = False) -> None:
    """Refuse an output inside a Hugging Face Hub cache (or, `whole`: a directory replaced whole that holds one): a
    write there would change a cached model, through a snapshot's links into blobs/ shared by every revision.
    `name` is how the error names the output. The path is taken as written and with links followed."""
    paths = {Path(os.path.abspath(path)), resolve(path)}
    for cache in hub_caches():
        pairs = [(p, c) for p in paths for c in (cache, resolve(cache))]
        inside, holding = any(_inside(p, c) for p, c in pairs), whole and any(_inside(c, p) for p, c in pairs)
        if inside or holding:
            raise TaperfoldError(
                f"{name}: {'is inside' if inside else 'holds'} the Hugging Face Hub cache {cache}; writing there "
                "would change the models it holds; choose a path outside it"
            )
    for p in paths:
        if (repo := _cached_repo_holding(p)) is not None:
            raise TaperfoldError(
                f"{name}: is inside {repo}, a Hugging Face Hub cache's model folder; writing there would change the "
                "cached model; choose a path outside it"
            )


def _check_file(o: Output, path: str | os.PathLike) -> Path | None:
    """The regular file `o` (at `path`) will replace (its real path), or None for a device or FIFO written
    directly."""
    name = f"{o.option} {path}"
    link = Path(path)
    if o.sidecars and link.is_symlink():  # readers find the sidecar beside the link, writers beside the target
        raise TaperfoldError(
            f"{name}: is a symlink; this output and its {', '.join(o.sidecars)} file must be "
            "written as regular files; name the target instead"
        )
    real = resolve(link)
    kind = _kind(real)
    if kind == "directory" or str(path).endswith(("/", os.sep)):  # "DIR/" names a directory, existing or not
        raise TaperfoldError(f"{name}: is a directory; name a file")
    if kind in SPECIAL.values():
        if not o.stream:
            raise TaperfoldError(
                f"{name}: is a {kind}; this output needs a regular file"
                + (f" (its {', '.join(o.sidecars)} file goes beside it)" if o.sidecars else "")
            )
        if not os.access(real, os.W_OK):
            raise TaperfoldError(f"{name}: {kind} is not writable")
        return None
    if kind == "socket":
        raise TaperfoldError(f"{name}: is a socket; name a regular file")
    if kind == "file" and not os.access(real, os.W_OK):
        raise TaperfoldError(f"{name}: is read-only; refusing to replace it")
    _check_can_create_in(real.parent, name)
    for suffix in o.sidecars:
        side = Path(str(real) + suffix)
        if side.is_symlink():
            raise TaperfoldError(f"{name}: its {suffix} file {side} is a symlink; refusing to replace it")
        if _kind(side) not in (None, "file"):
            raise TaperfoldError(f"{name}: its {suffix} file {side} exists and is not a regular file")
    return real


def _check_can_create_in(folder: Path, name: str) -> None:
    kind = _kind(folder)
    if kind is None:
        raise TaperfoldError(f"{name}: directory {folder} does not exist")
    if kind != "directory":
        raise TaperfoldError(f"{name}: cannot create output directory {folder}: a file is in the way")
    try:  # the only test that holds everywhere (/proc, read-only mounts, ACLs, root): create a file
        fd, probe = tempfile.mkstemp(prefix=".taperfold-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TaperfoldError(f"{name}: cannot create files in {folder} ({e.strerror})") from None


def _check_directory(o: Output, path: str | os.PathLike, sources: list[tuple[str, Path]]) -> None:
    name = f"{o.option} {path}"
    if Path(path).is_symlink():  # replacing it whole would empty the directory it points to
        raise TaperfoldError(
            f"{name}: is a symlink; the {o.directory} directory is replaced whole, never through a "
            "link: name its target"
        )
    if _is_mount_point(path):
        raise TaperfoldError(
            f"{name}: is a mount point; the {o.directory} directory is replaced whole: name a directory inside it"
        )
    real = resolve(path)
    kind = _kind(real)
    if kind is None:
        ancestor = next(p for p in real.parents if _kind(p) is not None)
        _check_can_create_in(ancestor, name)
        return
    if kind != "directory":
        raise TaperfoldError(f"{name}: exists and is not a directory")
    for label, source in sources:
        if _inside(source, real):
            raise TaperfoldError(
                f"{name}: holds the input {label}; writing the {o.directory} directory there "
                "would replace it; choose another directory"
            )
    if _inside(Path.cwd().resolve(), real):
        raise TaperfoldError(f"{name}: is the current directory or holds it; choose another directory")
    if any(real.iterdir()) and not (o.owned and o.owned(real)) and not o.overwrite:
        raise TaperfoldError(
            f"{name}: is not empty and is not a {o.directory} directory; choose another"
            + (", or pass --overwrite to replace it whole" if o.overwrite is not None else "")
        )
    _check_can_create_in(real.parent, name)


def onnx_external_files(path: str | os.PathLike) -> list[Path]:
    """The files an ONNX model keeps initializer data in: inputs that its outputs must not overwrite."""
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - each format (.onnx, .json, .textproto, ...) has its parser and errors
        return []  # unreadable: the loader says why, in one line

    def tensors(graph):
        yield from graph.initializer
        yield from (s.values for s in graph.sparse_initializer)
        for node in graph.node:
            for attr in node.attribute:
                yield from ([attr.t] if attr.HasField("t") else [])
                for sub in [attr.g] if attr.HasField("g") else attr.graphs:
                    yield from tensors(sub)

    files = {entry.value for t in tensors(proto.graph) for entry in t.external_data if entry.key == "location"}
    return [Path(path).parent / f for f in sorted(files)]


# ---- writing -------------------------------------------------------------------------------------------


def is_write_failure(text: str) -> bool:
    """Whether a message (a library's, a child process's last line) says a write failed: disk full, quota, ..."""
    return bool(_WRITE_FAILURE.search(text))


@contextlib.contextmanager
def write_errors(dest: str | os.PathLike) -> Iterator[None]:
    """Any failure to write `dest` (disk full, quota, file-size limit, I/O error) → one TaperfoldError."""
    try:
        yield
    except (TaperfoldError, KeyboardInterrupt):
        raise
    except shutil.Error as e:  # copytree's: a list of (source, destination, why), one per file it could not copy
        failures = e.args[0] if e.args and isinstance(e.args[0], list) else []
        why = failures[0][2] if failures and len(failures[0]) == 3 else str(e)
        raise TaperfoldError(f"{dest}: cannot write ({str(why).split('] ', 1)[-1]})") from None
    except OSError as e:
        raise TaperfoldError(f"{dest}: cannot write ({e.strerror or e})") from None
    except Exception as e:
        text = str(e).strip()
        if not _WRITE_FAILURE.search(text):
            raise
        raise TaperfoldError(f"{dest}: cannot write ({text.splitlines()[-1][:200]})") from None


@contextlib.contextmanager
def _scratch_file(dest) -> Iterator[Path]:
    """A private temporary file for content that is then written to stdout, a device or a FIFO."""
    folder = Path(tempfile.mkdtemp(prefix="taperfold-"))
    try:
        yield folder / Path(str(dest)).name
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(
    dest: str | os.PathLike, sidecars: tuple[str, ...] = (), within: str | os.PathLike | None = None
) -> Iterator[Path]:
    """Yield a temporary path; once the body is done, put its content at dest (see the module docstring).

    `sidecars` are suffixes of files written next to the temporary path that must travel with it,
    e.g. ".data" for an ONNX model's external data (`tmp.onnx.data` -> `dest.onnx.data`).
    `within`: a directory of taperfold's own that dest is a file of (an export's verify.json); a link or mount on the
    way from it to dest is refused (check_inside), rather than followed as a link a user names as an output is.
    On any exception every temporary file is removed and dest is left as it was.
    """
    if within is not None:
        check_inside(dest, within)
    if sidecars and Path(dest).is_symlink():
        raise TaperfoldError(
            f"{dest}: is a symlink; a file with a {', '.join(sidecars)} file beside it is written "
            "as a regular file; name the target instead"
        )
    real = None if str(dest) == STDOUT else resolve(dest)
    kind = None if real is None else _kind(real)
    if real is None or kind in SPECIAL.values():
        if sidecars:
            raise TaperfoldError(
                f"{dest}: is {'stdout' if real is None else f'a {kind}'}; this output needs a regular file"
            )
        with _scratch_file(dest) as tmp, write_errors(dest):
            yield tmp
            data = tmp.read_bytes() if tmp.exists() else b""
            with interrupts.deferred():
                _write_stream(real, data)
        return
    if kind == "directory":
        raise TaperfoldError(f"{dest}: is a directory")
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TaperfoldError(f"{dest}: cannot create output directory {real.parent} ({e.strerror})") from None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
    except OSError as e:
        raise TaperfoldError(f"{dest}: cannot write in {real.parent} ({e.strerror})") from None
    os.close(fd)
    tmp_path = Path(tmp_name)
    try:
        with write_errors(dest):
            yield tmp_path
            umask = os.umask(0)
            os.umask(umask)
            if tmp_path.exists():
                os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600; give the usual mode
            with interrupts.deferred():  # all renames or none
                for suffix in sidecars:
                    side, final = Path(str(tmp_path) + suffix), Path(str(real) + suffix)
                    if side.exists():
                        os.replace(side, final)
                    elif final.exists():  # the new file has no sidecar: a stale one would mislead
                        final.unlink()
                os.replace(tmp_path, real)
    finally:
        for p in [tmp_path, *(Path(str(tmp_path) + s) for s in sidecars)]:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def _write_stream(real: Path | None, data: bytes) -> None:
    if real is None:
        sys.stdout.flush()
        buffer = getattr(sys.stdout, "buffer", None)
        if buffer is not None:
            buffer.write(data)
            buffer.flush()
        else:  # a text stream (captured in tests)
            sys.stdout.write(data.decode("utf-8", errors="replace"))
        return
    with open(real, "wb") as f:  # a device or FIFO: written, never replaced
        f.write(data)


def check_inside(path: str | os.PathLike, root: str | os.PathLike) -> None:
    """Refuse to build, replace or remove `path` unless it lies in `root` itself: no component from `root` down to
    `path` (inclusive) may be a symlink, a mount point or another file system, or something other than a directory
    on the way. A link planted in an export directory (DIR/genai/unfolded -> elsewhere) would otherwise make a build
    empty or overwrite the directory it points to. `root` itself may be reached through links."""
    root_real = resolve(root)
    try:
        relative = Path(os.path.abspath(path)).relative_to(Path(os.path.abspath(root)))
    except ValueError:
        raise TaperfoldError(f"{path}: is not inside {root}; refusing to write there") from None
    if ".." in relative.parts:
        raise TaperfoldError(f"{path}: climbs out of {root}; refusing to write there")
    try:
        device = os.stat(root_real).st_dev
    except OSError as e:
        raise TaperfoldError(f"{root}: cannot stat ({e.strerror})") from None
    current = root_real
    for i, part in enumerate(relative.parts):
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return  # made by the build, inside root
        except OSError as e:
            raise TaperfoldError(f"{current}: cannot stat ({e.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            raise TaperfoldError(
                f"{current}: is a symlink; taperfold builds and replaces files in {root} only, never through a link "
                "(remove the link)"
            )
        if st.st_dev != device or _is_mount_point(current):
            raise TaperfoldError(f"{current}: is a mount point or another file system; refusing to replace it")
        if i < len(relative.parts) - 1 and not stat.S_ISDIR(st.st_mode):
            raise TaperfoldError(f"{current}: is not a directory")


def _mount_points() -> set[str]:
    """Every mount point this process sees (bind mounts of the same file system too, which os.path.ismount misses),
    from /proc/self/mountinfo; empty where there is none."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return set()
    octal = re.compile(r"\\([0-7]{3})")  # the kernel writes space, tab, newline and backslash as \ooo
    return {octal.sub(lambda m: chr(int(m[1], 8)), line.split()[4]) for line in lines if len(line.split()) > 4}


def _is_mount_point(path: str | os.PathLike) -> bool:
    return os.path.ismount(path) or os.path.abspath(path) in _mount_points()


def _mount_points_inside(path: str | os.PathLike) -> list[str]:
    folder = os.path.abspath(path)
    return sorted(m for m in _mount_points() if m.startswith(folder + os.sep))


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike, within: str | os.PathLike | None = None) -> Iterator[Path]:
    """Build a directory in a temporary sibling; on success it replaces dest whole (an existing dest's
    files do not survive). On any exception dest is left as it was and the temporary is removed.
    dest is never a symlink (its target would be emptied) nor a mount point; `within`: the directory dest must lie
    in itself (check_inside), e.g. the export directory an artifact folder is built in."""
    if within is not None:
        check_inside(dest, within)
    if Path(dest).is_symlink():
        raise TaperfoldError(
            f"{dest}: is a symlink; a directory taperfold replaces whole is never a link (name its target)"
        )
    if _is_mount_point(dest):
        raise TaperfoldError(f"{dest}: is a mount point; refusing to replace it")
    if inside := _mount_points_inside(dest):  # its old contents are removed after the swap: never a mounted tree's
        raise TaperfoldError(f"{dest}: holds the mount point {inside[0]}; refusing to replace it")
    real = resolve(dest)
    made = [p for p in real.parents if _kind(p) is None]  # the parents this build creates, removed if it fails
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent))
    except OSError as e:
        raise TaperfoldError(f"{dest}: cannot create a directory in {real.parent} ({e.strerror})") from None
    done = False
    try:
        with _named_as(tmp, real), write_errors(dest):
            yield tmp
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700
            with interrupts.deferred():
                if _kind(real) is None:
                    os.rename(tmp, real)
                elif not real.is_dir():
                    raise TaperfoldError(f"{dest}: exists and is not a directory")
                else:
                    _swap(tmp, real)  # tmp now holds the old contents, removed below
                done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in made if not done else ():  # nearest first; one that holds something else stays
            with contextlib.suppress(OSError):
                parent.rmdir()


@contextlib.contextmanager
def _named_as(tmp: Path, real: Path) -> Iterator[None]:
    """A refusal raised while a directory is built names the files as they will be (DIR/...), not the temporary."""
    try:
        yield
    except TaperfoldError as e:
        e.args = tuple(a.replace(str(tmp), str(real)) if isinstance(a, str) else a for a in e.args)
        raise


def _swap(a: Path, b: Path) -> None:
    """Exchange two directories: atomically where the kernel can (renameat2), else in two renames."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), str(b))
    old = Path(tempfile.mkdtemp(prefix=f".{b.name}.", suffix=".old", dir=b.parent))
    os.rename(b, old / b.name)
    try:
        os.rename(a, b)
    except OSError:
        os.rename(old / b.name, b)
        raise
    os.rename(old / b.name, a)  # the old contents take a's name, as after an exchange
    os.rmdir(old)


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON file whose top level is an object; one clear error naming the file otherwise."""
    try:
        obj = json.loads(Path(path).read_text())
    except (
        ValueError,
        RecursionError,
    ) as e:  # JSONDecodeError, bad UTF-8, an integer past Python's digit limit, deep nesting
        raise TaperfoldError(f"{path}: not valid JSON ({first_line(e)})") from None
    except OSError as e:
        raise TaperfoldError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(obj, dict):
        raise TaperfoldError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def write_json_atomic(path: str | os.PathLike, obj, within: str | os.PathLike | None = None) -> None:
    with atomic_path(path, within=within) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
