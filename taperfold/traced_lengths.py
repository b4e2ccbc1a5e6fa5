"""Whether a traced graph takes every length it was asked to take.

Where a model's code branches on a length, torch.export does not fail: it keeps the branch the trace took and records
what that branch assumed, as the range of the length (Doge's dynamic mask keeps the top `keep_window_size` keys once
there are more: the sequence capped at 16) or as a runtime assertion (DeepSeek-V4's compressor closes one window per 4
tokens and its indexer takes a branch for two windows: lengths 8 to 11 only). torch.onnx drops those assertions from
the graph, which then runs on every shape and computes another function on the others. The assertions stay in the
trace's shape environment; each is evaluated here over the lengths asked for.
"""

from __future__ import annotations

import itertools

import sympy
import torch

from taperfold.errors import TaperfoldError

EVERY_LENGTH_UP_TO = 64  # each length to here, then each power of two and its neighbours: where branches fall


def check_lengths(program: torch.export.ExportedProgram, wanted: dict[int, tuple[str, int]], input_name: str) -> None:
    """Raise one line where the graph traced from `program` would not compute the model's function at every length
    asked for (`wanted`: axis of the tokens `input_name` -> (its name, the longest length; the shortest is 1))."""
    tokens = next(n for n in program.graph.nodes if n.name == program.graph_signature.user_inputs[0])
    dims = {axis: tokens.meta["val"].shape[axis] for axis in wanted}
    symbols = {
        axis: dim.node.expr
        for axis, dim in dims.items()
        if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol)
    }
    for axis, symbol in symbols.items():
        name, longest = wanted[axis]
        bound = program.range_constraints.get(symbol)
        if bound is not None and bound.upper < longest:
            raise TaperfoldError(
                f"torch.onnx export holds the {name} length of '{input_name}' to {int(bound.upper)} at most (asked: "
                f"{longest}): the model's code branches on it past that, so the graph would compute another function "
                "for longer inputs"
            )
    if not symbols:
        return
    shape_env = dims[next(iter(symbols))].node.shape_env
    samples = {  # the batch at powers of two: it rarely branches, and the points are the product of both axes
        symbol: sample_lengths(wanted[axis][1], all_up_to=EVERY_LENGTH_UP_TO if axis else 0)
        for axis, symbol in symbols.items()
    }
    names = {symbol: sympy.Symbol(wanted[axis][0]) for axis, symbol in symbols.items()}
    failures = []  # (what torch.export assumed, where it is false, the axis to name)
    for assertions in shape_env.deferred_runtime_asserts.values():
        for assertion in assertions:
            free = [s for s in symbols.values() if s in assertion.expr.free_symbols]
            if not free or len(free) < len(assertion.expr.free_symbols):  # another size (data-dependent, a cache's)
                continue
            if _size_oblivious(assertion.expr):
                continue
            failing = _first_failing(assertion.expr, {s: samples[s] for s in free})
            if failing is not None:
                at = " and ".join(f"{names[s]} {length}" for s, length in failing.items())
                axis = max(a for a, s in symbols.items() if s in free)  # the sequence where it is one of them
                failures.append((str(assertion.expr.xreplace(names)), at, axis))
    if failures:  # the shortest to read
        assumed, at, axis = min(failures, key=lambda failure: len(failure[0]))
        raise TaperfoldError(
            f"torch.onnx export traced a branch of the model's code that holds for some {wanted[axis][0]} lengths of "
            f"'{input_name}' only: torch.export assumed {assumed}, which is false at {at} (asked: 1 to "
            f"{wanted[axis][1]}), so the graph would compute another function there"
        )


def _size_oblivious(expr: sympy.Basic) -> bool:
    """Whether `expr` is `Ne(size, 1)` for a size or a product of sizes: the exporter traces a size as if it were not 1
    where it broadcasts (torch.onnx sets `backed_size_oblivious`); ONNX broadcasts at 1 alike, so the graph is the same
    there."""
    if not (isinstance(expr, sympy.Ne) and expr.rhs == 1):
        return False
    factors = expr.lhs.args if isinstance(expr.lhs, sympy.Mul) else (expr.lhs,)
    return all(isinstance(factor, sympy.Symbol) for factor in factors)


def sample_lengths(longest: int, all_up_to: int) -> list[int]:
    """Lengths 1 to `longest` where a branch on a length most likely falls: each to `all_up_to`, each power of two and
    its neighbours, the longest."""
    lengths = set(range(1, min(all_up_to, longest) + 1)) | {longest}
    power = 1
    while power <= longest:
        lengths |= {power - 1, power, power + 1}
        power *= 2
    return sorted(length for length in lengths if 1 <= length <= longest)


def _first_failing(expr: sympy.Basic, samples: dict[sympy.Symbol, list[int]]) -> dict[sympy.Symbol, int] | None:
    """The first point of `samples` (every combination, shortest lengths first) at which `expr` is false, or None."""
    for lengths in itertools.product(*samples.values()):
        point = dict(zip(samples, lengths))
        try:
            value = expr.xreplace({symbol: sympy.Integer(length) for symbol, length in point.items()})
        except ZeroDivisionError:  # what the branch assumed divides by a size that is 0 there
            return point
        if value is sympy.false:
            return point
    return None
