"""Run by tests/test_vllm.py with .venv-vllm's Python: vLLM's offline `LLM` on each MODEL in turn, greedy, each
prompt's tokens and their logprobs printed as one JSON line per model (`RESULT {"model": MODEL, "outputs": [...]}`);
a model that fails to load is one line `ERROR: MODEL: ...` (vLLM's message, its lines joined), the next model is
served all the same, and the exit code is 1 if any failed.

    vllm_generate.py PROMPTS_JSON MAX_TOKENS TENSOR_PARALLEL MODEL [MODEL ...]

Each model gets an engine of its own, shut down before the next starts: several models in one process pay vLLM's
import once. At TENSOR_PARALLEL 1 the engine and its one worker run in this process (test_vllm.run_vllm sets
VLLM_ENABLE_V1_MULTIPROCESSING=0, the executor is "uni"): the same model classes and weights, loaded through the same
plugin entry point (vLLM loads its general plugins in whichever process builds the model), about 4 s an engine, not
the 20 s of spawning an engine process and a worker process that each import vLLM again. Past 1, "mp" spawns a worker
per shard. The guard is vLLM's requirement: a spawned process imports this module again."""

import gc
import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, max_tokens, tensor_parallel = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    failed = False
    for model in sys.argv[4:]:
        try:
            llm = LLM(
                model=model,
                dtype="float32",
                enforce_eager=True,
                max_model_len=64,
                seed=0,
                tensor_parallel_size=tensor_parallel,
                distributed_executor_backend="mp" if tensor_parallel > 1 else "uni",
            )
        except Exception as e:  # noqa: BLE001 - the test reads what vLLM says, whatever its type
            print(f"ERROR: {model}:", type(e).__name__, " ".join(str(e).split()), flush=True)
            failed = True
            continue
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        result = [
            {
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
            }
            for o in outputs
        ]
        print("RESULT", json.dumps({"model": model, "outputs": result}), flush=True)
        llm.llm_engine.engine_core.shutdown()  # its engine process (and workers) gone before the next model's start
        del llm
        gc.collect()
    sys.exit(1 if failed else 0)
