"""transformers' progress bars kept out of taperfold's output, which stays one line per stage."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers draws a progress bar per save (its "Writing model shards"); none while this is open."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
