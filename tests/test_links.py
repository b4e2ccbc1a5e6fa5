"""Nothing outside an export is ever deleted or written (docs/guarantees.md, round 5): a folder taperfold builds or
replaces in an export directory (bench's on-demand genai folder, a contender's DIR/against/TOOL-PRECISION/, the
manifest) planted as a link, or reached through one, is refused in one line and the directory it points to keeps every
file; a contender's tool that fails, hangs until Ctrl-C, or exits 0 having written nothing or garbage leaves no folder
behind and manifest.json as it was."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from conftest import HANG_S, is_running, one_line, run_cli

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_dir
from taperfold.models import random_gate0_model


def tree(folder: Path) -> dict[str, bytes | str]:
    """Every file's bytes and every link's target under `folder`, by relative path."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        found[key] = f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    return found


@pytest.fixture
def victim(tmp_path):
    """A directory of somebody else's: a file and a subfolder with a file."""
    folder = tmp_path / "victim"
    (folder / "sub").mkdir(parents=True)
    (folder / "keep.txt").write_text("precious")
    (folder / "sub" / "deep.bin").write_bytes(b"\x00\x01" * 100)
    return folder


@pytest.mark.parametrize("planted", ["dest", "parent"])
def test_atomic_dir_never_builds_through_a_link(tmp_path, victim, planted):
    root = tmp_path / "export"
    root.mkdir()
    before = tree(victim)
    if planted == "dest":  # DIR/genai/unfolded -> victim: its files would be swapped out
        (root / "genai").mkdir()
        (root / "genai" / "unfolded").symlink_to(victim)
    else:  # DIR/genai -> victim: the build would land in the victim
        (root / "genai").symlink_to(victim)
    with pytest.raises(TaperfoldError, match="is a symlink"), atomic_dir(root / "genai" / "unfolded", root) as tmp:
        (tmp / "model.onnx").write_text("new")
    assert tree(victim) == before


def test_atomic_dir_never_replaces_a_link_it_is_handed(tmp_path, victim):
    before = tree(victim)
    (tmp_path / "out").symlink_to(victim)
    with pytest.raises(TaperfoldError, match="is a symlink"), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "x").write_text("new")
    assert tree(victim) == before and (tmp_path / "out").is_symlink()


MOUNT_CHILD = """
import sys, subprocess
from pathlib import Path
from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_dir
root, victim, where = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
target = root / "genai" / "unfolded"
(target / "sub").mkdir(parents=True)
mounted = target / "sub" if where == "inside" else target
subprocess.run(["mount", "--bind", str(victim), str(mounted)], check=True)
try:
    with atomic_dir(target, root) as tmp:
        (tmp / "model.onnx").write_text("built")
except TaperfoldError as e:
    print(e)
"""


@pytest.mark.parametrize("where", ["at", "inside"])
def test_atomic_dir_refuses_a_mount_point_at_or_inside_the_folder(tmp_path, victim, where):
    """A bind mount of a victim directory at the folder, or inside the folder it would replace (whose old contents are
    then removed): one line, the victim's files untouched. In a private mount namespace (unshare), skipped where there
    is none."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no private mount namespace here (unshare -rm)")
    root = tmp_path / "export"
    root.mkdir()
    before = tree(victim)
    run = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", MOUNT_CHILD, root, victim, where],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "mount point" in run.stdout and run.stdout.count("\n") == 1, run.stdout
    assert tree(victim) == before


@pytest.fixture(scope="module")
def builtin_checkpoint(tmp_path_factory):
    model = random_gate0_model("tiny", arch="llama")
    return save_checkpoint(checkpoint_from_model(model, step=0), tmp_path_factory.mktemp("links") / "tiny.pt")


def test_export_refuses_an_output_directory_that_is_a_link_before_any_work(tmp_path, victim, builtin_checkpoint):
    before = tree(victim)
    (tmp_path / "out").symlink_to(victim)
    one_line(run_cli("export", builtin_checkpoint, "-o", tmp_path / "out", "--overwrite"), "is a symlink")
    assert tree(victim) == before


@pytest.fixture(scope="module")
def genai_export(tmp_path_factory, builtin_checkpoint):
    """`export --genai` of the tiny builtin llama: folders of the folded and baseline decoders, none of the
    unfolded one (bench builds that on demand)."""
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path_factory.mktemp("links-genai") / "out"
    result = run_cli("export", builtin_checkpoint, "-o", out, "--genai")
    assert result.exit_code == 0, result.stderr
    return out


def _copy(export: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(export, to, symlinks=True))


BENCH_GENAI = ["--engine", "genai", "--mode", "decode", "--batch", "1", "--prompt", "4", "--new-tokens", "2",
               "--iters", "1", "--warmup", "0", "--rounds", "1", "--threads", "1"]  # fmt: skip


@pytest.mark.parametrize("planted", ["genai/unfolded", "genai"])
def test_bench_never_builds_an_on_demand_folder_through_a_planted_link(tmp_path, victim, genai_export, planted):
    out = _copy(genai_export, tmp_path / "out")
    if planted == "genai":  # the whole genai/ folder a link to a copy of it inside the victim
        import shutil

        shutil.copytree(out / "genai", victim / "genai-copy")
        shutil.rmtree(out / "genai")
        (out / "genai").symlink_to(victim / "genai-copy")
    else:
        (out / "genai" / "unfolded").symlink_to(victim)
    before, manifest = tree(victim), (out / "manifest.json").read_bytes()
    one_line(run_cli("bench", out, *BENCH_GENAI), "is a symlink")
    assert tree(victim) == before
    assert (out / "manifest.json").read_bytes() == manifest


def test_a_manifest_planted_as_a_link_is_never_written_through(tmp_path, genai_export):
    out = _copy(genai_export, tmp_path / "out")
    real = tmp_path / "elsewhere.json"
    real.write_bytes((out / "manifest.json").read_bytes())
    (out / "manifest.json").unlink()
    (out / "manifest.json").symlink_to(real)
    before = real.read_bytes()
    one_line(run_cli("bench", out, *BENCH_GENAI), "manifest.json: is a symlink")
    assert real.read_bytes() == before and not (out / "genai" / "unfolded").exists()


@pytest.mark.parametrize(
    ("command", "report"),
    [
        (["verify"], "verify.json"),
        (["bench", "--iters", "1", "--warmup", "0", "--rounds", "1", "--batch", "1", "--seq", "8"], "bench.json"),
    ],
)
def test_a_report_planted_as_a_link_in_an_export_is_refused_before_the_work(tmp_path, tiny_export, command, report):
    out = _copy(tiny_export, tmp_path / "out")
    real = tmp_path / "elsewhere.json"
    real.write_text("somebody's")
    (out / report).unlink(missing_ok=True)  # the shared export may hold one from an earlier bench
    (out / report).symlink_to(real)
    one_line(run_cli(*command, out), f"{report}: is a symlink")
    assert real.read_text() == "somebody's" and (out / report).is_symlink()


@pytest.mark.parametrize("planted", ["model.plan", "trt.timing-cache"])
def test_a_tensorrt_plan_planted_as_a_link_is_refused_before_the_build(tmp_path, tiny_export, planted):
    from taperfold.artifacts.tensorrt_plan import build_engine, make_profile

    out = _copy(tiny_export, tmp_path / "out")
    real = tmp_path / "elsewhere"
    real.write_text("somebody's")
    (out / planted).symlink_to(real)
    with pytest.raises(TaperfoldError, match=f"{planted}: is a symlink"):
        build_engine(out / "model.onnx", out / "model.plan", make_profile(64), timing_cache=out / "trt.timing-cache",
                     within=out)  # fmt: skip
    assert real.read_text() == "somebody's"


# ---- contenders (bench --against): built all or nothing ----------------------------------------------------------


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory):
    """A tiny tapered Hugging Face Llama exported (ONNX only): a source the contenders build from."""
    pytest.importorskip("transformers")
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    root = tmp_path_factory.mktemp("links-hf")
    source = save_hf_directory(tapered_tiny_model("llama"), root / "tapered")
    result = run_cli("export", source, "-o", root / "out", "--no-baseline")
    assert result.exit_code == 0, result.stderr
    return root / "out"


def _stand_in_optimum_cli(folder: Path, body: str) -> None:
    """An `optimum-cli` on PATH that does `body` (shell) instead of exporting; its last argument is the output."""
    script = folder / "optimum-cli"
    script.write_text(f"#!/bin/sh\nfor last; do :; done\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("echo 'boom: out of memory' >&2; exit 1", "optimum-cli failed (boom: out of memory)"),
        ("exit 0", "optimum-cli exited 0 but wrote no usable model"),
        (
            'mkdir -p "$last"; echo garbage > "$last/openvino_model.xml"; echo x > "$last/openvino_model.bin"',
            "optimum-cli exited 0 but wrote no usable model",
        ),
        ('mkdir -p "$last"; echo \'<net/>\' > "$last/openvino_model.xml"', "no usable model"),  # no weights
    ],
    ids=["fails", "writes-nothing", "writes-garbage", "half-written"],
)
def test_a_contender_that_fails_leaves_no_folder_and_the_manifest_as_it_was(
    tmp_path, monkeypatch, hf_export, body, needle
):
    from taperfold.bench.against import OptimumIntel, prepare_contender
    from taperfold.manifest import read_manifest

    pytest.importorskip("openvino")
    out = _copy(hf_export, tmp_path / "out")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stand_in_optimum_cli(bin_dir, body)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(OptimumIntel, "version", lambda self: "stand-in")
    before = tree(out)
    with pytest.raises(TaperfoldError, match="--against optimum-intel") as refused:
        prepare_contender("optimum-intel", read_manifest(out), "fp32")
    assert needle in str(refused.value) and "\n" not in str(refused.value)
    assert tree(out) == before  # no against/ folder, no temporary, the manifest unchanged


INTERRUPTED_CHILD = """
import signal
import sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a user's Ctrl-C; a pytest-xdist worker's children ignore it
from taperfold.bench.against import OptimumIntel, prepare_contender
from taperfold.manifest import read_manifest
OptimumIntel.version = lambda self: "stand-in"
try:
    prepare_contender("optimum-intel", read_manifest(sys.argv[1]), "fp32")
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_a_contender_interrupted_while_it_builds_leaves_nothing(tmp_path, hf_export):
    """The tool hangs; Ctrl-C (SIGINT to the process running bench's build, a child here) stops it: the tool's
    processes, the workers it started too, are killed and nothing stays."""
    import signal
    import subprocess
    import time

    pytest.importorskip("openvino")
    out = _copy(hf_export, tmp_path / "out")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started, worker = tmp_path / "started", tmp_path / "worker.pid"
    _stand_in_optimum_cli(  # a tool whose worker (a child of its own) would never end: only the interrupt ends it
        bin_dir,
        f'mkdir -p "$last"; echo x > "$last/openvino_model.bin"; sleep 100000 & echo $! > {worker}; touch {started}; '
        "wait",
    )
    before = tree(out)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", INTERRUPTED_CHILD, str(out)], env=env)
    try:
        deadline = time.monotonic() + 300
        while not started.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), "the stand-in tool never started"
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=HANG_S) == 130
    finally:
        child.kill()
    assert tree(out) == before
    assert not is_running(int(worker.read_text())), "the tool's worker outlived the interrupt"


def test_a_contender_folder_planted_as_a_link_is_refused(tmp_path, victim, monkeypatch, hf_export):
    from taperfold.bench.against import OptimumIntel, prepare_contender
    from taperfold.manifest import read_manifest

    out = _copy(hf_export, tmp_path / "out")
    monkeypatch.setattr(OptimumIntel, "version", lambda self: "stand-in")
    before = tree(victim)
    for planted in (out / "against", out / "against" / "optimum-intel-fp32"):
        if planted.name != "against":
            (out / "against").unlink()
            (out / "against").mkdir()
        planted.symlink_to(victim)
        with pytest.raises(TaperfoldError, match="is a symlink"):
            prepare_contender("optimum-intel", read_manifest(out), "fp32")
        assert tree(victim) == before


def test_export_genai_on_a_full_disk_is_one_line_and_keeps_the_earlier_export(
    tmp_path, monkeypatch, genai_export, builtin_checkpoint
):
    import errno

    import taperfold.artifacts.genai_folder as genai_folder

    out = _copy(genai_export, tmp_path / "out")
    before = tree(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(genai_folder, "_write_decoder", disk_full)  # the folders' first write
    one_line(run_cli("export", builtin_checkpoint, "-o", out, "--genai"), f"{out}/genai/", "No space left on device")
    assert tree(tmp_path) == before  # the earlier export whole, no temporary beside it


if sys.platform != "linux":  # links and signals as Linux has them
    pytestmark = pytest.mark.skip(reason="Linux only")
