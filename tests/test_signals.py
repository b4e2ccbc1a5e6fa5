"""Signals in a CLI process (taperfold.interrupts): a closed pipe ends quietly; an interrupt, however late or however
caught, is one line and exit 130. Each runs `python -m taperfold` or a script in a child process."""

import json
import subprocess
import sys
import textwrap

from conftest import HANG_S

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
