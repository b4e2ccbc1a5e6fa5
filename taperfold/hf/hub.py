"""Hugging Face Hub model ids (`org/name`) as local directories, as every transformers user expects: the
snapshot in huggingface_hub's local cache, fetched first where there is a network (HF_HUB_OFFLINE=1: the cache
only). Only what taperfold reads is fetched: config, safetensors weights and tokenizer files, never code or
pickles."""

from __future__ import annotations

import re
from pathlib import Path

from taperfold.errors import TaperfoldError, first_line

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
FETCHED = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES]


def resolve(name: str) -> Path | None:
    """The local snapshot of the Hub model `name`, or None when `name` is no model id (`org/name`)."""
    if not HUB_ID.fullmatch(name):
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise TaperfoldError(
            f"{name}: a Hugging Face Hub id needs huggingface_hub: pip install 'taperfold[hf]'"
        ) from None
    try:
        return Path(snapshot_download(name, allow_patterns=FETCHED))
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many types (offline, not found, gated, HTTP)
        raise TaperfoldError(
            f"{name}: no such file or directory, and not a model the Hugging Face Hub cache holds "
            f"or could fetch ({type(e).__name__}: {first_line(e)})"
        ) from None
