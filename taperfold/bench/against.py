"""The strongest thing a user could run instead, timed beside taperfold's artifacts: `bench --against TOOL`.

A contender is the untapered model of the export's source (its weights, its norms real) made by another tool, in
the precision bench times (the export's dtype, or --precision), and run as that tool's users run it. It is built
once into DIR/against/TOOL-PRECISION/ (atomically, beside a `contender.json` that says what made it), reused while
that record matches, and timed in the same alternating rounds as the variants; the report names the tool, its
version, the precision and the command (BenchReport.against).

    genai-builder   onnxruntime-genai's model builder (`python -m onnxruntime_genai.models.builder ... -e cpu`),
                    run by onnxruntime-genai's own generation loop (the genai engine's runner)
    optimum-intel   optimum-intel's OpenVINO export (`optimum-cli export openvino --weight-format ...`), a stateful
                    IR run by OpenVINO as optimum-intel's OVModelForCausalLM runs it (taperfold.runners.openvino).
                    optimum-intel pins transformers < 5.6, so it lives in an environment of its own: its
                    `optimum-cli` is found on PATH and run as a command (scripts/setup-optimum-intel)
    vllm            stock vLLM on the source's plain save_pretrained directory, run as the vllm engine runs the
                    folded checkpoint: vLLM's offline LLM, in vLLM's own environment (taperfold.runners.vllm)

Adding a contender is a class that is a `Tool`, and one entry in CONTENDERS.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_dir, check_inside, read_json_object
from taperfold.interrupts import process_group
from taperfold.manifest import Manifest
from taperfold.runners.base import Runner

FOLDER = "against"
RECORD = "contender.json"


@dataclass
class Contender:
    name: str  # how the report labels its rows: the tool's name
    folder: Path
    info: dict[str, Any]  # tool, version, precision, command, build_s: what the report records


class Tool(Protocol):
    """What bench asks of a contender's tool."""

    name: ClassVar[str]  # --against's value, and the label of its rows
    title: ClassVar[str]  # what the report calls the tool
    decodes_only: ClassVar[bool]  # runs whole generations only (bench --mode decode)
    keeps_last_token: ClassVar[bool]  # its generations count the last chosen token in the context

    def check(self, manifest: Manifest, precision: str) -> None: ...  # one line for what it cannot build or run

    def version(self) -> str: ...

    def build(self, manifest: Manifest, precision: str, folder: Path) -> dict[str, Any]: ...  # command, build_s

    def check_built(self, folder: Path) -> None: ...  # one line unless `folder` holds what the runner reads

    def runner(self, folder: Path, threads: int | None, label: str) -> Runner: ...


def _run_on_plain_model(
    name: str, tool: str, manifest: Manifest, folder: Path, command: Callable[[Path, Path], list[str]]
) -> None:
    """`command(plain, scratch)` run offline, `plain` the source's plain save_pretrained directory (its untapered
    weights) in a scratch folder beside `folder`; one line naming the tool's last error line when it fails."""
    from taperfold.sources import open_source

    with tempfile.TemporaryDirectory(prefix=".against-", dir=folder.parent) as scratch:
        plain = Path(scratch) / "plain-hf"
        open_source(manifest.checkpoint).write_plain_directory(plain)
        returncode, stderr = _run_tool(command(plain, Path(scratch)), env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if returncode != 0:
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit code {returncode}"
        raise TaperfoldError(f"--against {name}: {tool} failed ({why})")


def _run_tool(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run a contender's tool to the end: (exit code, stderr). The tool runs in a process group of its own, killed
    whole when it exits or the run stops (Ctrl-C, an error), so that no process it started (a shell's child, a worker)
    lives on writing into the folder being removed."""
    with process_group(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as process:
        _, stderr = process.communicate()
    return process.returncode, stderr


def _built_as_expected(name: str, tool: str, folder: Path, check: Callable[[], Any]) -> None:
    """One line when a tool that exited 0 left in `folder` (the temporary one) nothing its runner can read."""
    try:
        check()
    except TaperfoldError as e:
        why = str(e).replace(f"{folder}{os.sep}", "")  # the file's name; the temporary folder is gone
        raise TaperfoldError(f"--against {name}: {tool} exited 0 but wrote no usable model ({why})") from None


def _plain_huggingface(name: str, manifest: Manifest) -> None:
    if manifest.source is None or not manifest.source.is_huggingface:
        raise TaperfoldError(
            f"--against {name} builds from a Hugging Face directory, and {manifest.checkpoint} (the export's "
            "source) is none"
        )


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
        _plain_huggingface(self.name, manifest)
        if precision not in ("fp32", "fp16", "int4", "int8"):
            raise TaperfoldError(
                f"--against genai-builder: the builder builds fp32, fp16, int4 or int8, not {precision}"
            )
        from taperfold.artifacts.genai_builder import NOPE_REASON, builder_architectures, nope_layers, vocab_wide_layers
        from taperfold.sources import open_source

        window = manifest.config().window
        if window is not None:
            raise TaperfoldError(
                f"--against genai-builder: the model attends through a window of {window} tokens, shorter than its "
                "context, and the builder's folders of such a model fail in onnxruntime-genai once the past passes it"
            )
        plain = open_source(manifest.checkpoint).build_baseline()
        architecture, known = type(plain.network).__name__, builder_architectures()
        if known and architecture not in known:
            raise TaperfoldError(f"--against genai-builder: onnxruntime-genai's builder does not build {architecture}")
        no_rope = nope_layers(getattr(plain.network, "config", None))  # a network of no Hugging Face config has none
        if no_rope:
            raise TaperfoldError(f"--against genai-builder: {NOPE_REASON.format(layer=no_rope[0])}")
        wide = vocab_wide_layers(plain)
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
        from taperfold.artifacts.genai_builder import builder_command, drop_unused_window
        from taperfold.quantize import BITS, Quantization

        extra = Quantization(precision).builder_options() if precision in BITS else []
        started = time.perf_counter()
        _run_on_plain_model(
            self.name,
            "the builder",
            manifest,
            folder,
            lambda plain, scratch: builder_command(plain, folder, precision, scratch / "cache", extra),
        )
        drop_unused_window(folder)  # the builder's window section for a config whose layers use none (SmolLM3)
        # as a user types it: the source's plain save_pretrained directory in, the folder out
        shown = builder_command(Path("PLAIN_HF_DIR"), Path("OUT"), precision, Path("CACHE"), extra)
        return {"command": " ".join(["python", *shown[1:]]), "build_s": round(time.perf_counter() - started, 1)}

    def check_built(self, folder: Path) -> None:
        from taperfold.genai_config import check_genai_folder

        _built_as_expected(self.name, "the builder", folder, lambda: check_genai_folder(folder))

    def runner(self, folder: Path, threads: int | None, label: str) -> Runner:
        from taperfold.runners.genai import GenaiRunner

        return GenaiRunner(folder, threads=threads, name=label)


class OptimumIntel:
    name: ClassVar[str] = "optimum-intel"
    title: ClassVar[str] = "optimum-intel OpenVINO export"
    decodes_only: ClassVar[bool] = True  # a stateful IR: whole generations, its cache growing in the state
    keeps_last_token: ClassVar[bool] = False
    PRECISIONS: ClassVar[tuple[str, ...]] = ("fp32", "int8", "int4")  # --weight-format; run at f32 precision
    SETUP: ClassVar[str] = (
        "optimum-intel pins transformers < 5.6: make it an environment of its own (scripts/setup-optimum-intel DIR) "
        "and put DIR/bin on PATH"
    )

    def cli(self) -> Path:
        found = shutil.which("optimum-cli")
        if found is None:
            raise TaperfoldError(f"--against {self.name}: optimum-cli is not on PATH ({self.SETUP})")
        return Path(found)

    def check(self, manifest: Manifest, precision: str) -> None:
        from taperfold.runners.openvino import openvino

        try:
            openvino()
        except TaperfoldError:
            raise TaperfoldError(
                f"--against {self.name}: openvino, which runs its export here, is not installed "
                "(pip install 'taperfold[openvino]')"
            ) from None
        self.cli()
        _plain_huggingface(self.name, manifest)
        if precision not in self.PRECISIONS:
            raise TaperfoldError(
                f"--against {self.name}: bench times its {', '.join(self.PRECISIONS)} weights, not {precision}"
            )
        self.version()

    def version(self) -> str:
        """optimum-intel's version, asked of the Python its optimum-cli runs on (the first line of the script)."""
        cli = self.cli()
        with cli.open("rb") as script:
            first = script.readline(4096).decode(errors="replace")
        words = first[2:].split() if first.startswith("#!") else []
        if words and Path(words[0]).name == "env":
            words = words[1:]
        ask = "from importlib.metadata import version; print(version('optimum-intel'), version('openvino'))"
        try:
            run = subprocess.run([*words[:1], "-c", ask], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            run = None
        if run is None or run.returncode != 0 or len(run.stdout.split()) != 2:
            raise TaperfoldError(
                f"--against {self.name}: {cli} does not run in an environment with optimum-intel and openvino "
                f"({self.SETUP})"
            )
        optimum, openvino = run.stdout.split()
        return f"{optimum} (openvino {openvino})"

    def command(self, plain: Path, folder: Path, precision: str) -> list[str]:
        task = ["--task", "text-generation-with-past", "--weight-format", precision]
        if precision == "int4":
            # its groups of 128 where they divide a layer's width, smaller where not (576 = 4.5·128)
            task += ["--group-size-fallback", "adjust"]
        return [str(self.cli()), "export", "openvino", "-m", str(plain), *task, str(folder)]

    def build(self, manifest: Manifest, precision: str, folder: Path) -> dict[str, Any]:
        """optimum-cli on the source's plain model into `folder` (empty); what made it."""
        started = time.perf_counter()
        _run_on_plain_model(
            self.name, "optimum-cli", manifest, folder, lambda plain, scratch: self.command(plain, folder, precision)
        )
        shown = ["optimum-cli", *self.command(Path("PLAIN_HF_DIR"), Path("OUT"), precision)[1:]]
        return {"command": " ".join(shown), "build_s": round(time.perf_counter() - started, 1)}

    def check_built(self, folder: Path) -> None:
        from taperfold.runners.openvino import checked_model_files
        from taperfold.runners.openvino_ir import MODEL

        _built_as_expected(self.name, "optimum-cli", folder, lambda: checked_model_files(folder / MODEL))

    def runner(self, folder: Path, threads: int | None, label: str) -> Runner:
        from taperfold.runners.openvino_ir import StatefulOpenVinoRunner

        return StatefulOpenVinoRunner(folder, threads=threads, name=label)


class StockVllm:
    """The untapered model as vLLM's users serve it: stock vLLM on the source's plain save_pretrained directory (its
    weights, its norms real, no taperfold block or buffers, which stock vLLM refuses: it names every tensor of a
    directory it loads), written into the contender's folder, run as the vllm engine runs the folded checkpoint
    (taperfold.runners.vllm: vLLM's offline LLM in vLLM's environment)."""

    name: ClassVar[str] = "vllm"
    title: ClassVar[str] = "stock vLLM"
    decodes_only: ClassVar[bool] = True
    keeps_last_token: ClassVar[bool] = False
    MODEL: ClassVar[str] = "plain-hf"  # the plain directory, in the contender's folder

    def check(self, manifest: Manifest, precision: str) -> None:
        from taperfold.runners.vllm import DTYPES, environment_problem

        problem = environment_problem()
        if problem:
            raise TaperfoldError(f"--against {self.name}: {problem}")
        _plain_huggingface(self.name, manifest)
        if precision not in DTYPES:
            raise TaperfoldError(
                f"--against {self.name}: vLLM serves the source in {', '.join(DTYPES)}, not {precision}"
            )

    def version(self) -> str:
        from taperfold.runners.vllm import vllm_python, vllm_version

        python = vllm_python()
        return vllm_version(python) if python is not None else "unknown"

    def build(self, manifest: Manifest, precision: str, folder: Path) -> dict[str, Any]:
        from taperfold.runners.vllm import DTYPES
        from taperfold.sources import open_source

        started = time.perf_counter()
        open_source(manifest.checkpoint).write_plain_directory(folder / self.MODEL)
        dtype = DTYPES[precision]
        command = f"python -m vllm.entrypoints.openai.api_server --model PLAIN_HF_DIR --dtype {dtype}"
        return {"dtype": dtype, "command": command, "build_s": round(time.perf_counter() - started, 1)}

    def check_built(self, folder: Path) -> None:
        _built_as_expected(
            self.name, "save_pretrained", folder, lambda: read_json_object(folder / self.MODEL / "config.json")
        )

    def runner(self, folder: Path, threads: int | None, label: str) -> Runner:
        from taperfold.runners.vllm import VllmRunner

        made = read_json_object(folder / RECORD)
        return VllmRunner(folder / self.MODEL, threads=threads, name=label, dtype=made["dtype"])


CONTENDERS: dict[str, Tool] = {
    GenaiBuilder.name: GenaiBuilder(),
    OptimumIntel.name: OptimumIntel(),
    StockVllm.name: StockVllm(),
}


def contender(name: str) -> Tool:
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
    check_inside(folder, manifest.directory)  # DIR/against or its folder planted as a link: refused, never followed
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
    with atomic_dir(folder, manifest.directory) as tmp:
        info = {**wanted, **tool.build(manifest, precision, tmp)}
        tool.check_built(tmp)  # a tool that exits 0 having written nothing, or garbage: refused, nothing kept
        (tmp / RECORD).write_text(json.dumps(info, indent=2) + "\n")
    return Contender(name, folder, info)
