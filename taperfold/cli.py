"""The `taperfold` command line. Thin: each command parses options and calls the library."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from taperfold.errors import NumericMismatch, TaperfoldError


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="taperfold")
def cli() -> None:
    """Export, fold, verify and benchmark transformers trained with TaperNorm.

    \b
    Typical flow:
      taperfold train --preset tiny --out tiny.pt
      taperfold export tiny.pt --onnx -o out/
      taperfold verify out/
      taperfold bench out/ --engine ort
    """


# ---- commands are registered below, one section per command --------------------------------------


# ---- train -------------------------------------------------------------------------------------------


@cli.command()
@click.option("--arch", type=click.Choice(["llama", "gpt2"]), default="llama", show_default=True)
@click.option("--preset", type=click.Choice(["tiny", "paper-30m", "gpt2-124m"]), default="tiny", show_default=True)
@click.option("--taper", type=click.Choice(["internal", "all", "none"]), default="internal", show_default=True,
              help="internal: every norm but the final one tapers; all: the final one too; none: the baseline.")
@click.option("--aux/--no-aux", default=True, show_default=True, help="Fixed-target scale anchoring loss (eq. 5).")
@click.option("--steps", type=click.IntRange(min=10), default=600, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--data", "data", type=click.Path(dir_okay=False), multiple=True,
              help="Text file(s) to train on, as bytes. Default: the Python standard library's sources.")
@click.option("--out", "-o", type=click.Path(), required=True,
              help="Checkpoint to write: NAME.pt, NAME.safetensors, or a directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def train(arch, preset, taper, aux, steps, batch_size, lr, seed, data, out, as_json):
    """Train a preset through the whole taper schedule; the checkpoint's gate is exactly 0."""
    from taperfold.checkpoint import save_checkpoint
    from taperfold.models import preset_config
    from taperfold.train import TrainOptions, train as run_training
    from taperfold.ui import train_progress

    cfg = preset_config(preset, arch=arch, taper=taper, aux=aux)
    opts = TrainOptions(steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    with train_progress(steps, quiet=as_json) as on_step:
        result = run_training(cfg, opts, [Path(d) for d in data] or None, on_step=on_step)
    save_checkpoint(result.checkpoint, out)
    summary = {"checkpoint": out, "arch": arch, "preset": preset, "taper": taper, "aux": aux and taper != "none",
               "steps": steps, "gate": result.checkpoint.gate, "val_loss": round(result.val_loss, 4),
               "seconds": round(result.seconds, 1)}
    if as_json:
        _print_json(summary)
    else:
        click.echo(f"validation loss {result.val_loss:.4f} (gate {result.checkpoint.gate:g}, {steps} steps, "
                   f"{result.seconds:.0f} s) -> {out}")


# ---- inspect -----------------------------------------------------------------------------------------


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
def inspect(checkpoint, as_json):
    """Architecture, parameters, every norm layer and whether export can fold it."""
    from taperfold.checkpoint import load_checkpoint
    from taperfold.inspect import describe_checkpoint
    from taperfold.ui import print_inspect

    info = describe_checkpoint(load_checkpoint(checkpoint))
    _print_json(info) if as_json else print_inspect(info)


# ---- export ------------------------------------------------------------------------------------------


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--onnx", "to_onnx", is_flag=True, default=True, help="Write ONNX models (always on).")
@click.option("--trt", "to_trt", is_flag=True, help="Also build a TensorRT engine from model.onnx (needs a GPU).")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default="taperfold-out", show_default=True)
@click.option("--logits", type=click.Choice(["last", "all"]), default="last", show_default=True,
              help="last: logits of the final position only (the paper's benchmark mode).")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option("--opset", type=click.IntRange(18, 23), default=20, show_default=True)
@click.option("--kv-cache", is_flag=True, help="Also export KV-cached decoders (*.decoder.onnx) for bench --mode decode.")
@click.option("--force-gate0", is_flag=True, help="Export a checkpoint whose gate is not 0 as if it were 0.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON on stdout.")
def export(checkpoint, to_onnx, to_trt, out_dir, logits, dtype, opset, kv_cache, force_gate0, as_json):
    """Export CHECKPOINT to ONNX: folded model.onnx, unfolded.onnx, baseline.onnx and manifest.json."""
    from taperfold.export import ExportOptions, export_checkpoint
    from taperfold.ui import print_export, stage_status

    if to_trt:
        from taperfold.trt import require_tensorrt

        require_tensorrt()  # fail before the ONNX export, and write nothing
    opts = ExportOptions(logits=logits, dtype=dtype, opset=opset, kv_cache=kv_cache, force_gate0=force_gate0)
    with stage_status(quiet=as_json) as on_stage:
        result = export_checkpoint(checkpoint, out_dir, opts, on_stage=on_stage)
        if to_trt:
            from taperfold.trt import build_engine_for_export

            build_engine_for_export(result.out_dir, on_stage=on_stage)
    _print_json(result.manifest) if as_json else print_export(result.manifest, result.out_dir)



def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("taperfold: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2 if e.exit_code == 2 else e.exit_code)
    except TaperfoldError as e:
        click.echo(f"taperfold: error: {e}", err=True)
        sys.exit(e.exit_code)
    except NumericMismatch as e:
        click.echo(f"taperfold: FAILED: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("taperfold: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
