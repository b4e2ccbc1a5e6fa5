"""KV-cached greedy decoding through the runner interface, with the decoder IO names of the export
(`input_ids`, [`cache_position`,] `past_key_values.{i}.key|value` → `logits`, `present.{i}.key|value`).

The prompt is one call, timed apart; then every step feeds the previous step's greedy token and the presents
returned by the runner, which stay in the runner's native form (device tensors, OrtValues) between steps. Two
caches (taperfold.exportdir.KV_CACHES):

- growing: the prompt runs with an empty past (length 0); each step's present is one longer than its past;
- static: the cache is `cache_len` zeros, `cache_position` says where the new tokens go (0..prompt-1, then one
  position per step); the presents are the cache buffers themselves, written in place, and every step has the
  same shapes.

The greedy token is the runner's `next_token` output where it has one (the torch runner's static decoder takes the
argmax on the device and the next step is fed that device tensor); otherwise the logits come back to the host for
the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from taperfold.exportdir import CACHE_POSITION, NEXT_TOKEN, OUTPUT, prompt_feeds, step_feeds
from taperfold.runners.base import Runner
from taperfold.taper import ModelShape


@dataclass
class Generation:
    prefill_s: float
    step_s: list[float]  # one per decode step (one new token per sequence of the batch)
    tokens: np.ndarray  # [batch, 1 + steps]: the greedy tokens, the first from the prefill's logits
    last_logits: np.ndarray  # [batch, vocab] of the final step


def generate(
    runner: Runner, prompt_ids: np.ndarray, steps: int, cfg: ModelShape, dtype: str, cache_len: int | None = None
) -> Generation:
    """A prompt and `steps` greedy steps; `cache_len`: the static cache's length, for a runner of a static decoder."""
    static = CACHE_POSITION in runner.input_names
    if static != (cache_len is not None):
        raise ValueError("a static decoder needs cache_len (and a growing one takes none)")
    on_device = NEXT_TOKEN in runner.output_names

    def greedy(out) -> tuple:
        """(what the next step is fed, the tokens on the host)."""
        if on_device:
            return out[NEXT_TOKEN], runner.to_numpy(out[NEXT_TOKEN])[:, 0]  # fed as it is: it stays on the device
        token = runner.to_numpy(out[OUTPUT]).argmax(-1)
        return token[:, None].astype(np.int64), token

    prompt = prompt_ids.shape[1]
    out, prefill_s = runner.timed_run(runner.prepare(prompt_feeds(cfg, prompt_ids, dtype, cache_len)))
    feed, token = greedy(out)
    tokens, step_s = [token], []
    for k in range(steps):
        out, seconds = runner.timed_run(runner.prepare(step_feeds(cfg, feed, out, prompt + k, static)))
        step_s.append(seconds)
        feed, token = greedy(out)
        tokens.append(token)
    return Generation(prefill_s, step_s, np.stack(tokens, axis=1), runner.to_numpy(out[OUTPUT]))
