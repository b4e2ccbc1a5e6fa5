"""What int4 and int8 cost a trained model, folded or not, and a plain model trained the same way (docs/benchmarks.md).

    python examples/quantized_quality.py [--workdir runs/quantized-quality] [--steps 600] [--threads 2]

Builds a small byte-level Llama (hidden 192, 4 layers, 6 heads / 2 KV heads, SwiGLU 512, context 128, vocab 256;
random initialisation, nothing downloaded; hidden 256 would put it past the builder, see docs/deployment.md), then
trains it twice on the Python standard library's sources (taperfold train's default corpus, its first 4 MB) with the
same loop, data order and learning rate: through the taper (Internal-Taper, +aux) and plain (--taper none). Each is
exported with --genai --quantize int4,int8 --kv-cache growing and verified on held-out text (the standard library's
typing.py, which lies past the training corpus), every command printed as it runs. The tapered model takes the
builder route (onnxruntime-genai's builder makes its folders, MatMulNBits blocks of 32), and is exported a second
time on the traced route; the plain one takes the traced route (the builder route needs a tapered model). So every
variant's decoder is also quantized alike, by ONNX Runtime's quantizer with the builder's settings, and scored on the
same tokens. The table it prints, from the verify.json files, is what docs/benchmarks.md records.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import typing
from pathlib import Path

SHAPE = dict(
    vocab_size=256,
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=128,  # the length it trains at: verify's windows stay within it
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def make_directory(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SHAPE)).save_pretrained(folder)


def held_out_text() -> Path:
    """typing.py, checked to lie past the bytes `taperfold train` reads from the standard library."""
    from taperfold.train import TrainOptions, default_corpus_files

    text, read = Path(typing.__file__), 0
    for path in default_corpus_files():
        if read >= TrainOptions().max_corpus_bytes:
            break
        if path == text:
            raise SystemExit(f"{text} is part of the training corpus on this Python; pick another held-out text")
        read += path.stat().st_size
    return text


def run(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def table(reports: dict[str, Path]) -> None:
    """One row per quantized artifact (and its fp32 decoder), from each model's verify.json."""
    print("| model | artifact | top-1 | top-1 decisive | KL | perplexity (fp32 torch -> artifact) | x | tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for model, path in reports.items():
        for pair in json.loads(path.read_text())["pairs"]:
            m = pair["metrics"]
            quantized = any(f".{precision}" in pair["candidate"] for precision in ("int4", "int8"))
            if pair["kind"] != "export" or not m or not (m["scored"] or quantized):
                continue
            perplexity, ratio = "", ""  # a prefill graph of last-position logits scores no token
            if m["scored"]:
                ref, cand = math.exp(m["nll_reference"]), math.exp(m["nll_candidate"])
                perplexity, ratio = f"{ref:.4f} -> {cand:.4f}", f"{cand / ref:.4f}"
            print(
                f"| {model} | {pair['candidate']} | {m['top1']:.4f} | {m['top1_decisive']:.4f} | {m['kl']:.3g} | "
                f"{perplexity} | {ratio} | {m['scored']} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/quantized-quality"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    work = args.workdir
    plain = work / "plain"
    if not plain.is_dir():
        make_directory(plain)
    text = held_out_text()
    taperfold = [sys.executable, "-m", "taperfold.cli"]
    reports = {}
    for name, taper, route in (("tapered", "internal", "auto"), ("tapered", "internal", "traced"),
                               ("plain-trained", "none", "auto")):  # fmt: skip
        trained, out = work / name, work / f"{name}-{route}-out"
        if not trained.is_dir():
            run(*taperfold, "train", "--from", str(plain), "--taper", taper, "--steps", str(args.steps), "-o",
                str(trained))  # fmt: skip
        run(*taperfold, "export", str(trained), "-o", str(out), "--genai", "--genai-route", route, "--quantize",
            "int4,int8", "--kv-cache", "growing", "--overwrite")  # fmt: skip
        verify = [*taperfold, "verify", str(out), "--text", str(text), "--threads", str(args.threads)]
        print("$", " ".join(verify), flush=True)
        subprocess.run(verify, check=False)  # exit 1 when a pair is out of its bounds: the table says which
        reports[f"{name} ({route})"] = out / "verify.json"
    table(reports)


if __name__ == "__main__":
    main()
