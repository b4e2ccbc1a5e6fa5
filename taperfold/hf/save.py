"""A tapered transformers model saved as a Hugging Face directory: what `save_pretrained` writes, with the
`taperfold` block in config.json (taperfold.hf.taper_block), and the tokenizer files of the directory it came from.
Nothing is written that loading (taperfold.hf.source) would refuse."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_dir, refuse_hub_cache
from taperfold.hf.hub import TOKENIZER_FILES
from taperfold.hf.progress import no_progress_bars
from taperfold.hf.source import CONFIG
from taperfold.hf.taper import tapering_of
from taperfold.hf.taper_block import TaperBlock, parse_block


def save_hf_directory(
    model,
    out_dir: str | Path,
    *,
    step: int = 0,
    schedule=None,
    tokenizer_from: Path | None = None,
    max_shard_size: str | int | None = None,
    plain: bool = False,
) -> Path:
    """Write a tapered model as save_pretrained does, with the `taperfold` block; atomically per file. A model with
    no tapering (`plain`) is written as it is, without the block.
    `tokenizer_from`: a directory whose tokenizer files are copied as they are.
    Refuses, writing nothing, what load_hf_directory would refuse to read back: NaN or Inf in a parameter or
    buffer, a block out of range."""
    out_dir = Path(out_dir)
    refuse_hub_cache(out_dir, str(out_dir), whole=True)
    _check_finite(model, out_dir)
    if not plain:
        block = TaperBlock.of(tapering_of(model), step, schedule)
        parse_block(block.to_dict(), out_dir / CONFIG, model.config.model_type)  # as it will be read back (a NaN
        # gate or target included)
        model.config.taperfold = block.to_dict()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    with atomic_dir(out_dir) as tmp, no_progress_bars():
        model.save_pretrained(tmp, **kwargs)
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_from) / name).is_file():
                    shutil.copyfile(Path(tokenizer_from) / name, tmp / name)
    return out_dir


def _check_finite(model, out_dir: Path) -> None:
    """One line naming the first parameter or buffer holding NaN or Inf (a diverged run), before anything is
    written."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor.detach()).all()):
            kind = "parameter" if isinstance(tensor, torch.nn.Parameter) else "buffer"
            raise TaperfoldError(f"{out_dir}: not written: the model's {kind} '{name}' contains NaN or Inf")
