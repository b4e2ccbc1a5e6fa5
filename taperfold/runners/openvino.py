"""OpenVINO on the CPU: the exported ONNX graphs (prefill, growing and static decoders; `--engine openvino`). The
stateful IR (taperfold's `--engine openvino-ir`, optimum-intel's export) runs in taperfold.runners.openvino_ir.

OpenVINO's ONNX frontend reads the graphs as they are, standard ops and ONNX Runtime's MatMulNBits alike. Every model
is compiled for the CPU with the latency hint and `threads` inference threads, and the inference precision pinned to
f32: on a CPU with bf16 units OpenVINO would otherwise run an fp32 graph in bf16, which is another model than the one
exported (and than the one ONNX Runtime runs). The KV cache a stateful model keeps inside
(taperfold.runners.openvino_ir) is pinned to f32 for the same reason: OpenVINO's CPU default stores it in u8. Outputs
are copied out of the request (a KV cache's presents are fed back as the next step's pasts, and the request reuses its
buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from taperfold.environment import install_hint
from taperfold.errors import TaperfoldError, first_line
from taperfold.runners.base import InputSpec, Runner

INSTALL = install_hint("openvino")


def openvino(engine: str = "openvino"):
    try:
        import openvino as ov
    except ImportError:
        raise TaperfoldError(f"--engine {engine}: openvino is not installed ({INSTALL})") from None
    return ov


class OpenVinoRunner(Runner):
    name = "openvino"

    def __init__(self, path: str | Path, device: str = "cpu", threads: int | None = None):
        if device != "cpu":
            raise TaperfoldError(f"--engine openvino runs on the CPU here, not {device!r}")
        super().__init__(str(path), device)
        self.path = Path(path)
        self.threads = threads
        self._compiled: Any = None
        self._request: Any = None

    def _load(self) -> None:
        self._compiled = compile_for_cpu(self, self.path, self.threads)
        self._request = self._compiled.create_infer_request()
        inputs = self._compiled.inputs
        self._inputs = [i.any_name for i in inputs]
        self._outputs = [o.any_name for o in self._compiled.outputs]
        self._specs = {
            i.any_name: InputSpec(rank=i.partial_shape.rank.get_length(), floating=i.element_type.is_real())
            for i in inputs
        }

    def _prepare(self, feeds: dict[str, Any]) -> dict[str, np.ndarray]:
        return {name: np.ascontiguousarray(value) for name, value in feeds.items()}

    def _launcher(self, prepared: dict[str, np.ndarray]) -> Callable[[], dict[str, Any]]:
        request, outputs = self._request, self._compiled.outputs

        def run() -> dict[str, Any]:
            try:
                results = request.infer(prepared, share_inputs=True, share_outputs=False)
            except RuntimeError as e:
                raise self.error(f"OpenVINO run failed ({openvino_reason(e)})") from None
            return {o.any_name: results[o] for o in outputs}

        return run

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def _close(self) -> None:
        self._request = self._compiled = None


def compile_for_cpu(runner: Runner, path: Path, threads: int | None) -> Any:
    ov = openvino()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    files = checked_model_files(path)
    try:
        core = ov.Core()
        return core.compile_model(core.read_model(*map(str, files)), "CPU", config)
    except RuntimeError as e:
        raise runner.error(f"OpenVINO cannot compile it ({openvino_reason(e)})") from None


def checked_model_files(path: Path) -> tuple[Path, ...]:
    """The files OpenVINO is to read for the model at `path`, checked before it opens one: an IR's .xml and its .bin
    beside it, regular files (a FIFO would block the reader), the .xml an IR's XML (`<net>`: anything else OpenVINO
    hands to each of its frontends in turn, some of which print to the terminal); an ONNX graph with its data beside
    it and only built-in ops (taperfold.onnx_files)."""
    from xml.etree.ElementTree import ParseError, XMLPullParser

    from taperfold.infiles import check_plain_file, read_file_head
    from taperfold.onnx_files import check_onnx_file, check_op_domains

    if path.suffix != ".xml":
        check_op_domains(check_onnx_file(path), path)
        return (path,)
    parser: XMLPullParser = XMLPullParser(events=("start",))
    try:
        parser.feed(read_file_head(path, "an OpenVINO IR", 4096))
        started = [event[-1] for event in parser.read_events()]  # ("start", the element) of each tag opened
    except ParseError as e:
        raise TaperfoldError(f"{path}: not an OpenVINO IR (not XML: {e})") from None
    if not started or getattr(started[0], "tag", None) != "net":
        raise TaperfoldError(f"{path}: not an OpenVINO IR (its XML is no <net>)")
    weights = path.with_suffix(".bin")
    check_plain_file(weights, "the OpenVINO IR's weights")
    return path, weights


def openvino_reason(error: Exception) -> str:
    """What OpenVINO says went wrong: the last line of its message (the first ones name its own source files)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else first_line(error)


# ---- the engine (taperfold.engines' "openvino" row) ----------------------------------------------------------


def open_runner(path, *, device, threads, graph, logits, name, shapes=None) -> OpenVinoRunner:
    return OpenVinoRunner(path, device=device, threads=threads)


def unavailable(device: str, engine: str = "openvino") -> str | None:
    try:
        openvino(engine)
    except TaperfoldError as e:
        return str(e)
    return None if device == "cpu" else f"--engine {engine} runs on the CPU here, not {device}"
