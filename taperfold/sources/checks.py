"""What every model source checks of the tensors it read (taperfold's checkpoints and transformers directories alike).

Before any model is built, even on the meta device (a config of 10^9 layers would hang there): the parameters its
config implies against the values the file holds (`implied_parameters`, `MAX_PARAMETERS_RATIO`). Then, against the
state dict of the model the config describes (built on the meta device): the tensors' names and shapes, then NaN
and Inf in any floating-point tensor and each tapered norm's c in `C_RANGE` (`check_state`). Each problem is one
`TaperfoldError` naming the file and the key as the file spells it (`printable`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import torch

from taperfold.errors import TaperfoldError

# c ≈ 1 / RMS of the norm's input at taper start; 1e6 would mean a residual stream of RMS 1e-6.
C_RANGE = (0.0, 1e6)
MAX_PARAMETERS_RATIO = 2  # a config implying more than twice the values the file holds is refused


def implied_parameters(*, vocab_size: int, hidden: int, layers: int, attention: int, intermediate: int) -> int:
    """A lower bound on the parameters any family's model of these sizes holds, whatever the family: the embedding
    (vocab_size × hidden), and per layer a query and an output projection (hidden × attention each, attention being
    heads × head dimension) and the MLP's two matrices (hidden × intermediate each)."""
    return vocab_size * hidden + layers * 2 * hidden * (attention + intermediate)


def check_state(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    where: Path,
    *,
    unexpected: Callable[[str, str], str],
    optional: Collection[str] = (),
    norms: Collection[str] | None = None,
    origin: Mapping[str, Path] | None = None,
    stored: Mapping[str, str] | None = None,
) -> None:
    """`tensors` against `expected`, the state dict of the model the file describes: every key present (but
    `optional` ones: tied weights stored once), none unknown, each shape right; then, once every name and shape is
    (a wrong file is named for what it lacks before what it holds), every floating-point tensor finite and the c of
    each of `norms` (the tapered norms; None: a plain model) in C_RANGE.

    An error names the file the key came from (`origin`, else `where`) and the key as the file spells it (`stored`,
    else the key); `unexpected(key, name)` says, after the file, what is wrong with a key the model does not have."""
    origin, stored = origin or {}, stored or {}
    for key in expected:
        if key not in tensors and key not in optional:
            raise TaperfoldError(f"{where}: missing key '{key}'")
    for key, value in tensors.items():
        file, name = origin.get(key, where), printable(stored.get(key, key))
        if key not in expected:
            raise TaperfoldError(f"{file}: {unexpected(key, name)}")
        if tuple(value.shape) != tuple(expected[key].shape):
            raise TaperfoldError(
                f"{file}: key '{name}' has shape {list(value.shape)}, expected {list(expected[key].shape)}"
            )
    for key, value in tensors.items():
        file, name = origin.get(key, where), printable(stored.get(key, key))
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise TaperfoldError(f"{file}: key '{name}' contains NaN or Inf")
        if (
            norms is not None
            and key.endswith(".c")
            and key[:-2] in norms
            and not C_RANGE[0] < float(value) <= C_RANGE[1]
        ):
            raise TaperfoldError(
                f"{file}: key '{name}' is {float(value):g}; a tapered norm's scale c must lie in "
                f"({C_RANGE[0]:g}, {C_RANGE[1]:g}]"
            )


def printable(name) -> str:
    """A key from a file as one line of text: control characters (a newline) escaped."""
    name = str(name)
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def short(value) -> str:
    """A value from a file, quoted in an error line: printable and at most 60 characters."""
    text = printable(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."
