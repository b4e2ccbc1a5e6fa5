"""Verifying an artifact by its generations: for an engine that returns greedy tokens and their log-probabilities
rather than logits (vLLM: `taperfold verify DIR --engine vllm`), the artifact generates greedily from seeded prompts,
each prompt alone (batch 1) and all of them at once (concurrent requests, which the engine batches itself), and the
checkpoint's torch model is run along each generated sequence (teacher-forced: the prompt and the engine's tokens) to
judge every step:

- the token: the checkpoint's greedy choice, or a near-tie, where the checkpoint's log-probability of the engine's
  token is within `near_tie` of its best (a flip that rounding alone explains; later steps stay comparable, as the
  checkpoint reads the engine's tokens);
- its log-probability: within `atol` (nats) of the checkpoint's of the same token at the same step.

Bounds by the export's dtype (GENERATION_TOLERANCES): fp32 differs from the checkpoint by kernel order only (1e-6 was
measured on a tiny Llama, 1e-4 is usual at scale), so 1e-3, and a near-tie within 2e-3; bf16 keeps 8 mantissa bits, so
its log-probabilities move by about 0.1 on logits of order 10 and greedy tokens flip wherever the top two are that
close: 0.15, and a near-tie margin of 0.3 (measured on SmolLM2-135M's shape served in bf16: 0.024, no flip).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from taperfold.exportdir import INPUT, OUTPUT, PREFILL
from taperfold.verify.report import GENERATE, PairResult

GENERATE_STEPS = 8  # new tokens per request
PROMPTS = 4  # requests submitted at once; each also runs alone
PROMPT_LENGTHS = (3, 16, 31)  # and the longest that leaves room for the steps: far from one another and the trace


@dataclass(frozen=True)
class GenerationTolerance:
    atol: float  # bound on |candidate logprob - checkpoint logprob| of each chosen token, nats
    near_tie: float  # a token other than the checkpoint's greedy one is accepted where its logprob is this close

    def to_dict(self) -> dict:
        return {"atol": self.atol, "near_tie": self.near_tie}


GENERATION_TOLERANCES = {
    "fp32": GenerationTolerance(atol=1e-3, near_tie=2e-3),
    "fp16": GenerationTolerance(atol=5e-2, near_tie=1e-1),
    "bf16": GenerationTolerance(atol=1.5e-1, near_tie=3e-1),
}


@dataclass
class GenerationCheck:
    """One artifact verified by its generations: `open_runner()` gives its (unloaded) runner, `reference` names the
    torch model it is held to."""

    candidate: str
    reference: str
    open_runner: Any
    prompts: list[list[int]]
    steps: int
    tolerance: GenerationTolerance
    result: PairResult = field(init=False)

    def __post_init__(self) -> None:
        self.result = PairResult(self.reference, self.candidate, GENERATE, None)


def generation_prompts(vocab_size: int, max_seq_len: int, seed: int, given: list[np.ndarray] | None = None):
    """(prompts, steps): PROMPTS seeded random prompts of PROMPT_LENGTHS and the longest that leaves room for the
    steps, or the first rows of the user's batches (`given`) cut to leave that room; steps: GENERATE_STEPS, or half a
    context too short for them."""
    steps = min(GENERATE_STEPS, max_seq_len // 2)
    room = max_seq_len - steps
    if given:
        rows = [list(map(int, row[:room])) for ids in given for row in ids][:PROMPTS]
        return rows, steps
    rng = np.random.default_rng(seed + 2)
    lengths = sorted({min(n, room) for n in (*PROMPT_LENGTHS, room)})
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths][:PROMPTS], steps


def run_generation_check(check: GenerationCheck, torch_model: Any, torch_engine: Any) -> PairResult:
    """Generate (each prompt alone, then all at once), run the checkpoint along every sequence, judge; the result."""
    result = check.result
    runs: dict[str, list[dict]] = {}
    with check.open_runner() as runner:
        runs["alone"] = [runner.greedy([p], check.steps)[0] for p in check.prompts]
        runs["at once"] = runner.greedy(check.prompts, check.steps)
    reference = torch_engine.runner(torch_model, device="cpu", logits="all", graph=PREFILL, name=check.reference)
    tol = check.tolerance
    worst, flips, tokens, problems = 0.0, 0, 0, []
    with reference:
        for how, outputs in runs.items():
            for i, (prompt, out) in enumerate(zip(check.prompts, outputs)):
                label = f"prompt {i} ({len(prompt)} tokens) {how}"
                chosen = out["tokens"]
                if len(chosen) != check.steps:
                    problems.append(f"{label}: {len(chosen)} tokens, not {check.steps}")
                    continue
                ids = np.array([prompt + chosen[:-1]], dtype=np.int64)
                logits = reference.infer({INPUT: ids})[OUTPUT][0, len(prompt) - 1 :].astype(np.float64)
                logprobs = logits - _logsumexp(logits)
                per_step = []
                for k, token in enumerate(chosen):
                    ref_lp, best = logprobs[k, token], logprobs[k].max()
                    error = abs(out["logprobs"][k] - ref_lp)
                    worst = max(worst, error)
                    tokens += 1
                    if token != int(logprobs[k].argmax()):
                        if best - ref_lp <= tol.near_tie:
                            flips += 1
                        else:
                            problems.append(
                                f"{label} step {k}: token {token} (checkpoint logprob {ref_lp:.4g}) where the "
                                f"checkpoint chooses {int(logprobs[k].argmax())} ({best:.4g}), not a near-tie"
                            )
                    if error > tol.atol:
                        problems.append(f"{label} step {k}: |logprob error| {error:.3g} > {tol.atol:g}")
                    per_step.append(round(float(error), 8))
                result.per_input.append(
                    {"input": label, "tokens": chosen, "logprob_errors": per_step, "violations": []}
                )
    n = len(check.prompts)
    summary = (
        f"{n} prompts alone and {n} at once, {check.steps} tokens each: max |logprob error| {worst:.3g} "
        f"(bound {tol.atol:g}), {flips} near-tie flip(s) (margin {tol.near_tie:g})"
    )
    result.per_input.insert(0, {"input": "all", "tolerance": tol.to_dict(), "tokens_judged": tokens})
    if problems:
        result.status = "fail"
        result.violations = problems[:5] + ([f"{len(problems) - 5} more"] if len(problems) > 5 else [])
        result.worst_input = problems[0].split(" step")[0]
    else:
        result.reason = summary
    return result


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(-1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(-1, keepdims=True))
