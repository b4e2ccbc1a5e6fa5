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


def save_byte_tokenizer(folder: Path) -> None:
    """A tokenizer of a byte-level model (token id = byte value, taperfold's "bytes" tokenizer) as transformers saves
    one, for tools that need a tokenizer beside the weights (onnxruntime-genai's builder and its Tokenizer): byte-level
    BPE with no merges, each byte one token, spelled with GPT-2's printable stand-ins for bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    spelling = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tokenizer = Tokenizer(models.BPE({spelling[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
