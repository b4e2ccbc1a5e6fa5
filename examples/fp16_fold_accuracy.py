"""Is a folded fp16 model closer to the fp32 model than the unfolded one? Measured with `taperfold verify`.

For each model, an fp16 export (unfolded.onnx: the tapered norms as fp16 Muls at run time; model.onnx:
c·γ̃ folded into the next weights in float64, cast once) is compared with the fp32 checkpoint in torch,
on verify's default token batches. Models: random g = 0 weights (tiny llama and gpt2, three seeds) and
a tiny llama trained through the whole taper.

    .venv/bin/python examples/fp16_fold_accuracy.py --json fp16.json [--models trained --train-steps 100]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.models import preset_config, random_gate0_model
from taperfold.train import TrainOptions, train
from taperfold.verify import verify_export


def measure(ckpt: Path, work: Path) -> dict:
    out = export_checkpoint(ckpt, work / "out", ExportOptions(dtype="fp16", baseline=False)).out_dir
    pairs = {p.name: p.metrics for p in verify_export(out, threads=1).pairs}
    unfolded, folded = pairs["checkpoint -> unfolded"], pairs["checkpoint -> folded"]
    return {
        "unfolded_max_rel": unfolded.max_rel,
        "folded_max_rel": folded.max_rel,
        "unfolded_mean_abs": unfolded.mean_abs,
        "folded_mean_abs": folded.mean_abs,
        "unfolded_kl": unfolded.kl,
        "folded_kl": folded.kl,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--models", default="random,trained", help="random, trained, or both")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        kinds = args.models.split(",")
        models = (
            []
            if "random" not in kinds
            else [
                (
                    f"tiny {arch}, random g=0, seed {seed}",
                    lambda arch=arch, seed=seed: checkpoint_from_model(random_gate0_model("tiny", arch, seed), step=0),
                )
                for arch in ("llama", "gpt2")
                for seed in range(3)
            ]
        )
        if "trained" in kinds:
            models.append(
                (
                    f"tiny llama, trained {args.train_steps} steps",
                    lambda: (
                        train(
                            preset_config("tiny", arch="llama", taper="internal"),
                            TrainOptions(steps=args.train_steps, batch_size=8, seq_len=64, eval_batches=2),
                        ).checkpoint
                    ),
                )
            )
        for i, (name, make) in enumerate(models):
            ckpt = save_checkpoint(make(), tmp / f"m{i}.pt")
            row = {"model": name, **measure(Path(ckpt), tmp / f"w{i}")}
            row["ratio_max_rel"] = row["folded_max_rel"] / row["unfolded_max_rel"]
            row["ratio_mean_abs"] = row["folded_mean_abs"] / row["unfolded_mean_abs"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| model | max rel unfolded | max rel folded | folded/unfolded | mean abs folded/unfolded |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['unfolded_max_rel']:.3g} | {r['folded_max_rel']:.3g} | "
            f"{r['ratio_max_rel']:.2f} | {r['ratio_mean_abs']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
