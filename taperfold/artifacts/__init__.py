"""The artifact kinds taperfold writes into an export directory: a registry, as for families, norm kinds, engines
and sources. A kind is one module (a subclass of `ArtifactKind`, taperfold.artifacts.base) plus one registration;
the manifest (taperfold.manifest) records every artifact with its kind, and verify, bench and the engines ask the
kind what to do with it, never "which kind is this?".

Shipped kinds (each module imported on first use, so that `taperfold --help` loads no onnx or tensorrt):

    onnx            ONNX graphs of the variants (prefill and decoders), written by `taperfold export`   onnx_graph.py
    tensorrt-plan   TensorRT engines built from the ONNX graphs (`export --trt`, `bench --engine trt`)  tensorrt_plan.py
    genai           onnxruntime-genai folders of the growing-cache decoders (`export --genai`)        genai_folder.py
    openvino        OpenVINO stateful IR folders of the torch variants (`export --openvino`)         openvino_ir.py
    vllm            a folded Hugging Face-style checkpoint vLLM serves (`export --vllm`)          vllm_checkpoint.py

A kind from outside the package: `register_kind(MyKind())` (examples/plugin_artifact.py).
"""

from __future__ import annotations

import importlib

from taperfold.artifacts.base import ArtifactKind
from taperfold.errors import TaperfoldError

ONNX, TENSORRT_PLAN, GENAI, OPENVINO, VLLM = "onnx", "tensorrt-plan", "genai", "openvino", "vllm"
_SHIPPED = {
    ONNX: "taperfold.artifacts.onnx_graph",
    TENSORRT_PLAN: "taperfold.artifacts.tensorrt_plan",
    GENAI: "taperfold.artifacts.genai_folder",
    OPENVINO: "taperfold.artifacts.openvino_ir",
    VLLM: "taperfold.artifacts.vllm_checkpoint",
}
_KINDS: dict[str, ArtifactKind] = {}


def register_kind(kind: ArtifactKind) -> ArtifactKind:
    """Add (or replace) an artifact kind; one line naming what is wrong when it is declared wrong."""
    errors = kind.declaration_errors(kind_names())
    if errors:
        raise TaperfoldError(f"artifact kind {getattr(kind, 'name', type(kind).__name__)!r}: {'; '.join(errors)}")
    _KINDS[kind.name] = kind
    return kind


def artifact_kind(name: str) -> ArtifactKind:
    """The kind named `name` (a shipped one is imported here), or one line saying it is not known here."""
    if name not in _KINDS and name in _SHIPPED:
        importlib.import_module(_SHIPPED[name])  # the module registers its kind
    if name not in _KINDS:
        raise TaperfoldError(
            f"artifact kind {name!r} is not registered here (known: {', '.join(kind_names())}); "
            "a plug-in that adds it must be imported first"
        )
    return _KINDS[name]


def is_registered(name: str) -> bool:
    return name in _KINDS or name in _SHIPPED


def kind_names() -> list[str]:
    return list(dict.fromkeys([*_SHIPPED, *_KINDS]))
