"""The suite's own harness (tests/conftest.py): a test run leaves the temporary folder as it found it."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import HANG_S

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_test_run_leaves_the_temp_folder_as_it_found_it(tmp_path, workers):
    """Also what a process a test starts leaves in its temporary folder (as vLLM's engine leaves its sockets), on
    one process and on xdist's workers."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "test_probe.py").write_text(
        textwrap.dedent("""
        import subprocess
        import sys

        def test_writes(tmp_path, tmp_path_factory):
            (tmp_path / "x").write_bytes(b"0" * 1000)
            (tmp_path_factory.mktemp("shared") / "y").write_bytes(b"1")

        def test_starts_a_child_that_leaves_a_file_in_its_temp_folder():
            subprocess.run([sys.executable, "-c", "import tempfile; tempfile.mkstemp()"], check=True)
    """)
    )
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(ROOT / "tests")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    r = subprocess.run(
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-n", workers, "test_probe.py"],
        cwd=probe,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(temp.iterdir()) == []
