"""Checkpoints, as the README's Python examples use them: `load_checkpoint` opens any model taperfold reads
(taperfold.sources.open_source); saving writes taperfold's own format (taperfold.sources.builtin)."""

from taperfold.sources import open_source as load_checkpoint
from taperfold.sources.builtin import Checkpoint, checkpoint_from_model, checkpoint_output, save_checkpoint

__all__ = ["Checkpoint", "checkpoint_from_model", "checkpoint_output", "load_checkpoint", "save_checkpoint"]
