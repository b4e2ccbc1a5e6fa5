"""Every command block of the README, docs/hf.md and docs/deployment.md runs as printed, in order, in one fresh
folder: the shell commands (`$ taperfold ...`, `$ python -c ...`, and the bare `taperfold ...` lines of the overview)
and the Python blocks. What a block names but does not make is made first: `your_model.onnx` / `my_model.onnx` (any
ONNX model: the export's unfolded graph), `plain-dir` (a plain tiny Llama), `corpus.txt` (text) and, for the
deployment guide, `tiny.safetensors` and `tapered/` (a tapered tiny Hugging Face Llama).
`./scripts/demo` and `./scripts/test` are left out: tests/test_demo.py runs the demo, and this is the suite.
Training runs the steps the docs print; this module is the slowest of the suite (about three minutes on a quiet
2-core machine, 20 under load), one class per document so that they can run on three workers. A command is limited
only by conftest.HANG_S, a guard against a hang: a loaded machine is slow, not wrong."""

import os
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from conftest import HANG_S

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = ("./scripts/", "pip install", "python -m venv")


def blocks(markdown: str) -> list[tuple[str, str, list[str]]]:
    """("shell", command, printed) and ("python", code, []) in document order; printed is the output the doc
    shows under a `$ ` command."""
    found = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            language = line[3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            body = lines[i + 1 : end]
            if language == "python":
                found.append(("python", "\n".join(body) + "\n", []))
            elif language == "":
                found += [("shell", b, []) for b in body if b.startswith("taperfold ")]
            i = end + 1
            continue
        if line.startswith("    "):
            text = line[4:]
            command = text[2:] if text.startswith("$ ") else text if text.startswith("taperfold ") else None
            if command is not None and not command.startswith(SKIPPED):
                while command.count('"') % 2:  # a quoted argument over several lines: python -c "..."
                    i += 1
                    command += "\n" + lines[i][4:]
                printed = []
                while (
                    text.startswith("$ ")
                    and i + 1 < len(lines)
                    and lines[i + 1].startswith("    ")
                    and not lines[i + 1].startswith("    $ ")
                ):
                    i += 1
                    printed.append(lines[i][4:])
                found.append(("shell", command, printed))
        i += 1
    return found


def test_every_doc_lists_what_it_runs():
    readme = blocks((ROOT / "README.md").read_text())
    shell = [c for kind, c, _ in readme if kind == "shell"]
    assert (
        shell[:5]
        == [
            "taperfold train  --preset tiny --steps 300 -o tiny.safetensors   "
            "# a real tapered checkpoint, gate exactly 0",
            *shell[1:5],
        ]
        and len(shell) >= 15
    )
    assert sum(kind == "python" for kind, _, _ in readme) == 2
    assert any(
        c.startswith('python -c "from transformers') and c.endswith("save_pretrained('llama-plain')\"") for c in shell
    )
    hf = blocks((ROOT / "docs" / "hf.md").read_text())
    assert [kind for kind, _, _ in hf] == ["shell"] * 5 + ["python"]
    printed = {c.split()[1]: p for kind, c, p in readme if p}
    assert {"train", "inspect", "export", "verify", "bench"} <= set(printed)
    assert "8 of 9 norm layers can be folded" in printed["inspect"]


MEASURED = re.compile(r"^-?[\d.,]+(e[-+]?\d+)?$|^worst: ")  # timings, sizes, errors, c, γ̃: they vary by run
COUNT_LINES = re.compile(
    r"^\d+ of \d+ norm layers can be folded$|^PASS: |^FAIL: |^exported to |^note: |"
    r"^(prefill|decode) (throughput|latency) "
)


def cells(line: str) -> list[str] | None:
    if line[:1] in "┃│" and line.rstrip()[-1:] in "┃│":
        return [c.strip() for c in re.split(r"[┃│]", line.rstrip())[1:-1]]
    return None


def claims_hold(printed: list[str], out: str) -> list[str]:
    """The printed lines the doc claims that a run does not print. What a run measures (timings, sizes, errors,
    c, γ̃) is left out; what the model and the code decide is held: table headers, every row's other cells,
    fold counts, norm counts, pair counts, notes."""
    actual = out.splitlines()
    rows = [c for c in map(cells, actual) if c is not None]
    missing = []
    for line in printed:
        shown = cells(line)
        if shown is not None:
            held = [(i, c) for i, c in enumerate(shown) if not MEASURED.search(c)]
            if not any(len(r) == len(shown) and all(r[i] == c for i, c in held) for r in rows):
                missing.append(line)
        elif COUNT_LINES.search(line):
            if line.rstrip() not in (a.rstrip() for a in actual):
                missing.append(line)
        elif line.startswith("fold: "):
            said = [kv for kv in line.removeprefix("fold: ").split(", ") if "=" not in kv and kv != "..."]
            run = next((a for a in actual if a.startswith("fold: ")), "")
            missing += [f"fold: ... {kv} ..." for kv in said if kv not in run.removeprefix("fold: ").split(", ")]
        elif re.match(r"^\S+: \w+.*parameters", line):  # inspect's first line, up to the validation loss
            missing += [line] if not any(a.startswith(line.split(", val loss")[0]) for a in actual) else []
    return missing


def _setup(folder: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
    )  # bytes as tokens, and room for the guide's windows
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder / "plain-dir")
    python = Path(os.__file__).read_text()  # text every machine has
    (folder / "corpus.txt").write_text(python * 3)


# One class per document: the suite runs a module's tests on one worker (--dist loadscope) but each class on its own,
# so the three trainings and exports of these documents run side by side where there are cores for them.
class TestReadme:
    def test_runs_as_printed(self, tmp_path):
        _setup(tmp_path)
        _run_as_printed("README.md", tmp_path)


class TestHfGuide:
    def test_runs_as_printed(self, tmp_path):
        _setup(tmp_path)
        _run_as_printed("docs/hf.md", tmp_path)


class TestDeploymentGuide:
    def test_runs_as_printed(self, tmp_path):
        """docs/deployment.md on a tiny tapered checkpoint (random weights at g = 0: what the guide exports)."""
        pytest.importorskip(
            "onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'taperfold[genai]')"
        )
        from hf_models import tapered_tiny_model

        from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
        from taperfold.hf import save_hf_directory
        from taperfold.models import random_gate0_model

        save_checkpoint(checkpoint_from_model(random_gate0_model("tiny"), step=0), tmp_path / "tiny.safetensors")
        save_hf_directory(tapered_tiny_model("llama"), tmp_path / "tapered")  # what `export --vllm` takes
        _run_as_printed("docs/deployment.md", tmp_path)


def _run_as_printed(document: str, tmp_path: Path) -> None:
    """Every block of `document`, in order, in `tmp_path`: each exits 0 and prints what the document shows."""
    # One OpenMP thread per command: with other work on the cores, torch's two threads wait for each other at every
    # barrier (a 30-step training under load: 90 s wall and 55 s of CPU with two, 52 s and 19 s with one; the
    # 600-step one ran past an hour). Nothing the docs print depends on it: their thread counts are --threads 1.
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    for kind, text, printed in blocks((ROOT / document).read_text()):
        for name in re.findall(r"\b(?:your|my)_model\.onnx\b", text):
            if not (tmp_path / name).exists():  # any ONNX model: the export's unfolded graph, weights inside
                onnx.save(onnx.load(tmp_path / "out" / "unfolded.onnx"), tmp_path / name)
        argv = ["bash", "-c", text] if kind == "shell" else [sys.executable, "-c", text]
        try:
            r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_S)
        except subprocess.TimeoutExpired as e:
            pytest.fail(
                f"{document}: {text}\ntimed out: still running after {HANG_S} s (a hang guard, not a speed "
                f"check)\n{(e.stdout or b'')[-2000:]!r}\n{(e.stderr or b'')[-2000:]!r}"
            )
        assert r.returncode == 0, f"{document}: {text}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        missing = claims_hold(printed, r.stdout + r.stderr)
        assert not missing, f"{document}: {text} no longer prints:\n" + "\n".join(missing) + "\n" + r.stdout
