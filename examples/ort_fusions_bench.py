"""What `export --ort-fusions` does to decode speed: an export's growing-cache decoders as traced and with ONNX
Runtime's LLM fusions (the pass export runs, taperfold.passes.ort_fusions), timed side by side (docs/benchmarks.md).

    python examples/ort_fusions_bench.py EXPORT [--variants folded,unfolded] [--batch 1,4] [--rounds 5]

EXPORT: a `taperfold export ... --kv-cache growing --opset 20` directory made without --ort-fusions (20: the opset
--ort-fusions takes, whose plain attention ops the fusions match; docs/opsets.md#ort-fusions). Each variant's decoder is
fused into a scratch folder; then every contender generates greedily (the prompt through the decoder with an empty
cache, then one token a step), contenders alternated in rounds, the order rotated each round, ONNX Runtime on the
CPU with --threads intra-op threads. Decode throughput is the steps' tokens over their time, back to back; prefill
the prompt's call alone. Prints a JSON report (tokens identical to the unfused graph's are checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def fused_copy(source: Path, folder: Path) -> tuple[Path, dict, float]:
    import onnx_ir as ir

    from taperfold.passes.ort_fusions import OrtFusionsPass

    model = ir.load(source)
    fusions = OrtFusionsPass()
    start = time.perf_counter()
    fusions(model)
    seconds = time.perf_counter() - start
    target = folder / source.name
    ir.save(model, target, external_data=target.name + ".data")
    return target, fusions.fused, seconds


def generate(session, ids: np.ndarray, new_tokens: int) -> tuple[float, float, np.ndarray]:
    """(prefill ms, decode tokens/s, the tokens) of one greedy generation."""
    batch = ids.shape[0]
    past = {
        i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32)
        for i in session.get_inputs()
        if i.name != "input_ids"
    }
    presents = [o.name for o in session.get_outputs()][1:]
    start = time.perf_counter()
    out = session.run(None, {"input_ids": ids, **past})
    prefilled = time.perf_counter()
    tokens = []
    for _ in range(new_tokens):
        token = out[0].argmax(-1)[:, None].astype(np.int64)
        tokens.append(token)
        past = {name.replace("present", "past_key_values"): v for name, v in zip(presents, out[1:], strict=True)}
        out = session.run(None, {"input_ids": token, **past})
    done = time.perf_counter()
    return (prefilled - start) * 1e3, batch * new_tokens / (done - prefilled), np.concatenate(tokens, axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--variants", default="folded,unfolded")
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import onnxruntime as ort

    manifest = json.loads((args.export / "manifest.json").read_text())
    files = {v: args.export / manifest["artifacts"][f"{v}.decoder"]["path"] for v in args.variants.split(",")}
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    report: dict = {
        "export": str(args.export),
        "threads": args.threads,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "onnxruntime": ort.__version__,
        "fusions": {},
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="ort-fusions-") as scratch:
        contenders = {}
        for variant, path in files.items():
            fused, ops, seconds = fused_copy(path, Path(scratch))
            report["fusions"][variant] = {"ops": ops, "seconds": round(seconds, 1)}
            for label, graph in ((variant, path), (f"{variant} + ort-fusions", fused)):
                contenders[label] = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        vocab = manifest["config"]["vocab_size"]
        for batch in map(int, args.batch.split(",")):
            ids = np.random.default_rng(0).integers(3, vocab, (batch, args.prompt)).astype(np.int64)
            runs: dict[str, list] = {label: [] for label in contenders}
            for session in contenders.values():
                generate(session, ids, args.new_tokens)  # warm-up
            labels = list(contenders)
            for r in range(args.rounds):
                for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                    runs[label].append(generate(contenders[label], ids, args.new_tokens))
            for label, results in runs.items():
                reference = runs[label.removesuffix(" + ort-fusions")][0][2]
                report["rows"].append(
                    {
                        "contender": label,
                        "batch": batch,
                        "decode_tok_s": round(statistics.median(r[1] for r in results), 1),
                        "prefill_ms": round(statistics.median(r[0] for r in results), 1),
                        "same_tokens_as_unfused": all(np.array_equal(r[2], reference) for r in results),
                    }
                )
                print(json.dumps(report["rows"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
