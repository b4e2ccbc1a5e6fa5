"""The Hugging Face side of taperfold's commands (called from taperfold.cli, which stays thin)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from taperfold.errors import TaperfoldError


def train_from(source: str, out: str, taper: str, aux: bool, opts, data_files, as_json: bool) -> None:
    """`taperfold train --from HF_DIR`: fine-tune through the whole taper, write a tapered directory."""
    from taperfold.hf.directory import require_transformers, save_hf_directory
    from taperfold.hf.training import train_hf_directory
    from taperfold.ui import train_progress

    out_path = Path(out)
    if taper == "none":
        raise TaperfoldError("--taper none with --from: nothing to train through; choose internal or all")
    if out_path.suffix in (".pt", ".safetensors") or (out_path.exists() and not out_path.is_dir()):
        raise TaperfoldError(f"{out}: --out with --from is a directory (a tapered save_pretrained directory)")
    if out_path.resolve() == Path(source).resolve():
        raise TaperfoldError(f"{out}: --out must differ from --from (the source directory is never overwritten)")
    require_transformers(f"{source} (a Hugging Face directory)")
    with train_progress(opts.steps, quiet=as_json) as on_step:
        result = train_hf_directory(source, opts, data_files, taper=taper, aux=aux, on_step=on_step)
    save_hf_directory(result.model, out_path, step=opts.steps, schedule=result.schedule,
                      tokenizer_from=Path(source) if result.tokenizer is not None else None)
    gate = result.model.tapering.gate.value
    summary = {"checkpoint": out, "from": source, "taper": taper, "aux": aux, "steps": opts.steps, "gate": gate,
               "val_loss": round(result.val_loss, 4), "seconds": round(result.seconds, 1),
               "tokenizer": "hf" if result.tokenizer is not None else "bytes"}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo(f"validation loss {result.val_loss:.4f} (gate {gate:g}, {opts.steps} steps, "
                   f"{result.seconds:.0f} s) -> {out}")
