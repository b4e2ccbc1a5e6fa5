"""The engines taperfold runs models on, one registry entry each: what an engine runs, where by default,
whether it decodes with a KV cache, which options its runner takes, and how to open one.

Two kinds of engine:
- MODELS: runs PyTorch models that taperfold builds itself (from a checkpoint or a preset);
- GRAPHS: runs the files of an export directory (ONNX graphs, or engines built from them).

The CLI's `--engine` choices and engine option flags come from ENGINES; bench and verify open runners
through it. Adding an engine is one `Engine(...)` entry (and its runner module).
Engines import their libraries (torch, onnxruntime, tensorrt) only when a runner is opened.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from taperfold.errors import TaperfoldError
from taperfold.runners.ort import OPTIMIZATION_LEVELS  # imports no runtime: cheap enough for the CLI's choices

MODELS, GRAPHS = "torch models", "exported graphs"


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


@dataclass(frozen=True)
class Engine:
    name: str
    title: str
    runs: str  # MODELS | GRAPHS
    default_device: str
    devices: tuple[str, ...]
    decodes: bool  # runs KV-cached decoders (bench --mode decode)
    options: tuple[Option, ...]
    open_runner: Callable  # (target, device=, threads=, decoder=, logits=, name=, **options) -> Runner
    unavailable: Callable[[str], str | None]  # (device) -> why this engine cannot run here, or None
    # GRAPHS only: (manifest, variants, decoder) -> {variant: file the runner opens}
    files: Callable | None = None

    def runner(self, target, *, device: str | None = None, threads: int | None = None, decoder: bool = False,
               logits: str = "last", name: str | None = None, shapes: int | None = None, **options):
        """A Runner (not loaded yet) for `target`: a torch model (MODELS) or a file (GRAPHS). `shapes`: how many
        distinct input shapes the caller will run (bench: its cells), for runners that compile per shape."""
        return self.open_runner(target, device=device or self.default_device, threads=threads, decoder=decoder,
                                logits=logits, name=name, shapes=shapes, **options)

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
            raise TaperfoldError(f"{all_options()[name].flag} applies to "
                                 f"{' or '.join(f'--engine {e}' for e in owners)} only")
    for name in options:
        option = own[name]
        if option.requires and option.requires not in options:
            raise TaperfoldError(f"{option.flag} needs {own[option.requires].flag}")
        if option.needs_cuda and device is not None and not device.startswith("cuda"):
            raise TaperfoldError(f"{option.flag} needs --device cuda")
    if options.get("compile") and options.get("cuda_graph"):
        raise TaperfoldError("--compile and --cuda-graph: choose one (--compile-mode reduce-overhead captures "
                             "CUDA graphs of the compiled model itself)")


# ---- torch -----------------------------------------------------------------------------------------------


def _open_torch(model, *, device, threads, decoder, logits, name, shapes=None, compile=False,
                compile_mode="default", cuda_graph=False):
    from taperfold.runners.torch_runner import TorchRunner

    return TorchRunner(model, device=device, compile=compile, compile_mode=compile_mode, cuda_graph=cuda_graph,
                       shapes=shapes, decoder=decoder, logits=logits, name=name or "torch model")


def _torch_unavailable(device: str) -> str | None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return "--device cuda: torch sees no CUDA device on this machine"
    return None


# ---- ONNX Runtime ----------------------------------------------------------------------------------------


def _open_ort(path, *, device, threads, decoder, logits, name, shapes=None, optimization="all", cuda_graph=False):
    from taperfold.runners.ort import OrtRunner

    return OrtRunner(path, device=device, threads=threads, optimization=optimization, cuda_graph=cuda_graph)


def _onnx_files(manifest, variants: list[str], decoder: bool) -> dict[str, Path]:
    return {v: manifest.artifact(v, decoder=decoder) for v in variants}


# ---- TensorRT --------------------------------------------------------------------------------------------


def _open_trt(path, *, device, threads, decoder, logits, name, shapes=None, cuda_graph=False):
    from taperfold.runners.trt import TrtRunner

    return TrtRunner(path, device=device, cuda_graph=cuda_graph)


def _trt_unavailable(device: str) -> str | None:
    from taperfold.trt_build import require_tensorrt

    try:
        require_tensorrt()
    except TaperfoldError as e:
        return str(e)
    return None


def _plan_files(manifest, variants: list[str], decoder: bool) -> dict[str, Path]:
    """Engines of `variants`, built from their ONNX graphs when missing or stale."""
    from taperfold.exportdir import REFERENCE_VARIANTS
    from taperfold.trt_build import ensure_engines

    for variant in variants:
        if variant in REFERENCE_VARIANTS:
            raise TaperfoldError(f"--engine trt builds no engine for the reference variant {variant!r}")
    _onnx_files(manifest, variants, decoder=False)  # the engines are built from these: name a missing one
    return ensure_engines(manifest.directory, variants)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's modes
# torch and ONNX Runtime: measured next to eager, as rows of their own; TensorRT: instead of plain enqueues
CUDA_GRAPH = Option("cuda_graph", "--cuda-graph", "Also time every shape as a replayed CUDA graph: rows of their own, "
                    "measured next to the plain runs.", needs_cuda=True)

ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("torch", "PyTorch", MODELS, default_device="cpu", devices=("cpu", "cuda"), decodes=True,
           options=(Option("compile", "--compile", "torch.compile each model on its own (no fallback to eager)."),
                    Option("compile_mode", "--compile-mode", "torch.compile mode.", default="default",
                           choices=COMPILE_MODES, requires="compile"),
                    CUDA_GRAPH),
           open_runner=_open_torch, unavailable=_torch_unavailable),
    Engine("ort", "ONNX Runtime", GRAPHS, default_device="cpu", devices=("cpu", "cuda"), decodes=True,
           options=(Option("optimization", "--ort-optimization", "ONNX Runtime graph optimization level.",
                           default="all", choices=OPTIMIZATION_LEVELS), CUDA_GRAPH),
           open_runner=_open_ort, unavailable=lambda device: None, files=_onnx_files),
    Engine("trt", "TensorRT", GRAPHS, default_device="cuda", devices=("cuda",), decodes=False,
           options=(CUDA_GRAPH,),
           open_runner=_open_trt, unavailable=_trt_unavailable, files=_plan_files),
)}


def engine(name: str) -> Engine:
    if name not in ENGINES:
        raise TaperfoldError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    return ENGINES[name]
