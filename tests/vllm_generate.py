"""Run by tests/test_vllm.py with .venv-vllm's Python: vLLM's offline `LLM` on MODEL, greedy, each prompt's tokens
and their logprobs printed as one JSON line; a failure to load is one line `ERROR: ...` (vLLM's message, its lines
joined) and exit 1.

    vllm_generate.py MODEL PROMPTS_JSON MAX_TOKENS [TENSOR_PARALLEL]

The guard is vLLM's requirement: `LLM(...)` spawns its engine process, which imports this module again."""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    tensor_parallel = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    try:
        llm = LLM(
            model=model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=64,
            seed=0,
            tensor_parallel_size=tensor_parallel,
            distributed_executor_backend="mp" if tensor_parallel > 1 else None,
        )
    except Exception as e:  # noqa: BLE001 - the test reads what vLLM says, whatever its type
        print("ERROR:", type(e).__name__, " ".join(str(e).split()))
        sys.exit(1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        }
        for o in outputs
    ]
    print("RESULT", json.dumps(result))
