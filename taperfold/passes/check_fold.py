"""`taperfold fold --verify`: run a model and its fold in ONNX Runtime on inputs made from the graph's
signature, and hold every output pair to the fold's tolerance (taperfold.compare).

Inputs: integer ids that an embedding looks up (Gather from a constant table) are drawn within the
table's rows; an input named like a mask is ones, one named like positions counts 0, 1, 2, ...; float
inputs are standard normal. Dynamic dimensions come from `--shapes NAME:1x16,...`, else a dimension
name already fixed by another input, else 1 for the first axis and 16 for the others.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import onnx_ir as ir

from taperfold.compare import Metrics, Tolerance, compare_logits, default_tolerance, violations
from taperfold.errors import TaperfoldError

_DTYPE_NAMES = {ir.DataType.FLOAT: "fp32", ir.DataType.DOUBLE: "fp32", ir.DataType.FLOAT16: "fp16",
                ir.DataType.BFLOAT16: "bf16"}
_INDEX_PATH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}


def parse_shapes(text: str | None) -> dict[str, list[int]]:
    """'input_ids:1x16,attention_mask:1x16' -> {'input_ids': [1, 16], ...}."""
    shapes = {}
    for part in filter(None, (text or "").split(",")):
        name, _, dims = part.strip().rpartition(":")
        if not name or not re.fullmatch(r"\d+(x\d+)*", dims):
            raise TaperfoldError(f"--shapes: {part!r} is not NAME:DIMxDIM... (e.g. input_ids:1x16)")
        shapes[name] = [int(d) for d in dims.split("x")]
    return shapes


def _lookup_rows(value: ir.Value, depth: int = 4) -> int | None:
    """Rows of the constant table that `value` indexes (through Cast/Reshape/...), if any."""
    for use in value.uses():
        node = use.node
        if node.domain == "" and node.op_type == "Gather" and use.idx == 1:
            table = node.inputs[0]
            if table is not None and table.const_value is not None and node.attributes.get_int("axis", 0) == 0:
                return table.const_value.shape[0]
        if depth and node.domain == "" and node.op_type in _INDEX_PATH and use.idx == 0:
            if (rows := _lookup_rows(node.outputs[0], depth - 1)) is not None:
                return rows
    return None


def make_feeds(model: ir.Model, shapes: dict[str, list[int]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    inputs = [v for v in model.graph.inputs if not v.is_initializer()]
    if unknown := set(shapes) - {v.name for v in inputs}:
        raise TaperfoldError(f"--shapes: no graph input named {sorted(unknown)[0]!r} "
                             f"(inputs: {', '.join(v.name for v in inputs)})")
    named: dict[str, int] = {}
    for value in inputs:  # dimension names fixed by the user's shapes apply to every input
        if value.name in shapes and value.shape is not None:
            if len(shapes[value.name]) != len(value.shape):
                raise TaperfoldError(f"--shapes: {value.name} has rank {len(value.shape)}, "
                                     f"got {len(shapes[value.name])} dims")
            for dim, size in zip(value.shape, shapes[value.name]):
                if not isinstance(dim, int) and dim.value:
                    named.setdefault(dim.value, size)
    feeds = {}
    for value in inputs:
        if value.shape is None and value.name not in shapes:
            raise TaperfoldError(f"input '{value.name}' has no recorded shape: give it with --shapes {value.name}:...")
        dims = shapes.get(value.name) or [
            dim if isinstance(dim, int) else named.setdefault(dim.value, 1 if i == 0 else 16) if dim.value
            else (1 if i == 0 else 16)
            for i, dim in enumerate(value.shape)]
        dtype = value.dtype.numpy() if value.dtype is not None else np.float32
        name = value.name.lower()
        if np.issubdtype(dtype, np.floating):
            feeds[value.name] = rng.standard_normal(dims).astype(dtype)
        elif (rows := _lookup_rows(value)) is not None:
            feeds[value.name] = rng.integers(0, rows, dims).astype(dtype)
        elif "mask" in name:
            feeds[value.name] = np.ones(dims, dtype)
        elif "position" in name and dims:
            feeds[value.name] = np.broadcast_to(np.arange(dims[-1]), dims).astype(dtype)
        elif dtype == np.bool_:
            feeds[value.name] = np.ones(dims, np.bool_)
        else:
            feeds[value.name] = np.zeros(dims, dtype)
    return feeds


@dataclasses.dataclass
class OutputCheck:
    name: str
    metrics: Metrics | None  # None for non-float outputs, compared for equality
    tolerance: Tolerance | None
    violations: list[str]

    @property
    def passed(self) -> bool:
        return not self.violations


@dataclasses.dataclass
class FoldCheck:
    inputs: dict[str, list[int]]
    outputs: list[OutputCheck]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def failure_message(self) -> str:
        bad = [o for o in self.outputs if not o.passed]
        return "; ".join(f"unfolded -> folded, output '{o.name}': {', '.join(o.violations)}" for o in bad)

    def to_dict(self) -> dict:
        return {"inputs": self.inputs, "passed": self.passed,
                "outputs": [{"name": o.name, "status": "pass" if o.passed else "fail",
                             "metrics": o.metrics.to_dict() if o.metrics else None,
                             "tolerance": o.tolerance.to_dict() if o.tolerance else None,
                             "violations": o.violations} for o in self.outputs]}


def check_fold(src: str | os.PathLike, dst: str | os.PathLike, shapes: dict[str, list[int]] | None = None,
               seed: int = 0, threads: int | None = None) -> FoldCheck:
    """Run `src` and `dst` on the same generated inputs and compare every output."""
    from taperfold.engines import ENGINES, open_runners
    from taperfold.passes.onnx_io import load_model

    feeds = make_feeds(load_model(src), shapes or {}, seed)
    ort = ENGINES["ort"]
    runners = {"input": ort.runner(src, device="cpu", threads=threads),
               "folded": ort.runner(dst, device="cpu", threads=threads)}
    with open_runners(runners):
        results = [runner.infer(feeds) for runner in runners.values()]
    reference, candidate = results
    checks = []
    for name, ref in reference.items():
        got = candidate.get(name)
        if got is None or got.shape != ref.shape:
            checks.append(OutputCheck(name, None, None, ["missing or reshaped in the folded model"]))
        elif not np.issubdtype(ref.dtype, np.floating) or ref.ndim == 0:
            checks.append(OutputCheck(name, None, None, [] if np.array_equal(ref, got) else ["values differ"]))
        else:
            dtype = _DTYPE_NAMES.get(ir.DataType.from_numpy(ref.dtype), "fp32")
            tolerance = default_tolerance(dtype, "fold")
            metrics = compare_logits(ref, got, tolerance.rtol)
            checks.append(OutputCheck(name, metrics, tolerance, violations(metrics, tolerance)))
    return FoldCheck({k: list(v.shape) for k, v in feeds.items()}, checks)
