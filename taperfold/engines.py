"""The engines taperfold runs models on: one table, a row per engine, each naming its runner module.

A row says what the engine runs, where by default, whether it runs single prefill calls and which KV caches it
decodes with, and which options its runner takes; the CLI's `--engine` choices and option flags come from this
table. The runner module (taperfold.runners.NAME) does the rest, imported only when the engine is used (so
`taperfold --help` loads no torch, onnxruntime or tensorrt). It defines:

    open_runner(target, *, device, threads, graph, logits, name, shapes, **options) -> Runner
    unavailable(device) -> why the engine cannot run here, or None

An engine runs either MODELS, the PyTorch models taperfold builds itself (from a checkpoint or a preset), or the
artifacts of one kind in an export directory (taperfold.artifacts: `onnx` graphs, run by ONNX Runtime or OpenVINO;
`tensorrt-plan` engines; `genai` folders); the kind finds (and, for engines built on demand, builds) the files, so
runners only load and run.

Adding an engine is its runner module plus one row here (docs/extending.md). `open_runners` loads the
runners of a run up front and closes them all: bench (whose variants are timed in alternating rounds) and fold
--verify; verify loads one model at a time, prefill and decoders alike (a model past 2 GB is never held twice).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from taperfold.errors import TaperfoldError
from taperfold.exportdir import GROWING, KV_CACHES, PREFILL, VARIANTS, Graph

if TYPE_CHECKING:
    from pathlib import Path

    from taperfold.manifest import Manifest

MODELS = "torch models"


@dataclass(frozen=True)
class Option:
    """One keyword option of an engine's runner, and the CLI flag that sets it."""

    name: str  # the runner's keyword argument
    flag: str
    help: str
    default: Any = False  # False: an on/off flag
    choices: tuple[str, ...] | None = None
    needs_cuda: bool = False  # only meaningful on a CUDA device: refused elsewhere with one line
    requires: str | None = None  # another option (runner keyword) this one only refines, e.g. compile_mode
    excludes: tuple[str, str] | None = None  # (another option it cannot go with, why)


@dataclass(frozen=True)
class Engine:
    name: str
    title: str
    runs: str  # MODELS, or the artifact kind it runs (taperfold.artifacts)
    default_device: str
    devices: tuple[str, ...]
    decodes: bool  # runs KV-cached decoders (bench --mode decode)
    options: tuple[Option, ...]
    module: Any  # its runner module's dotted name (imported on first use), or the module itself
    caches: tuple[Graph, ...] = KV_CACHES  # the KV caches it decodes with, when it decodes
    prefills: bool = True  # runs single prefill calls (False: whole generations only, bench --mode decode)
    # its generations count the last chosen token (never run) in the context too: onnxruntime-genai's max_length
    keeps_last_token: bool = False
    # serves an OpenAI-compatible server that bench --mode serve drives (taperfold.bench.serve: vLLM's)
    serves: bool = False
    # (device, dtype) pairs it has no kernels for: its runner refuses such a model when it loads
    lacks_kernels: tuple[tuple[str, str], ...] = ()

    def _runner_module(self):
        return importlib.import_module(self.module) if isinstance(self.module, str) else self.module

    def runner(
        self,
        target,
        *,
        device: str | None = None,
        threads: int | None = None,
        graph: Graph = PREFILL,
        logits: str = "last",
        name: str | None = None,
        shapes: int | None = None,
        **options,
    ):
        """A Runner (not loaded yet) of `graph` (prefill, or a decoder) for `target`: a torch model (MODELS) or an
        artifact's file. `shapes`: how many distinct input shapes the caller will run (bench: its cells), for runners
        that compile per shape."""
        return self._runner_module().open_runner(
            target,
            device=device or self.default_device,
            threads=threads,
            graph=graph,
            logits=logits,
            name=name,
            shapes=shapes,
            **options,
        )

    def unavailable(self, device: str) -> str | None:
        """Why this engine cannot run on `device` here (a library or the device missing), or None."""
        return self._runner_module().unavailable(device)

    @property
    def runs_models(self) -> bool:
        return self.runs == MODELS

    @property
    def feeds_cache_from_host(self) -> bool:
        """Its decoders take the KV cache as host arrays at every step (the ONNX graphs' engines); torch models and
        whole-generation engines (onnxruntime-genai, OpenVINO's stateful IR, vLLM) keep their own."""
        return not self.runs_models and self.prefills

    @property
    def only_variants(self) -> tuple[str, ...] | None:
        """The only variants this engine has anything to run of (its artifact kind's `variants`: vLLM's checkpoint is
        the folded model's alone); None: any variant."""
        if self.runs_models:
            return None
        from taperfold.artifacts import artifact_kind

        return artifact_kind(self.runs).variants

    @property
    def default_variants(self) -> tuple[str, ...]:
        """What bench times when --variants is not given: the only variants it runs, else all of VARIANTS."""
        return self.only_variants or VARIANTS

    def files(
        self, manifest: Manifest, variants: list[str], graph: Graph, precision: str | None = None
    ) -> dict[str, Path]:
        """{variant: the file its runner opens}: the artifacts of the kind this engine runs in `precision` (default:
        the export's dtype), which that kind finds in `manifest` (or builds first, where it builds on demand)."""
        from taperfold.artifacts import artifact_kind

        return artifact_kind(self.runs).files(manifest, variants, graph, precision)

    def projection_groups(
        self, manifest: Manifest, variant: str, graph: Graph, precision: str | None = None
    ) -> int | None:
        """The sibling-projection groups `variant`'s artifact of the kind this engine runs fuses (None: the kind
        cannot tell)."""
        from taperfold.artifacts import artifact_kind

        record = manifest.find(variant, graph, self.runs, precision)
        return None if record is None else artifact_kind(self.runs).projection_groups(manifest, record)

    def require(self, device: str) -> None:
        why = self.unavailable(device)
        if why:
            raise TaperfoldError(why)


def all_options() -> dict[str, Option]:
    """Every engine option once, by runner keyword (engines may share one, e.g. --cuda-graph)."""
    return {o.name: o for e in ENGINES.values() for o in e.options}


def changed_options(values: dict[str, Any]) -> dict[str, Any]:
    """The options (runner keyword -> value, any engine's) whose value is not the default: what the user set."""
    defaults = {name: o.default for name, o in all_options().items()}
    return {name: value for name, value in values.items() if value != defaults[name]}


def check_options(engine: Engine, options: dict[str, Any], device: str | None = None) -> None:
    """`options` (runner keyword -> value, only those the user set) must all belong to `engine`, fit `device`
    (when given) and come with the options they refine."""
    own = {o.name: o for o in engine.options}
    for name in options:
        if name not in own:
            owners = [e.name for e in ENGINES.values() if any(o.name == name for o in e.options)]
            raise TaperfoldError(
                f"{all_options()[name].flag} applies to {' or '.join(f'--engine {e}' for e in owners)} only"
            )
    for name in options:
        option = own[name]
        if option.requires and option.requires not in options:
            raise TaperfoldError(f"{option.flag} needs {own[option.requires].flag}")
        if option.needs_cuda and device is not None and not device.startswith("cuda"):
            raise TaperfoldError(f"{option.flag} needs --device cuda")
        if option.excludes and options.get(name) and options.get(option.excludes[0]):
            other, why = option.excludes
            raise TaperfoldError(f"{option.flag} and {all_options()[other].flag}: choose one ({why})")


@contextlib.contextmanager
def open_runners(runners: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Load every runner of a run up front, before anything is timed or compared; close them all afterwards
    (those loaded so far, when one fails to load)."""
    loaded = []
    try:
        for runner in runners.values():
            runner.load()
            loaded.append(runner)
        yield runners
    finally:
        for runner in loaded:
            runner.close()


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's modes
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")  # ONNX Runtime's graph optimization levels
# torch and ONNX Runtime: measured next to eager, as rows of their own; TensorRT: instead of plain enqueues
CUDA_GRAPH = Option(
    "cuda_graph",
    "--cuda-graph",
    "Also time every shape as a replayed CUDA graph: rows of their own, measured next to the plain runs.",
    needs_cuda=True,
)

ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine(
            "torch",
            "PyTorch",
            MODELS,
            default_device="cpu",
            devices=("cpu", "cuda"),
            decodes=True,
            options=(
                Option(
                    "compile",
                    "--compile",
                    "torch.compile each model on its own (no fallback to eager).",
                    excludes=(
                        "cuda_graph",
                        "--compile-mode reduce-overhead captures CUDA graphs of the compiled model itself",
                    ),
                ),
                Option(
                    "compile_mode",
                    "--compile-mode",
                    "torch.compile mode.",
                    default="default",
                    choices=COMPILE_MODES,
                    requires="compile",
                ),
                CUDA_GRAPH,
            ),
            module="taperfold.runners.torch_runner",
        ),
        Engine(
            "ort",
            "ONNX Runtime",
            "onnx",
            default_device="cpu",
            devices=("cpu", "cuda"),
            decodes=True,
            lacks_kernels=(("cpu", "bf16"),),  # its CPU provider: "Could not find an implementation for Mul(14)"
            options=(
                Option(
                    "optimization",
                    "--ort-optimization",
                    "ONNX Runtime graph optimization level.",
                    default="all",
                    choices=OPTIMIZATION_LEVELS,
                ),
                CUDA_GRAPH,
            ),
            module="taperfold.runners.ort",
        ),
        Engine(
            "trt",
            "TensorRT",
            "tensorrt-plan",
            default_device="cuda",
            devices=("cuda",),
            decodes=False,
            options=(CUDA_GRAPH,),
            module="taperfold.runners.trt",
        ),
        Engine(
            "genai",
            "onnxruntime-genai",
            "genai",
            default_device="cpu",
            devices=("cpu",),
            decodes=True,
            options=(),
            module="taperfold.runners.genai",
            caches=(GROWING,),
            prefills=False,
            keeps_last_token=True,
        ),
        Engine(
            "openvino",
            "OpenVINO",
            "onnx",
            default_device="cpu",
            devices=("cpu",),
            decodes=True,
            options=(),
            module="taperfold.runners.openvino",
        ),
        Engine(
            "openvino-ir",
            "OpenVINO (stateful IR)",
            "openvino",
            default_device="cpu",
            devices=("cpu",),
            decodes=True,
            options=(),
            module="taperfold.runners.openvino_ir",
            caches=(GROWING,),
            prefills=False,
        ),
        Engine(
            "vllm",
            "vLLM",
            "vllm",
            default_device="cpu",
            devices=("cpu",),
            decodes=True,
            options=(),
            module="taperfold.runners.vllm",
            caches=(GROWING,),  # its own paged cache, which grows with the sequence
            prefills=False,
            serves=True,
        ),
    )
}


def engines_running(kind: str) -> list[Engine]:
    """The engines that run artifacts of `kind`."""
    return [e for e in ENGINES.values() if e.runs == kind]


def register(engine: Engine) -> Engine:
    """Add (or replace) an engine: library calls take it at once; the CLI's choices are those known when
    taperfold.cli is imported."""
    ENGINES[engine.name] = engine
    return engine


def engine(name: str) -> Engine:
    if name not in ENGINES:
        raise TaperfoldError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    return ENGINES[name]
