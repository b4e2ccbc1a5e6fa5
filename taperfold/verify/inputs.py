"""The token batches verify runs every model on: seeded random ones far from the shape the exporter traced (batch 1
and 4, sequence 1 to the model's longest; export.TRACE_SHAPE is batch 2, sequence 8), a user's ids or text, and the
decode cases (a prompt, then DECODE_STEPS KV-cached steps: of the user's own tokens when given)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from taperfold.errors import TaperfoldError, first_line
from taperfold.infiles import check_plain_file, read_plain_file

BATCH_SIZES = (1, 4)  # the export traces batch 2
SHORT_SEQUENCE = 16  # and sequence 8
DECODE_STEPS = 4  # KV-cached steps after each prompt, fewer where the cache holds fewer (decode_steps)
# The user's tokens are decoded for longer: each step's logits score one more token (a genai folder's or a
# --logits last decoder's only scored rows)
USER_DECODE_STEPS = 64
# A text is scored in windows of at most this many tokens (the model's context where shorter), four to a batch, and
# at most MAX_TEXT_WINDOWS of them: 16 k tokens measure a perplexity to a fraction of a percent
TEXT_WINDOW = 1024
MAX_TEXT_WINDOWS = 16
# The most a --text or --tokens file may hold, checked before it is read: far above what verify scores (16 k tokens
# of text; a batch of sequences no longer than the model's context of at most 2^20 tokens), far below what would
# exhaust memory or time (/dev/zero, a sparse file of a terabyte)
MAX_INPUT_BYTES = 16 << 20
MAX_TOKEN_IDS = 1 << 24  # ids a .npy token file may hold
_TOKEN_ID = re.compile(r"-?[0-9]{1,20}")  # plain ASCII decimal: int() would take '٣', '1_0' and '+5' as well


@dataclass
class InputBatch:
    label: str  # names the batch in the report, and the file in errors
    ids: np.ndarray  # [batch, sequence] token ids


def random_inputs(vocab_size: int, max_seq_len: int, seed: int = 0) -> list[InputBatch]:
    """Uniform random tokens: batch 1 and >1 by sequence 1, a short one and the longest the model allows."""
    rng = np.random.default_rng(seed)
    sequences = sorted({1, min(SHORT_SEQUENCE, max_seq_len), max_seq_len})
    return [
        InputBatch(f"random {b}x{s}", rng.integers(0, vocab_size, size=(b, s), dtype=np.int64))
        for b in BATCH_SIZES
        for s in sequences
    ]


def tokens_from_file(path: str | Path) -> list[InputBatch]:
    """A .npy integer array, or text with whitespace-separated ids, one sequence per line.
    1-D (or one line) is one sequence; 2-D (or several lines of equal length) is a batch."""
    path = Path(path)
    if not path.exists():
        raise TaperfoldError(f"{path}: no such token file")
    if path.suffix == ".npy":
        _check_npy_header(path)
        try:
            ids = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise TaperfoldError(f"{path}: not a readable .npy array ({e})") from None
    else:
        ids = _ids_from_text(path)
    return [InputBatch(str(path), ids[None, :] if ids.ndim == 1 else ids)]


def _check_npy_header(path: Path) -> None:
    """A .npy file's header, read before its array: integers, at most MAX_TOKEN_IDS of them, and exactly as many
    bytes after the header as they take (a header may claim 10^18 elements of a 100-byte file)."""
    size = check_plain_file(path, "a .npy token file", MAX_TOKEN_IDS * 8 + 65536)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f, max_header_size=65536)
            offset = f.tell()
    except (ValueError, OSError, EOFError, SyntaxError) as e:
        raise TaperfoldError(f"{path}: not a readable .npy array ({first_line(e)})") from None
    if not np.issubdtype(dtype, np.integer):
        raise TaperfoldError(f"{path}: holds {dtype} values; token ids must be integers")
    count = math.prod(shape)
    if count > MAX_TOKEN_IDS:
        raise TaperfoldError(f"{path}: its header claims {count} token ids; verify takes at most {MAX_TOKEN_IDS}")
    if size - offset != count * dtype.itemsize:
        raise TaperfoldError(
            f"{path}: its header claims shape {list(shape)} ({count * dtype.itemsize} bytes of {dtype}), and the "
            f"file holds {size - offset} bytes after it"
        )


def _ids_from_text(path: Path) -> np.ndarray:
    data = read_plain_file(path, "a --tokens file", MAX_INPUT_BYTES)
    try:
        lines = [line.split() for line in data.decode().splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise TaperfoldError(f"{path}: not a readable token file ({e}); use .npy or whitespace-separated ids") from None
    rows = []
    for number, words in enumerate(lines, 1):
        bad = next((w for w in words if not _TOKEN_ID.fullmatch(w)), None)
        if bad is not None:
            raise TaperfoldError(f"{path}: line {number}: {bad!r} is not an integer token id") from None
        rows.append([int(w) for w in words])
    if not rows:
        raise TaperfoldError(f"{path}: holds no token ids")
    if len({len(r) for r in rows}) > 1:
        raise TaperfoldError(
            f"{path}: lines hold different numbers of ids ({sorted({len(r) for r in rows})}); "
            "a batch needs sequences of equal length, one per line"
        )
    return np.array(rows[0] if len(rows) == 1 else rows, dtype=object)


def read_text(path: str | Path) -> bytes:
    """A text file's bytes (--text), or one line naming it."""
    data = read_plain_file(path, "a --text file", MAX_INPUT_BYTES)
    if not data:
        raise TaperfoldError(f"{path}: is empty")
    return data


def text_windows(label: str, ids: np.ndarray, max_seq_len: int) -> list[InputBatch]:
    """A text's token ids cut into windows of the model's context (at most TEXT_WINDOW tokens), four to a batch, at
    most MAX_TEXT_WINDOWS; a text shorter than one window is one sequence, and a shorter last window its own batch."""
    window = min(max_seq_len, TEXT_WINDOW)
    if len(ids) < 2:
        raise TaperfoldError(f"{label}: encodes to {len(ids)} token(s); a text needs 2 or more")
    starts = list(range(0, len(ids), window))[:MAX_TEXT_WINDOWS]
    pieces = [ids[start : start + window] for start in starts]
    full = [p for p in pieces if len(p) == window]
    groups = [full[i : i + max(BATCH_SIZES)] for i in range(0, len(full), max(BATCH_SIZES))]
    groups += [[p] for p in pieces if len(p) < window and len(p) >= 2]
    used = sum(len(p) for group in groups for p in group)
    of = f" of {len(ids)}" if used < len(ids) else ""
    batches, first = [], 0
    for group in groups:
        tokens = f"tokens {first}-{first + sum(len(p) for p in group) - 1}{of}" if len(groups) > 1 or of else ""
        batches.append(InputBatch(f"{label} {tokens}".strip(), np.stack(group).astype(np.int64)))
        first += sum(len(p) for p in group)
    return batches


def checked_ids(batch: InputBatch, vocab_size: int, max_seq_len: int) -> np.ndarray:
    ids = batch.ids
    if ids.ndim != 2 or ids.size == 0:
        raise TaperfoldError(
            f"{batch.label}: expected a 1-D sequence or a 2-D batch of token ids, got shape {list(ids.shape)}"
        )
    low, high = int(ids.min()), int(ids.max())  # Python ints: no overflow whatever the array's dtype
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise TaperfoldError(
            f"{batch.label}: token id {bad} is out of range (the vocabulary has {vocab_size} ids, 0..{vocab_size - 1})"
        )
    if ids.shape[1] > max_seq_len:
        raise TaperfoldError(
            f"{batch.label}: sequence of {ids.shape[1]} tokens is longer than the model allows "
            f"({max_seq_len}); shorten it"
        )
    return ids.astype(np.int64)


def decode_steps(max_seq_len: int, wanted: int = DECODE_STEPS) -> int:
    """The KV-cached steps a decode case takes in a context (or static cache) of `max_seq_len` positions: `wanted`,
    or half a cache too short for them and a prompt (export --max-cache 4: a 2-token prompt, 2 steps)."""
    return min(wanted, max_seq_len // 2)


def next_token_ids(ids: np.ndarray, end: int, logits_shape: tuple[int, ...]) -> np.ndarray:
    """The token each row of a call's logits predicts: `ids` [batch, sequence] the call's tokens and those after,
    `end` the number of them fed so far, the logits [batch, vocab] (the last position) or [batch, positions, vocab]
    (the last `positions`); -1 where the token lies past `ids`. Row-major, as the logits' rows."""
    positions = 1 if len(logits_shape) == 2 else logits_shape[1]
    following = np.arange(end - positions, end) + 1  # the index of the token each position predicts
    known = following < ids.shape[1]
    out = np.full((ids.shape[0], positions), -1, dtype=np.int64)
    out[:, known] = ids[:, following[known]]
    return out.reshape(-1)


def decode_cases(vocab_size: int, max_seq_len: int, seed: int = 0, window: int | None = None) -> list[InputBatch]:
    """Prompts for the decoders (past 0 at the prompt, then `decode_steps` steps), far from the tracing shape
    (batch 2, 8 tokens, past 5): one short prompt at batch 1, and batch 4 up to the model's longest context.
    The ids hold the prompt and then the token fed at each step (the same for reference and candidate).
    A model whose layers attend through a `window` shorter than the context also gets a batch-1 prompt that ends
    just short of the window, so that its steps cross it: where a cache that crops to the window starts cropping."""
    rng = np.random.default_rng(seed + 1)
    steps = decode_steps(max_seq_len)
    if steps < 1:
        return []
    prompts = sorted({min(SHORT_SEQUENCE, max_seq_len - steps), max_seq_len - steps})
    cases = list(zip(BATCH_SIZES, prompts))
    if window is not None and window < max_seq_len:
        crossing = (min(BATCH_SIZES), max(1, min(window - steps // 2, max_seq_len - steps)))
        cases += [crossing] if crossing not in cases else []
    return [
        InputBatch(f"decode {b}x{p}+{steps}", rng.integers(0, vocab_size, size=(b, p + steps), dtype=np.int64))
        for b, p in cases
    ]
