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

A kind from outside the package: `register_kind(MyKind())` (examples/plugin_artifact.py), in the process that uses
it, or from an installed package's entry point in the group `taperfold.artifact_kinds` (as vLLM's
`vllm.general_plugins`): a function that registers its kinds, called once by `load_plugins` (the command line calls
it before it offers `taperfold export`'s options, and a kind not registered here is looked for there).

    [project.entry-points."taperfold.artifact_kinds"]
    my-kind = "my_package.my_kind:register"

Order: `kind_names()`, the shipped kinds in the table's order, then the others in registration order. A kind is
registered only after the kind it is built from (`register_kind` refuses it before), so this order builds what a
kind is built from first (`in_build_order`: how an export builds the artifacts it is asked for), and it is the order
`taperfold export --help` lists the kinds' options in.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable, Mapping
from typing import Any

from taperfold.artifacts.base import EXPORT, TORCH, ArtifactKind, ExportRequest, Option
from taperfold.errors import TaperfoldError, first_line

PLUGIN_GROUP = "taperfold.artifact_kinds"

ONNX, TENSORRT_PLAN, GENAI, OPENVINO, VLLM = "onnx", "tensorrt-plan", "genai", "openvino", "vllm"
_SHIPPED = {
    ONNX: "taperfold.artifacts.onnx_graph",
    TENSORRT_PLAN: "taperfold.artifacts.tensorrt_plan",
    GENAI: "taperfold.artifacts.genai_folder",
    OPENVINO: "taperfold.artifacts.openvino_ir",
    VLLM: "taperfold.artifacts.vllm_checkpoint",
}
_KINDS: dict[str, ArtifactKind] = {}
_plugins_loaded = False


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
        load_plugins()
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


def load_plugins() -> None:
    """Call, once per process, each installed entry point of PLUGIN_GROUP (a function that registers kinds); one
    line naming the entry point that fails."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            entry.load()()
        except Exception as e:
            _plugins_loaded = False  # asked again, it fails again, as plainly
            raise TaperfoldError(f"artifact kind plug-in {entry.name!r} ({entry.value}): {first_line(e)}") from e


def all_kinds() -> list[ArtifactKind]:
    """Every kind, shipped (each imported here) and registered (plug-ins loaded), in `kind_names()` order."""
    load_plugins()
    return [artifact_kind(name) for name in kind_names()]


def in_build_order(names: Iterable[str]) -> list[str]:
    """`names` in `kind_names()` order: each after the kind it is built from."""
    order = kind_names()
    wanted = list(names)
    for name in wanted:
        artifact_kind(name)  # one line for a kind not known here
    return sorted(wanted, key=order.index)


def command_options() -> list[tuple[ArtifactKind, Option]]:
    """Every registered kind's options, each once, with the kind that declared it first: one option may be declared
    by several kinds (a shared one, imported from the kind that owns it), but not two options with one flag or key."""
    seen: dict[str, tuple[ArtifactKind, Option]] = {}
    for kind in all_kinds():
        for option in kind.options:
            for name in (option.flag, option.key):
                first = seen.get(name)
                if first is not None and first[1] != option:
                    raise TaperfoldError(
                        f"artifact kind {kind.name!r}: option {option.flag} ({option.key}) clashes with "
                        f"{first[1].flag} ({first[1].key}) of kind {first[0].name!r}"
                    )
            seen.setdefault(option.flag, (kind, option))
            seen.setdefault(option.key, (kind, option))
    return list({id(option): (kind, option) for kind, option in seen.values()}.values())


def requests(given: Mapping[str, Any], export: ExportRequest) -> dict[str, Any]:
    """The requests the command-line values `given` (by option key; a missing one, or None: not given) make, by kind
    name in build order: each option's value parsed once (Option.value), then each kind's `request` of them all."""
    options = [option for _, option in command_options()]
    values = {option.key: option.value(given.get(option.key)) for option in options}
    made = {}
    for kind in all_kinds():
        request = kind.request(values, export)
        if request is not None:
            made[kind.name] = request
    return made


def reads_graphs(name: str) -> bool:
    """Whether kind `name` is made from the export's ONNX graphs: the graphs' own kind (their quantized forms), or a
    kind built from them, directly or through another kind."""
    kind = artifact_kind(name)
    return name == ONNX or (kind.built_from not in (TORCH, EXPORT) and reads_graphs(kind.built_from))


def default_target(names: Iterable[str]) -> str:
    """What the graphs are traced for when --target is not given: the first asked-for kind's own target, else ort."""
    return next((t for t in (artifact_kind(n).target for n in names) if t is not None), "ort")
