"""Signals in a CLI process (taperfold.interrupts): a closed pipe ends quietly; an interrupt, however late or however
caught, is one line and exit 130. Each runs `python -m taperfold` or a script in a child process. And a child started
in a process group of its own (interrupts.process_group) leaves nothing behind, however it is stopped."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import HANG_S, is_running

from taperfold.interrupts import process_group

PY = sys.executable


def test_a_closed_pipe_ends_quietly(tiny_checkpoint):
    shell = f"{PY} -m taperfold inspect {tiny_checkpoint} | head -c1 > /dev/null; echo ${{PIPESTATUS[0]}}"
    r = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=HANG_S)
    assert r.stdout.strip() == "141" and r.stderr == ""  # as `seq 1000000 | head -1`: SIGPIPE's status, no word


def test_a_signal_after_the_outputs_are_written_is_one_line_and_130(tiny_checkpoint, tmp_path):
    script = textwrap.dedent(f"""
        import atexit, os, signal, sys, time
        sys.argv = ["taperfold", "inspect", "--json", {str(tiny_checkpoint)!r}]
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))  # while the process ends
        from taperfold.cli import main
        main()
    """)
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 130 and r.stderr == "taperfold: interrupted (SIGINT)\n", r.stderr
    json.loads(r.stdout)  # what was printed before stays whole


def test_a_swallowed_interrupt_leaves_no_exception_ignored_noise(tiny_checkpoint, tiny_export, tmp_path):
    """Python prints an exception raised in a finalizer as "Exception ignored ..." and drops it; the recorded
    signal stops the export at its next stage, and the user sees one line, not that block too."""
    script = textwrap.dedent(f"""
        import signal, sys
        import onnx_ir
        import taperfold.tracing

        class Finalizer:
            def __del__(self):
                signal.raise_signal(signal.SIGINT)  # the handler raises here, inside __del__

        def export_to_ir(model, opts, graph="prefill", **options):
            Finalizer()
            return onnx_ir.load({str(tiny_export / "unfolded.onnx")!r})

        taperfold.tracing.export_to_ir = export_to_ir
        sys.argv = ["taperfold", "export", {str(tiny_checkpoint)!r}, "-o", {str(tmp_path / "out")!r}, "--no-baseline"]
        from taperfold.cli import main
        main()
    """)
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 130 and r.stderr == "taperfold: interrupted (SIGINT)\n", r.stderr
    assert not (tmp_path / "out").exists()


def test_a_second_signal_while_the_first_ones_cleanup_runs_lets_it_finish(tiny_checkpoint, tmp_path):
    """A double Ctrl-C: the second arrives inside the `finally` that cleans up after the first. It must neither cut
    that cleanup short nor end the process by the signal; the command still ends in one line and 130."""
    script = textwrap.dedent(f"""
        import signal, sys
        import taperfold.export
        from pathlib import Path

        def export_checkpoint(*args, **kwargs):
            try:
                signal.raise_signal(signal.SIGINT)  # the first: stops the export
            finally:
                signal.raise_signal(signal.SIGINT)  # the second, at once, while the cleanup runs
                Path({str(tmp_path / "cleaned")!r}).write_text("yes")

        taperfold.export.export_checkpoint = export_checkpoint
        sys.argv = ["taperfold", "export", {str(tiny_checkpoint)!r}, "-o", {str(tmp_path / "out")!r}]
        from taperfold.cli import main
        main()
    """)
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert r.returncode == 130 and r.stderr == "taperfold: interrupted (SIGINT)\n", (r.returncode, r.stderr)
    assert (tmp_path / "cleaned").read_text() == "yes"


# ---- a child's process group ------------------------------------------------------------------------------------


def leader_with_a_grandchild(pid_file: Path, leader_lives_s: int = 5) -> list[str]:
    """A shell that starts a grandchild (`sleep`) which would outlive it, writes the grandchild's pid to `pid_file`
    and lives `leader_lives_s` itself: long enough to be stopped, short enough that a broken helper fails, not hangs."""
    started = f"sleep 1000 & echo $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}"
    return ["bash", "-c", f"{started}; sleep {leader_lives_s}"]


def wait_for(condition, what: str, seconds: float = HANG_S) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def assert_ended(pid: int) -> None:
    """`pid` gone within a few seconds (SIGKILL is delivered when the process next runs)."""
    wait_for(lambda: not is_running(pid), f"process {pid} outlived its group's end", seconds=10)


@pytest.fixture
def pid_file(tmp_path):
    """Where the child writes its own child's pid; that process is killed after the test if it still runs."""
    path = tmp_path / "grandchild.pid"
    yield path
    if path.exists() and is_running(pid := int(path.read_text())):
        os.kill(pid, signal.SIGKILL)


def _raise_an_error(process: subprocess.Popen) -> None:
    raise RuntimeError("the caller failed")


def _time_out(process: subprocess.Popen) -> None:
    process.communicate(timeout=0.1)


@pytest.mark.parametrize(
    "leave, raised", [(_raise_an_error, RuntimeError), (_time_out, subprocess.TimeoutExpired)], ids=["error", "timeout"]
)
def test_process_group_ends_the_childs_own_children_when_the_block_raises(pid_file, leave, raised):
    with pytest.raises(raised), process_group(leader_with_a_grandchild(pid_file)) as process:
        wait_for(pid_file.exists, "the child never started its own")
        leave(process)
    assert process.returncode == -signal.SIGKILL  # ended by the helper, not by living its 5 s out
    assert_ended(int(pid_file.read_text()))


CTRL_C_CHILD = """
import signal
import sys
import time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a user's Ctrl-C; a pytest-xdist worker's children ignore it
from taperfold.interrupts import process_group
try:
    with process_group(sys.argv[1:]):
        time.sleep(100)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_process_group_ends_the_childs_own_children_on_ctrl_c(pid_file):
    """Ctrl-C (SIGINT to the process running the block, a child here) ends the child's group with it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runner = subprocess.Popen([sys.executable, "-c", CTRL_C_CHILD, *leader_with_a_grandchild(pid_file)], env=env)
    try:
        wait_for(lambda: pid_file.exists() or runner.poll() is not None, "the child never started its own")
        runner.send_signal(signal.SIGINT)
        assert runner.wait(timeout=HANG_S) == 130
    finally:
        runner.kill()
    assert_ended(int(pid_file.read_text()))


def test_a_stop_signal_goes_first_and_what_ignores_it_is_killed_once_the_child_exits(pid_file, tmp_path):
    """As vLLM's server is stopped: SIGTERM to the group, the child exits on it (ending the grace early), and a
    grandchild that ignores it is killed."""
    stopped = tmp_path / "stopped"
    ignores_term = f"(trap '' TERM; exec sleep 1000) & echo $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}"
    command = ["bash", "-c", f"trap 'touch {stopped}; exit 0' TERM; {ignores_term}; wait"]
    started = time.monotonic()
    with process_group(command, stop_signal=signal.SIGTERM, grace_s=60) as process:
        wait_for(pid_file.exists, "the child never started its own")
    assert stopped.exists() and process.returncode == 0  # it exited on the stop signal, not by SIGKILL
    assert time.monotonic() - started < 60  # the grace ended when it exited
    assert_ended(int(pid_file.read_text()))
