"""A model family taperfold does not ship, added from outside the package: GPT-J.

GPT-J (transformers' `GPTJForCausalLM`) is a pre-norm LayerNorm model whose attention and MLP run in parallel on
the layer input: one `ln_1` read by attention's q_proj, k_proj, v_proj and by the MLP's fc_in, a final
`transformer.ln_f` before the head. That is all taperfold needs to know, as data. This script registers it
through the public registry, then runs the whole chain on a tiny random GPT-J built from a config (nothing is
downloaded), in a temporary folder it removes afterwards:

    taper and fine-tune through the taper -> fold in torch -> export -> verify -> fold the unfolded graph again

    python examples/plugin_family.py        # exit 0: every tapered norm folded and verify passed; 1 otherwise

docs/extending.md walks through it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPTJConfig
from transformers.utils import logging as hf_logging

from taperfold.export import ExportOptions, export_checkpoint
from taperfold.families import Family, register
from taperfold.passes import NormStatus, fold_onnx_file
from taperfold.sources import fine_tune, open_source
from taperfold.train import TrainOptions
from taperfold.variants import fold_in_torch
from taperfold.verify import verify_export

GPTJ = register(
    Family(
        name="gptj",
        model_types=("gptj",),
        norm="ln",  # nn.LayerNorm with a bias: tapered by TaperLN
        layers="transformer.h",
        internal={"ln_1": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in")},  # attention and MLP read ln_1
        final="transformer.ln_f",
    )
)


def tiny_gptj(folder: Path) -> Path:
    """A random tiny GPT-J saved as a plain save_pretrained directory, its norm gains and biases random
    too (a fold that dropped one would show)."""
    config = GPTJConfig(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.1, 0.1)
    model.save_pretrained(folder)
    return folder


def torch_fold_error(tapered: Path) -> float:
    """Max relative difference between the tapered model at g = 0 and its fold in torch (which follows the
    family's readers: a reader left out of `internal` shows here)."""
    model = open_source(tapered).build(gate=0.0)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = model(ids, logits="all"), fold_in_torch(model)(ids, logits="all")
    return float((got - expected).abs().max() / expected.abs().max())


def main() -> int:
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="taperfold-plugin-") as tmp:
        tmp = Path(tmp)
        plain = tiny_gptj(tmp / "plain")
        result = fine_tune(
            plain,
            TrainOptions(steps=30, batch_size=4, seq_len=32, eval_batches=2, lr=1e-3),
            None,
            taper="internal",
            aux=True,
        )
        tapered = result.save(tmp / "tapered")
        print(
            f"tapered {len(result.model.tapering.norms)} norms of {GPTJ.name}, trained to gate "
            f"{result.gate:g} (validation loss {result.val_loss:.3f})"
        )

        torch_error = torch_fold_error(tapered)
        print(f"fold in torch: max rel {torch_error:.2e} from the tapered model")

        export = export_checkpoint(tapered, tmp / "export", ExportOptions())
        summary = export.manifest.report("folded", "fold")["summary"]
        print(f"export: {summary['folded']} folded, {summary['kept']} kept, {summary['real_norm']} real norm(s)")

        report = verify_export(export.out_dir)
        for pair in report.pairs:
            metrics = f"max rel {pair.metrics.max_rel:.2e}" if pair.metrics else pair.reason
            print(f"verify: {pair.name}: {pair.status} ({metrics})")

        refold = fold_onnx_file(export.out_dir / "unfolded.onnx", tmp / "refolded.onnx")
        folded_again = refold.count(NormStatus.FOLDED)
        print(f"fold unfolded.onnx: {folded_again} folded, {refold.count(NormStatus.KEPT)} kept")

        tapered_norms = len(result.model.tapering.norms)
        ok = (
            torch_error <= 1e-5
            and summary["folded"] == tapered_norms
            and summary["kept"] == 0
            and folded_again == tapered_norms
            and report.passed
        )
    print("PASS: every tapered norm folded and verify passed" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
