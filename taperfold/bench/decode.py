"""KV-cached greedy decoding through the runner interface, with the decoder IO names of the export
(`input_ids`, `past_key_values.{i}.key|value` → `logits`, `present.{i}.key|value`).

The prompt is one call with an empty cache (past length 0), timed apart; then every step feeds the
previous step's greedy token and the presents returned by the runner, which stay in the runner's native
form (device tensors, OrtValues) between steps. Only the logits come back to the host, for the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from taperfold.exportdir import INPUT, OUTPUT, decoder_io_names, numpy_dtype
from taperfold.models import ModelConfig
from taperfold.runners.base import Runner


@dataclass
class Generation:
    prefill_s: float
    step_s: list[float]  # one per decode step (one new token per sequence of the batch)
    tokens: np.ndarray  # [batch, 1 + steps]: the greedy tokens, the first from the prefill's logits
    last_logits: np.ndarray  # [batch, vocab] of the final step


def empty_cache(cfg: ModelConfig, batch: int, dtype: str) -> dict[str, np.ndarray]:
    """Past length 0: the prompt runs through the same decoder graph as every later step."""
    names = decoder_io_names(cfg.n_layers)[0][1:]
    shape = (batch, cfg.kv_heads, 0, cfg.head_dim)
    return {name: np.zeros(shape, dtype=numpy_dtype(dtype)) for name in names}


def generate(runner: Runner, prompt_ids: np.ndarray, steps: int, cfg: ModelConfig, dtype: str) -> Generation:
    past_names, present_names = decoder_io_names(cfg.n_layers)[0][1:], decoder_io_names(cfg.n_layers)[1][1:]
    feeds = {INPUT: prompt_ids, **empty_cache(cfg, prompt_ids.shape[0], dtype)}
    out, prefill_s = runner.timed_run(runner.prepare(feeds))
    logits = runner.to_numpy(out[OUTPUT])
    tokens = [logits.argmax(-1)]
    step_s = []
    for _ in range(steps):
        feeds = {INPUT: tokens[-1][:, None].astype(np.int64)}
        feeds.update({past: out[present] for past, present in zip(past_names, present_names)})
        out, seconds = runner.timed_run(runner.prepare(feeds))
        step_s.append(seconds)
        logits = runner.to_numpy(out[OUTPUT])
        tokens.append(logits.argmax(-1))
    return Generation(prefill_s, step_s, np.stack(tokens, axis=1), logits)
