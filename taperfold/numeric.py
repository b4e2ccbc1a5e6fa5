"""The one check of a number read from a file (a config, a checkpoint's header, a `taperfold` block).

A leaf module (standard library only): taperfold.models.config imports it, and so can everything that reads
config files, with no import cycle.
"""

from __future__ import annotations

import math
import sys
from typing import TypeGuard


def is_finite_number(value: object) -> TypeGuard[float]:
    """An int or a float (not a bool) that is a finite float: NaN, ±Inf and an integer beyond the largest float
    (10**400, which JSON reads as an int) are not. An int is exact and never asked `math.isfinite`, which raises
    OverflowError converting one that large; only its size is compared, so every caller can take `float(value)`."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -sys.float_info.max <= value <= sys.float_info.max
    return isinstance(value, float) and math.isfinite(value)
