"""A save_pretrained directory's own tokenizer, read as data: tokenizer.json when the directory has it (it describes
the tokenizer completely), else transformers' AutoTokenizer with remote code refused; `taperfold train --from`
encodes its corpus with it, and `taperfold verify --text` the user's text."""

from __future__ import annotations

from pathlib import Path

from taperfold.errors import TaperfoldError
from taperfold.fsutil import read_json_object
from taperfold.hf.hub import TOKENIZER_FILES


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(folder: Path):
    """The directory's tokenizer, or one line naming the directory (or the key asking for its code)."""
    tok_config = folder / "tokenizer_config.json"
    if tok_config.is_file() and "auto_map" in read_json_object(tok_config):
        raise TaperfoldError(
            f"{tok_config}: key 'auto_map' asks for the directory's own tokenizer code; "
            "taperfold never runs code from a checkpoint"
        )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if (folder / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - tokenizer loaders raise many types; one line names the directory
        raise TaperfoldError(f"{folder}: cannot load its tokenizer ({str(e).splitlines()[0]})") from None
