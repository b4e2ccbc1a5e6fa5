"""The strongest thing a user could run instead, timed beside taperfold's artifacts: `bench --against TOOL`.

A contender is the untapered model of the export's source (its weights, its norms real) made by another tool, in
the precision bench times (the export's dtype, or --precision), and run as that tool's users run it. It is built
once into DIR/against/TOOL-PRECISION/ (atomically, beside a `contender.json` that says what made it), reused while
that record matches, and timed in the same alternating rounds as the variants; the report names the tool, its
version, the precision and the command (BenchReport.against).

    genai-builder   onnxruntime-genai's model builder (`python -m onnxruntime_genai.models.builder ... -e cpu`),
                    run by onnxruntime-genai's own generation loop (the genai engine's runner)

Adding a contender is a class with `build` and `runner`, and one entry in CONTENDERS.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_dir, read_json_object
from taperfold.manifest import Manifest
from taperfold.runners.base import Runner

FOLDER = "against"
RECORD = "contender.json"


@dataclass
class Contender:
    name: str  # how the report labels its rows: the tool's name
    folder: Path
    info: dict[str, Any]  # tool, version, precision, command, build_s: what the report records


class GenaiBuilder:
    name: ClassVar[str] = "genai-builder"
    title: ClassVar[str] = "onnxruntime-genai model builder"
    decodes_only: ClassVar[bool] = True  # genai runs whole generations (bench --mode decode), with a growing cache
    keeps_last_token: ClassVar[bool] = True  # genai's max_length counts the last chosen token

    def check(self, manifest: Manifest, precision: str) -> None:
        from taperfold.artifacts.genai_builder import builder_missing

        if builder_missing():
            raise TaperfoldError(
                "--against genai-builder: onnxruntime-genai is not installed (pip install 'taperfold[genai]')"
            )
        if (manifest.get("source") or {}).get("format") != "huggingface":
            raise TaperfoldError(
                f"--against genai-builder: the builder reads a Hugging Face directory, and {manifest.checkpoint} "
                "(the export's source) is none"
            )
        if precision not in ("fp32", "fp16", "int4", "int8"):
            raise TaperfoldError(
                f"--against genai-builder: the builder builds fp32, fp16, int4 or int8, not {precision}"
            )
        from taperfold.artifacts.genai_builder import vocab_wide_layers
        from taperfold.sources import open_source

        wide = vocab_wide_layers(open_source(manifest.checkpoint).build_baseline())
        if len(wide) > 1:
            raise TaperfoldError(
                f"--against genai-builder: {wide[0]} has vocab_size outputs, and the builder takes every linear layer "
                "of that width for the LM head: its graph of this model would be wrong"
            )

    def version(self) -> str:
        import onnxruntime_genai

        return onnxruntime_genai.__version__

    def build(self, manifest: Manifest, precision: str, folder: Path) -> dict[str, Any]:
        """The builder on the source's plain model into `folder` (empty); what made it."""
        from taperfold.artifacts.genai_builder import builder_command
        from taperfold.quantize import BITS, Quantization
        from taperfold.sources import open_source

        extra = Quantization(precision).builder_options() if precision in BITS else []
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".against-", dir=folder.parent) as scratch:
            plain = Path(scratch) / "plain-hf"
            open_source(manifest.checkpoint).write_plain_directory(plain)
            run = subprocess.run(
                builder_command(plain, folder, precision, Path(scratch) / "cache", extra),
                capture_output=True,
                text=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
        if run.returncode != 0:
            lines = [line.strip() for line in run.stderr.splitlines() if line.strip()]
            why = lines[-1] if lines else f"exit code {run.returncode}"
            raise TaperfoldError(f"--against genai-builder: the builder failed ({why})")
        # as a user types it: the source's plain save_pretrained directory in, the folder out
        shown = builder_command(Path("PLAIN_HF_DIR"), Path("OUT"), precision, Path("CACHE"), extra)
        return {"command": " ".join(["python", *shown[1:]]), "build_s": round(time.perf_counter() - started, 1)}

    def runner(self, folder: Path, threads: int | None, label: str) -> Runner:
        from taperfold.runners.genai import GenaiRunner

        return GenaiRunner(folder, threads=threads, name=label)


CONTENDERS = {GenaiBuilder.name: GenaiBuilder()}


def contender(name: str) -> GenaiBuilder:
    if name not in CONTENDERS:
        raise TaperfoldError(f"--against must be one of {', '.join(CONTENDERS)}, got {name!r}")
    return CONTENDERS[name]


def check_contenders(names: list[str], manifest: Manifest | None, mode: str, precision: str) -> None:
    """One line for a contender bench cannot time here, before anything is built or loaded."""
    for name in names:
        tool = contender(name)
        if manifest is None:
            raise TaperfoldError(f"--against {name} builds the export's source: give an export directory (DIR)")
        if tool.decodes_only and mode != "decode":
            raise TaperfoldError(f"--against {name} runs whole generations: add --mode decode")
        tool.check(manifest, precision)


def prepare_contender(name: str, manifest: Manifest, precision: str) -> Contender:
    """The contender's folder in the export directory, built when missing or made by another version."""
    tool = contender(name)
    folder = manifest.directory / FOLDER / f"{name}-{precision}"
    wanted = {
        "tool": tool.title,
        "version": tool.version(),
        "precision": precision,
        "source": str(manifest.checkpoint),
    }
    record = folder / RECORD
    if record.is_file():
        made = read_json_object(record)
        if {k: made.get(k) for k in wanted} == wanted:
            return Contender(name, folder, made)
    with atomic_dir(folder) as tmp:
        info = {**wanted, **tool.build(manifest, precision, tmp)}
        (tmp / RECORD).write_text(json.dumps(info, indent=2) + "\n")
    return Contender(name, folder, info)
