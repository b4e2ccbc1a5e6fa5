"""onnxruntime-genai decode speed of the builder route on SmolLM2-135M's shape (docs/benchmarks.md).

    python examples/genai_bench.py [--workdir runs/genai-bench] [--threads 2] [--quantize int4]
    python examples/genai_bench.py --route traced --ort-fusions --iters 5 --rounds 5

Builds a random-weight Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, SwiGLU 1536, vocab
49152, tied embeddings; nothing downloaded), tapers it (Internal-Taper) with random c and γ̃ at g = 0, writes it as a
tapered save_pretrained directory with a word-level tokenizer (the builder saves one), then runs, each in a fresh
process and printed as it runs:

    taperfold export DIR -o OUT --genai --no-baseline [--quantize int4]   the builder route: baseline and folded
    taperfold bench OUT --engine genai --mode decode --against genai-builder
                                       baseline, unfolded, folded and the builder's own folder, in alternating rounds
    with --quantize, the same bench with --precision int4, and verify on 4 random 64-token prompts

`--route traced` makes the folders from taperfold's traced growing-cache decoders instead (`--genai-route traced`,
with `--ort-fusions` ONNX Runtime's fusions on them: GroupQueryAttention with the rotary fused) into OUT-traced[-fused],
and times their unfolded and folded models against the builder's graph of the untapered model: the traced decoder
beside the builder's form of it.

The export's stage timings, the bench reports (copied to OUT/bench-decode-PRECISION.json) and verify.json are what
docs/benchmarks.md records.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
from pathlib import Path

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def write_word_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A word-level tokenizer of `vocab_size` words `<i>` (space-separated ids; bos <1>, eos <2>) saved in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<1>", eos_token="<2>", unk_token="<0>")
    tokenizer.save_pretrained(folder)
    return folder


def make_directory(folder: Path) -> None:
    import torch
    import transformers

    from taperfold.hf import save_hf_directory, taper_model

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SHAPE)).eval()
    tapering = taper_model(model, "internal")
    with torch.no_grad():
        for norm in tapering.norms.values():
            norm.weight_tilde.uniform_(0.5, 1.5)
            norm.c.uniform_(0.5, 2.0)
            norm.calibrated.fill_(True)
    tapering.set_gate(0.0)
    tokenizer = write_word_tokenizer(folder.parent / "tokenizer", SHAPE["vocab_size"])
    save_hf_directory(model, folder, tokenizer_from=tokenizer)


def run(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/genai-bench"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize", choices=["int4", "int8"], help="also quantize, and time and verify that form")
    parser.add_argument("--route", choices=["builder", "traced"], default="builder", help="how export makes folders")
    parser.add_argument("--ort-fusions", action="store_true", help="the traced route's decoders with --ort-fusions")
    parser.add_argument("--iters", type=int, default=15, help="generations per contender and round")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    traced = args.route == "traced"
    suffix = ("-traced" + ("-fused" if args.ort_fusions else "")) if traced else ""
    source, out = args.workdir / "smollm2-135m-shape", args.workdir / f"out{suffix}"
    if not source.is_dir():
        make_directory(source)
    taperfold = [sys.executable, "-m", "taperfold.cli"]
    quantize = ["--quantize", args.quantize] if args.quantize else []
    route = ["--genai-route", "traced"] + (["--ort-fusions"] if args.ort_fusions else []) if traced else []
    run(*taperfold, "export", str(source), "-o", str(out), "--genai", *route, "--no-baseline", "--overwrite", *quantize)
    variants = ["--variants", "unfolded,folded"] if traced else []  # the traced route exports no baseline decoder
    for precision in ["fp32"] + ([args.quantize] if args.quantize else []):
        quantized = ["--precision", precision] if precision != "fp32" else []
        run(
            *taperfold, "bench", str(out), "--engine", "genai", "--mode", "decode", "--batch", "1,4", "--prompt",
            "128", "--new-tokens", "64", "--warmup", "3", "--iters", str(args.iters), "--rounds", str(args.rounds),
            "--threads", str(args.threads), "--against", "genai-builder", *variants, *quantized,
        )  # fmt: skip
        shutil.copyfile(out / "bench-decode.json", out / f"bench-decode-{precision}.json")
    if args.quantize:
        tokens = out.parent / "tokens.txt"
        rng = random.Random(0)
        tokens.write_text(
            "\n".join(" ".join(str(rng.randrange(3, SHAPE["vocab_size"])) for _ in range(64)) for _ in range(4))
        )
        run(*taperfold, "verify", str(out), "--tokens", str(tokens), "--threads", str(args.threads))


if __name__ == "__main__":
    main()
