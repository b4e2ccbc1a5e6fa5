"""The bad-input and fault catalogue of docs/guarantees.md, end to end through the CLI.

Every refused case: exit 2, exactly one line on stderr naming the file or option, no traceback, and the
working directory byte-identical afterwards (no partial output, no temporary, nothing clobbered).
Cheap: one shared checkpoint and export (conftest's session fixtures); faults are simulated with a
file-size limit, a patched write or a signal to a child process.
"""

import contextlib
import errno
import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import HANG_S, run_cli

from taperfold.exportdir import onnx_file

PY = sys.executable
IS_ROOT = os.geteuid() == 0


# ---- helpers ------------------------------------------------------------------------------------------


def snapshot(*roots: Path) -> dict:
    """Every path under roots: its type, a symlink's target, a regular file's sha256 (special files unread)."""
    state = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                mode = os.lstat(p).st_mode
                if stat.S_ISLNK(mode):
                    state[str(p)] = ("link", os.readlink(p))
                elif stat.S_ISREG(mode):
                    state[str(p)] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
                else:
                    state[str(p)] = (stat.S_IFMT(mode),)
    return state


def refused(result, *needles) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taperfold: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def refused_untouched(tmp_path, args, *needles, extra=()) -> str:
    """Run `taperfold ARGS` (in this process) and check it is refused with tmp_path left byte-identical."""
    before = snapshot(tmp_path, *extra)
    line = refused(run_cli(*args), *needles)
    assert snapshot(tmp_path, *extra) == before
    return line


@pytest.fixture
def work(tmp_path, tiny_export, tiny_checkpoint, monkeypatch):
    """tmp_path as the working directory, holding copies of the shared checkpoint and export."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(tiny_checkpoint, tmp_path / "ckpt.pt")
    shutil.copytree(tiny_export, tmp_path / "exp")
    for name in ("verify.json", "bench.json", "bench-decode.json"):  # written there by other tests
        (tmp_path / "exp" / name).unlink(missing_ok=True)
    return tmp_path


@pytest.fixture
def quick_exporter(monkeypatch, tiny_export):
    """torch.onnx.export replaced by loading the shared export's graphs: the export's own steps (fold,
    write, commit) run for real in a second instead of twenty."""
    import onnx_ir

    import taperfold.tracing

    def export_to_ir(model, opts, graph="prefill", **options):
        name = "baseline" if model.cfg.taper == "none" else "unfolded"
        return onnx_ir.load(tiny_export / onnx_file(name, graph))

    monkeypatch.setattr(taperfold.tracing, "export_to_ir", export_to_ir)


def tapered_norms(work: Path) -> int:
    """How many norms the shared export's Internal-Taper llama tapers: both of every layer."""
    return 2 * json.loads((work / "exp" / "manifest.json").read_text())["config"]["n_layers"]


def pt_with(tmp_path: Path, source: Path, name: str, mutate) -> Path:
    """A copy of the .pt checkpoint `source` with `mutate(obj)` applied to its top-level dict."""
    obj = torch.load(source, weights_only=True)
    mutate(obj)
    path = tmp_path / name
    torch.save(obj, path)
    return path


def child(args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "taperfold.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


# ---- clobbering: special files, symlinks, inputs, other outputs ------------------------------------------


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _chardev(path: Path) -> Path:
    if not IS_ROOT:
        pytest.skip("creating a character device needs root")
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a private /dev/null
    return path


@pytest.mark.parametrize("make", [_fifo, _chardev], ids=["fifo", "chardev"])
def test_model_output_on_a_device_or_fifo_is_refused(work, make):
    target = make(work / "d")
    refused_untouched(work, ["fold", "exp/unfolded.onnx", "-o", target], "-o", "needs a regular file")
    assert not stat.S_ISREG(os.stat(target).st_mode)


def test_report_to_a_chardev_is_written_to_it_not_replaced(work):
    null = _chardev(work / "null")
    r = run_cli("fold", "exp/unfolded.onnx", "-o", "f.onnx", "--report", null)
    assert r.exit_code == 0, r.stderr
    assert stat.S_ISCHR(os.stat(null).st_mode)


def test_report_to_a_fifo_is_written_to_it(work):
    fifo = _fifo(work / "report.fifo")
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    r = run_cli("fold", "exp/unfolded.onnx", "-o", "f.onnx", "--report", fifo)
    reader.join(timeout=60)
    assert r.exit_code == 0, r.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(received[0])["summary"]["folded"] == tapered_norms(work)


def test_report_through_a_symlink_replaces_its_target_and_keeps_the_link(work):
    (work / "real").mkdir()
    (work / "real" / "r.json").write_text("old\n")
    (work / "l.json").symlink_to("real/r.json")
    r = run_cli("fold", "exp/unfolded.onnx", "-o", "f.onnx", "--report", "l.json")
    assert r.exit_code == 0, r.stderr
    assert os.readlink(work / "l.json") == "real/r.json"
    assert json.loads((work / "real" / "r.json").read_text())["output"] == "f.onnx"
    assert sorted(p.name for p in (work / "real").iterdir()) == ["r.json"]  # no temporary left


def test_model_output_that_is_a_symlink_is_refused(work):
    """Readers look for the weights beside the link, a write through it would put them beside the target."""
    (work / "models").mkdir()
    (work / "link.onnx").symlink_to("models/target.onnx")
    refused_untouched(work, ["fold", "exp/unfolded.onnx", "-o", "link.onnx"], "-o link.onnx", "is a symlink")


def test_report_dash_is_stdout_and_the_table_goes_to_stderr(work):
    r = run_cli("fold", "exp/unfolded.onnx", "-o", "f.onnx", "--report", "-")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["summary"]["folded"] == tapered_norms(work)
    assert "norms folded" in r.stderr


@pytest.mark.parametrize(
    "args, needles",
    [
        (["-o", "exp/unfolded.onnx"], ["would overwrite the input exp/unfolded.onnx"]),
        (["-o", "exp/unfolded.onnx.data"], ["would overwrite the input exp/unfolded.onnx.data"]),
        (["-o", "x.onnx", "--report", "x.onnx"], ["--report x.onnx", "same file as -o"]),
        (["-o", "x.onnx", "--report", "exp/unfolded.onnx"], ["--report", "would overwrite the input"]),
        (["-o", "x.onnx", "--report", "x.onnx.data"], ["same file as -o's .data file"]),
        (["-o", "exp/unfolded.onnx.data.onnx"], []),  # a new name: allowed (checked below)
    ],
    ids=["o-is-input", "o-is-input-data", "report-is-o", "report-is-input", "report-is-o-data", "ok"],
)
def test_outputs_that_are_inputs_or_each_other_are_refused_before_work(work, args, needles):
    if not needles:
        assert run_cli("fold", "exp/unfolded.onnx", *args).exit_code == 0
        return
    refused_untouched(work, ["fold", "exp/unfolded.onnx", *args], *needles)


def test_input_data_reached_through_a_hard_link_is_refused(work):
    os.link(work / "exp" / "unfolded.onnx.data", work / "alias.data")
    refused_untouched(
        work, ["fold", "exp/unfolded.onnx", "-o", "x.onnx", "--report", "alias.data"], "would overwrite the input"
    )


def test_export_into_the_checkpoint_directory_is_refused(work):
    from taperfold.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(load_checkpoint(work / "ckpt.pt"), work / "gd2")
    refused_untouched(work, ["export", "gd2", "-o", "gd2"], "holds the input gd2")
    refused_untouched(work, ["export", "ckpt.pt", "-o", "."], "holds the input ckpt.pt")


def test_export_into_a_foreign_non_empty_directory_needs_overwrite(work):
    (work / "mine").mkdir()
    (work / "mine" / "thesis.tex").write_text("years of work\n")
    refused_untouched(work, ["export", "ckpt.pt", "-o", "mine"], "not a taperfold export directory", "--overwrite")


def test_export_from_the_current_directory_is_refused(work):
    os.chdir(work / "exp")
    refused_untouched(work, ["export", "../ckpt.pt", "-o", "."], "current directory")


def test_re_export_replaces_the_directory_whole(work, quick_exporter):
    """No stale decoders, verify.json or bench.json from the earlier export survive."""
    (work / "exp" / "verify.json").write_text('{"passed": true}\n')
    (work / "exp" / "bench.json").write_text("{}\n")
    r = run_cli("export", "ckpt.pt", "-o", "exp", "--no-baseline")
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in (work / "exp").iterdir()) == [
        "manifest.json",
        "model.onnx",
        "model.onnx.data",
        "unfolded.onnx",
        "unfolded.onnx.data",
    ]
    assert not [p for p in work.iterdir() if p.name.startswith(".")]  # no temporary sibling left


# ---- checked too late: every output checked before the work ----------------------------------------------


@pytest.mark.parametrize(
    "args, needles",
    [
        (["fold", "exp/unfolded.onnx", "-o", "f.onnx", "--report", "/proc/x.json"], ["--report /proc/x.json"]),
        (["fold", "exp/unfolded.onnx", "-o", "nodir/f.onnx"], ["directory", "nodir", "does not exist"]),
        (["bench", "exp", "--report", "/proc/b.json", "--iters", "1"], ["--report /proc/b.json"]),
        (["bench", "exp", "--json", "/proc/b.json", "--iters", "1"], ["/proc/b.json"]),  # the old spelling
        (["bench", "exp", "--csv", "nodir/b.csv", "--iters", "1"], ["--csv nodir/b.csv", "does not exist"]),
        (["bench", "exp", "--plot", "/proc/b.png", "--iters", "1"], ["--plot /proc/b.png"]),
        (["bench", "exp", "--csv", "exp/model.onnx", "--iters", "1"], ["would overwrite the input"]),
        (["train", "--steps", "30", "--batch-size", "1", "-o", "/proc/x.pt"], ["-o /proc/x.pt"]),
        (["train", "--steps", "30", "--batch-size", "1", "--out", "/proc/x.pt"], ["/proc/x.pt"]),  # the old spelling
        (["train", "--steps", "30", "--batch-size", "1", "-o", "x.pt", "--data", "x.pt"], []),
        (["export", "ckpt.pt", "-o", "/proc/out"], ["-o /proc/out"]),
    ],
    ids=lambda v: "-".join(map(str, v))[:40] if isinstance(v, list) else None,
)
def test_unwritable_outputs_are_refused_before_any_work(work, args, needles):
    if "--data" in args:
        (work / "x.pt").write_text("some text to train on\n" * 100)
        needles = ["-o x.pt", "would overwrite the input x.pt"]
    refused_untouched(work, args, *needles)


def test_verify_checks_verify_json_before_running(work):
    (work / "exp" / "verify.json").mkdir()
    refused_untouched(work, ["verify", "exp"], "verify.json", "is a directory")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["fold", "exp/unfolded.onnx", "-o", "exp"], ["'-o'", "directory", "taperfold fold --help"]),
        (["export"], ["CHECKPOINT", "taperfold export --help"]),
        (["bench", "exp", "--batch"], ["--batch", "argument"]),
        (["verify", "exp", "--no-such-flag"], ["--no-such-flag"]),
    ],
)
def test_usage_errors_are_one_line(work, args, needles):
    """click's own usage block (Usage:, Try ..., Error: ...) is three lines: one line like every bad input."""
    refused_untouched(work, args, *needles)


def test_no_arguments_shows_the_help():
    result = run_cli()
    assert result.exit_code == 2 and "Commands:" in result.stderr and "Traceback" not in result.stderr


def test_one_stdout_output_at_most(work):
    refused_untouched(work, ["bench", "exp", "--report", "-", "--csv", "-"], "both '-'")


# ---- disk full and other write failures ----------------------------------------------------------------


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_writing_verify_json_is_one_line_and_keeps_the_old_report(work, monkeypatch):
    (work / "exp" / "verify.json").write_text('{"earlier": true}\n')
    monkeypatch.setattr(Path, "write_text", _enospc)
    line = refused_untouched(work, ["verify", "exp", "--threads", "1"], "verify.json", "No space left on device")
    assert "cannot write" in line


def test_disk_full_writing_a_model_leaves_the_earlier_one(work, monkeypatch):
    import onnx_ir

    run_cli("fold", "exp/unfolded.onnx", "-o", "f.onnx")
    monkeypatch.setattr(onnx_ir, "save", _enospc)
    refused_untouched(work, ["fold", "exp/unfolded.onnx", "-o", "f.onnx"], "f.onnx", "No space left on device")


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """RLIMIT_FSIZE in this process: a larger write fails with EFBIG (SIGXFSZ ignored meanwhile)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("name", ["c.pt", "c.safetensors", "cdir"])
def test_file_size_limit_while_saving_a_checkpoint(work, name):
    """torch.save, safetensors and the directory layout each fail as one TaperfoldError, nothing left."""
    from taperfold.checkpoint import load_checkpoint, save_checkpoint
    from taperfold.errors import TaperfoldError

    ckpt = load_checkpoint(work / "ckpt.pt")
    before = snapshot(work)
    with file_size_limit(64 * 1024), pytest.raises(TaperfoldError, match="cannot write") as e:
        save_checkpoint(ckpt, work / name)
    assert name in str(e.value) and "\n" not in str(e.value)
    assert snapshot(work) == before


def test_train_with_a_full_disk_is_one_line(work, monkeypatch):
    """After the training, not a traceback: the checkpoint write fails as one line, exit 2."""
    import taperfold.train
    from taperfold.checkpoint import load_checkpoint

    result = taperfold.train.TrainResult(load_checkpoint(work / "ckpt.pt"), 1.0)
    monkeypatch.setattr(taperfold.train, "train", lambda *a, **k: result)
    before = snapshot(work)
    with file_size_limit(64 * 1024):
        r = run_cli("train", "--steps", "30", "-o", "new.pt")
    refused(r, "new.pt", "cannot write")
    assert snapshot(work) == before


def test_export_under_a_file_size_limit(work, quick_exporter):
    """EFBIG while the export writes its ONNX weights: one line, exit 2, the earlier export untouched."""
    before = snapshot(work)
    with file_size_limit(1 << 20):
        r = run_cli("export", "ckpt.pt", "-o", "exp", "--no-baseline")
    refused(r, "exp", "cannot write", "File too large")
    assert snapshot(work) == before


# ---- signals -------------------------------------------------------------------------------------------


def _wait_for_temporary(folder: Path, proc) -> None:
    deadline = time.monotonic() + HANG_S  # a hang guard, not a speed check
    while not any(p.name.startswith(".out.") for p in folder.iterdir()):
        assert proc.poll() is None, proc.communicate()
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out: no temporary in {folder} after {HANG_S} s\n{proc.communicate()}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_export_removes_temporaries(work, signum, code):
    before = snapshot(work)
    proc = child(["export", "ckpt.pt", "-o", "out", "--no-baseline"], cwd=work)
    _wait_for_temporary(work, proc)
    time.sleep(0.5)  # inside torch.onnx.export by now
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == code, err
    assert "Traceback" not in err and "interrupted" in err, err
    assert snapshot(work) == before  # no out/, no .out.*.tmp/


def test_an_interrupt_swallowed_inside_the_exporter_still_stops_the_export(work, tiny_export, monkeypatch):
    """A KeyboardInterrupt raised in a finalizer is printed as "Exception ignored" and dropped by Python:
    the export went on to exit 0. The recorded signal stops it at the next stage or commit."""
    import onnx_ir

    import taperfold.tracing

    class Finalizer:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the handler runs here, inside __del__

    def export_to_ir(model, opts, graph="prefill", **options):
        Finalizer()  # collected at once: the interrupt lands in its __del__ and is swallowed
        return onnx_ir.load(tiny_export / "unfolded.onnx")

    monkeypatch.setattr(taperfold.tracing, "export_to_ir", export_to_ir)
    before = snapshot(work)
    r = run_cli("export", "ckpt.pt", "-o", "out", "--no-baseline")
    assert r.exit_code == 130, r.stderr
    assert snapshot(work) == before


# ---- bad checkpoints and configs: one line instead of a traceback -----------------------------------------


def test_a_text_file_named_pt(work):
    (work / "a.pt").write_text("hello\n")
    refused_untouched(work, ["inspect", "a.pt"], "a.pt", "not a PyTorch file")


def _config(**changes):
    return lambda obj: obj["config"].update(changes)


def _tensor(key, value):
    def mutate(obj):
        obj["state_dict"][key] = obj["state_dict"][key].clone()
        obj["state_dict"][key].view(-1)[0] = value

    return mutate


BAD_CHECKPOINTS = {
    "n_heads=0": (_config(n_heads=0), ["n_heads must be an integer in [1, 1024], got 0"]),
    "d_model=128.0": (_config(d_model=128.0), ["d_model must be an integer", "128.0"]),
    "max_seq_len=0": (_config(max_seq_len=0), ["max_seq_len", "got 0"]),
    "max_seq_len=1e12": (_config(max_seq_len=1e12), ["max_seq_len", "1000000000000.0"]),
    "max_seq_len=10**12": (_config(max_seq_len=10**12), ["max_seq_len", "1000000000000"]),
    "n_layers=1e9": (_config(n_layers=1e9), ["n_layers must be an integer"]),
    "n_layers=1000": (_config(n_layers=1000), ["describes a model of at least", "parameters"]),
    "vocab_size=true": (_config(vocab_size=True), ["vocab_size must be an integer"]),
    "norm_eps=-1": (_config(norm_eps=-1), ["norm_eps must be a number in (0, 1]", "-1"]),
    "rope_theta=nan": (_config(rope_theta=float("nan")), ["rope_theta"]),
    "odd head_dim": (_config(d_model=132, n_heads=4, d_ff=512), ["must be even"]),
    "nan in q_proj": (
        _tensor("model.layers.1.self_attn.q_proj.weight", float("nan")),
        ["model.layers.1.self_attn.q_proj.weight", "NaN or Inf"],
    ),
    "inf in embedding": (
        _tensor("model.embed_tokens.weight", float("inf")),
        ["model.embed_tokens.weight", "NaN or Inf"],
    ),
    "c=1e38": (_tensor("model.layers.0.input_layernorm.c", 1e38), ["model.layers.0.input_layernorm.c", "1e+38"]),
    "c=-1": (_tensor("model.layers.2.post_attention_layernorm.c", -1.0), ["post_attention_layernorm.c", "-1"]),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
@pytest.mark.parametrize("command", ["inspect", "export", "bench"])
def test_bad_checkpoint_is_one_line(work, case, command):
    mutate, needles = BAD_CHECKPOINTS[case]
    bad = pt_with(work, work / "ckpt.pt", "bad.pt", mutate)
    args = {
        "inspect": ["inspect", bad],
        "export": ["export", bad, "-o", "out"],
        "bench": ["bench", "--checkpoint", bad, "--iters", "1", "--seq", "8", "--batch", "1"],
    }[command]
    refused_untouched(work, args, "bad.pt", *needles)


# ---- smaller: names, piped tables, bench reports per mode --------------------------------------------------


def test_old_option_spellings_work_but_are_hidden_from_help():
    assert "--out " not in run_cli("train", "--help").stdout and "--output" in run_cli("train", "--help").stdout
    export_help = run_cli("export", "--help").stdout
    assert "--out " not in export_help and "--onnx / --no-onnx" in export_help  # --onnx, once hidden, is the default
    bench_help = run_cli("bench", "--help").stdout
    assert "--report" in bench_help and "--json" not in bench_help


def test_piped_tables_keep_norm_names_whole(work):
    for args in (["inspect", "ckpt.pt"], ["fold", "exp/unfolded.onnx", "-o", "f.onnx"]):
        r = run_cli(*args)
        assert r.exit_code == 0, r.stderr
        for i in range(4):
            name = f"model.layers.{i}.post_attention_layernorm"
            assert any(name in line for line in r.stdout.splitlines()), (args, r.stdout)


@pytest.mark.slow
def test_decode_bench_does_not_overwrite_the_prefill_report(work):
    common = ["--batch", "1", "--iters", "1", "--warmup", "0", "--threads", "1", "--variants", "folded"]
    assert run_cli("bench", "exp", "--seq", "8", *common).exit_code == 0
    prefill = (work / "exp" / "bench.json").read_bytes()
    r = run_cli("bench", "exp", "--mode", "decode", "--prompt", "4", "--new-tokens", "2", *common)
    assert r.exit_code == 0, r.stderr
    assert (work / "exp" / "bench.json").read_bytes() == prefill
    assert json.loads((work / "exp" / "bench-decode.json").read_text())["mode"] == "decode"


# ---- the mechanisms themselves -------------------------------------------------------------------------------


def test_atomic_dir_replaces_whole_or_not_at_all(tmp_path):
    from taperfold.fsutil import atomic_dir

    dest = tmp_path / "d"
    dest.mkdir()
    (dest / "stale").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(dest) as tmp:
        (tmp / "new").write_text("new")
        raise RuntimeError("failed half way")
    assert sorted(p.name for p in dest.iterdir()) == ["stale"]
    with atomic_dir(dest) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_directory_swap_without_renameat2(tmp_path, monkeypatch):
    import ctypes

    from taperfold import fsutil

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: (_ for _ in ()).throw(OSError("no libc")))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "new").write_text("1")
    (b / "old").write_text("2")
    fsutil._swap(a, b)
    assert [p.name for p in b.iterdir()] == ["new"] and [p.name for p in a.iterdir()] == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
