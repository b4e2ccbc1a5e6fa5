"""Write a g = 0 checkpoint with random weights in a preset's shape: a timing model for `taperfold bench`
that needs no training (random c and γ̃ in every tapered norm, so that no norm is a multiply by ones).

    python examples/random_checkpoint.py paper-30m paper30m.pt
    taperfold export paper30m.pt -o paper30m/ --kv-cache
    taperfold bench paper30m/ --engine ort
"""

import argparse

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.models import PRESETS, random_gate0_model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("preset", choices=sorted(PRESETS))
parser.add_argument("out", help="NAME.pt, NAME.safetensors or a directory")
parser.add_argument("--arch", choices=["llama", "gpt2"], default="llama")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

model = random_gate0_model(args.preset, args.arch, args.seed)
save_checkpoint(checkpoint_from_model(model, step=0, meta={"random_weights": True}), args.out)
print(f"{args.preset} ({args.arch}) at gate 0 with random weights -> {args.out}")
