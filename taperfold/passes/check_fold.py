"""`taperfold fold --verify`: run a model and its fold in ONNX Runtime on inputs made from the graph's
signature, and hold every output pair to the fold's tolerance (taperfold.compare).

Inputs: integer ids that an embedding looks up (Gather from a constant table) are drawn within the
table's rows; an input named like a mask is ones, one named like positions counts 0, 1, 2, ...; float
inputs are standard normal. Dynamic dimensions come from `--shapes NAME:1x16,...`, else a dimension
name already fixed by another input, else 1 for the first axis and 16 for the others. An input that cannot
be generated (a 0 or negative dimension, more than 2^31 elements, ids into a table of no rows) is refused in
one line naming it, before anything is allocated; `check_inputs` does that alone, before a fold is written.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np
import onnx_ir as ir

from taperfold.compare import Metrics, Tolerance, compare_logits, default_tolerance, violations
from taperfold.errors import TaperfoldError
from taperfold.passes.report import FoldReport

_DTYPE_NAMES = {
    ir.DataType.FLOAT: "fp32",
    ir.DataType.DOUBLE: "fp32",
    ir.DataType.FLOAT16: "fp16",
    ir.DataType.BFLOAT16: "bf16",
}
_INDEX_PATH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}


MAX_FEED_ELEMENTS = 2**31  # elements of one generated input: refused above, before anything is allocated


def parse_shapes(text: str | None) -> dict[str, list[int]]:
    """'input_ids:1x16,attention_mask:1x16' -> {'input_ids': [1, 16], ...}. Every dimension at least 1, each
    input at most MAX_FEED_ELEMENTS elements, each name once."""
    shapes = {}
    for part in filter(None, (text or "").split(",")):
        name, _, dims = part.strip().rpartition(":")
        if not name or not re.fullmatch(r"\d+(x\d+)*", dims):
            raise TaperfoldError(f"--shapes: {part!r} is not NAME:DIMxDIM... (e.g. input_ids:1x16)")
        if name in shapes:
            raise TaperfoldError(f"--shapes: {name!r} is given twice")
        digits = [d.lstrip("0") for d in dims.split("x")]
        if not all(digits):
            raise TaperfoldError(f"--shapes: {part!r} has a 0 dimension; --verify needs at least one element per input")
        if any(len(d) > 12 for d in digits) or math.prod(int(d) for d in digits) > MAX_FEED_ELEMENTS:
            raise TaperfoldError(
                f"--shapes: {part!r} is more than {MAX_FEED_ELEMENTS:,} (2^31) elements, the "
                "most --verify generates for one input"
            )
        shapes[name] = [int(d) for d in digits]
    return shapes


def _lookup_rows(value: ir.Value, depth: int = 4) -> int | None:
    """Rows of the constant table that `value` indexes (through Cast/Reshape/...), if any."""
    for use in value.uses():
        node = use.node
        if node.domain == "" and node.op_type == "Gather" and use.idx == 1:
            table = node.inputs[0]
            dims = table.const_value.shape.numpy() if table is not None and table.const_value is not None else ()
            if dims and node.attributes.get_int("axis", 0) == 0:
                return dims[0]
        if (
            depth
            and node.domain == ""
            and node.op_type in _INDEX_PATH
            and use.idx == 0
            and (rows := _lookup_rows(node.outputs[0], depth - 1)) is not None
        ):
            return rows
    return None


@dataclasses.dataclass
class _Feed:
    """An input --verify generates."""

    name: str
    dtype: np.dtype
    dims: list[int]
    rows: int | None  # integer ids: the rows of the table they index, when known


def _plan(
    model: ir.Model,
    shapes: dict[str, list[int]],
    source: str | os.PathLike | None = None,
) -> list[_Feed]:
    """Every input to generate, or a one-line error naming the input: nothing is allocated here."""
    # every graph input has a name (ONNX requires one); "" only gives the type checker a str
    inputs = [(v.name or "", v) for v in model.graph.inputs if not v.is_initializer()]
    if unknown := set(shapes) - {name for name, _ in inputs}:
        raise TaperfoldError(
            f"--shapes: no graph input named {sorted(unknown)[0]!r} (inputs: {', '.join(name for name, _ in inputs)})"
        )
    named: dict[str, int] = {}
    for name, value in inputs:  # dimension names fixed by the user's shapes apply to every input
        if name in shapes and value.shape is not None:
            if len(shapes[name]) != len(value.shape):
                raise TaperfoldError(f"--shapes: {name} has rank {len(value.shape)}, got {len(shapes[name])} dims")
            for dim, size in zip(value.shape, shapes[name]):
                if not isinstance(dim, int) and dim.value:
                    named.setdefault(dim.value, size)
    plan = []
    file = f"{source}: " if source is not None else ""
    for name, value in inputs:
        given = name in shapes
        if given:
            dims = list(shapes[name])
        elif value.shape is None:
            raise TaperfoldError(f"{file}input '{name}' has no recorded shape: give it with --shapes {name}:...")
        else:
            dims = [
                dim
                if isinstance(dim, int)
                else named.setdefault(dim.value, 1 if i == 0 else 16)
                if dim.value
                else (1 if i == 0 else 16)
                for i, dim in enumerate(value.shape)
            ]
        fixed = value.shape is not None and all(isinstance(d, int) for d in value.shape)
        static = (
            "" if given else " in the graph's static shape" if fixed else " (the graph's shape, dynamic dims 1 or 16)"
        )
        hint = "" if given or fixed else f"; give a shape with --shapes {name}:..."
        if any(d < 0 for d in dims):
            raise TaperfoldError(
                f"{file}input '{name}' has a negative dimension{static}: {dims}; give its shape "
                f"with --shapes {name}:..."
            )
        elements = math.prod(dims)
        if elements == 0:
            raise TaperfoldError(
                f"{file}input '{name}' has a 0 dimension{static} ({dims}): --verify needs at "
                f"least one element per input{hint}"
            )
        if elements > MAX_FEED_ELEMENTS:
            raise TaperfoldError(
                f"{file}input '{name}' would be {elements:,} elements{static} ({dims}), more "
                f"than the {MAX_FEED_ELEMENTS:,} (2^31) --verify generates for one input{hint}"
            )
        dtype = np.dtype(value.dtype.numpy() if value.dtype is not None else np.float32)
        rows = None if np.issubdtype(dtype, np.floating) else _lookup_rows(value)
        if rows is not None and rows < 1:
            raise TaperfoldError(
                f"{file}input '{name}' indexes a table of {rows} rows: --verify has no valid ids to draw for it"
            )
        plan.append(_Feed(name, dtype, dims, rows))
    return plan


def feed_shapes(
    model: ir.Model,
    shapes: dict[str, list[int]],
    source: str | os.PathLike | None = None,
) -> dict[str, list[int]]:
    """The shape of every input --verify will generate, or a one-line error naming the input (and `source`, the
    model's file); allocates nothing."""
    return {feed.name: feed.dims for feed in _plan(model, shapes, source)}


def check_inputs(src: str | os.PathLike, shapes: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """`feed_shapes` of the model at `src` (checked as every load is): what `fold --verify` calls before it
    writes anything, so that inputs it cannot generate fail first."""
    from taperfold.onnx_io import load_model

    return feed_shapes(load_model(src), shapes or {}, src)


def make_feeds(
    model: ir.Model, shapes: dict[str, list[int]], seed: int = 0, source: str | os.PathLike | None = None
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for feed in _plan(model, shapes, source):
        dims, dtype, name = feed.dims, feed.dtype, feed.name.lower()
        if np.issubdtype(dtype, np.floating):
            feeds[feed.name] = rng.standard_normal(dims).astype(dtype)
        elif feed.rows is not None:
            feeds[feed.name] = rng.integers(0, feed.rows, dims).astype(dtype)
        elif "mask" in name:
            feeds[feed.name] = np.ones(dims, dtype)
        elif "position" in name and dims:
            feeds[feed.name] = np.broadcast_to(np.arange(dims[-1]), dims).astype(dtype)
        elif dtype == np.bool_:
            feeds[feed.name] = np.ones(dims, np.bool_)
        else:
            feeds[feed.name] = np.zeros(dims, dtype)
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
        return "; ".join(f"input -> folded, output '{o.name}': {', '.join(o.violations)}" for o in bad)

    def to_dict(self) -> dict:
        return {
            "inputs": self.inputs,
            "passed": self.passed,
            "outputs": [
                {
                    "name": o.name,
                    "status": "pass" if o.passed else "fail",
                    "metrics": o.metrics.to_dict() if o.metrics else None,
                    "tolerance": o.tolerance.to_dict() if o.tolerance else None,
                    "violations": o.violations,
                }
                for o in self.outputs
            ],
        }


def check_fold(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
    threads: int | None = None,
    folded_name: str | os.PathLike | None = None,
) -> FoldCheck:
    """Run `src` and `dst` on the same generated inputs and compare every output; errors call the folded model
    `folded_name` (the path it will have: `dst` may be its temporary)."""
    from taperfold.engines import ENGINES, open_runners
    from taperfold.onnx_io import load_model

    feeds = make_feeds(load_model(src), shapes or {}, seed, source=src)
    ort = ENGINES["ort"]
    runners = {
        "input": ort.runner(src, device="cpu", threads=threads),
        "folded": ort.runner(dst, device="cpu", threads=threads),
    }
    runners["folded"].model_name = str(folded_name if folded_name is not None else dst)
    with open_runners(runners):
        results = [runner.infer(feeds) for runner in runners.values()]
    reference, candidate = results
    checks = []
    for name, ref in reference.items():
        got = candidate.get(name)
        if got is None or got.shape != ref.shape:
            checks.append(OutputCheck(name, None, None, ["missing or reshaped in the folded model"]))
        elif not np.issubdtype(ref.dtype, np.floating) or ref.ndim == 0 or ref.size == 0:
            checks.append(OutputCheck(name, None, None, [] if np.array_equal(ref, got) else ["values differ"]))
        else:
            dtype = _DTYPE_NAMES.get(ir.DataType.from_numpy(ref.dtype), "fp32")
            tolerance = default_tolerance(dtype, "fold")
            metrics = compare_logits(ref, got, tolerance.tie_margin)
            checks.append(OutputCheck(name, metrics, tolerance, violations(metrics, tolerance)))
    return FoldCheck({k: list(v.shape) for k, v in feeds.items()}, checks)


def fold_and_check(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    report_path: str | os.PathLike | None = None,
    shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
    **fold_options: bool,
) -> tuple[FoldReport, FoldCheck]:
    """`fold --verify`: fold `src` into `dst` and check the written model before it is put in place, so that a model
    the check cannot run (the input, or its fold: a scale that broadcasts over an input whose last dimension is run at
    1) is refused with no output, data or report left; a mismatch is a result, and the fold stays written."""
    from taperfold.passes import fold_onnx_file

    checks: list[FoldCheck] = []
    report = fold_onnx_file(
        src,
        dst,
        report_path,
        before_commit=lambda written: checks.append(check_fold(src, written, shapes, seed, folded_name=dst)),
        **fold_options,
    )
    return report, checks[0]
