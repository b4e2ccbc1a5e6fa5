"""The `taperfold` command line. Thin: each command parses options and calls the library."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import click

from taperfold.clickutil import SEED, AliasedOption, FiniteFloatRange
from taperfold.compare import tolerance_help
from taperfold.engines import ENGINES
from taperfold.errors import NumericMismatch, TaperfoldError
from taperfold.exportdir import DTYPES, KV_CACHES, LOGITS, VARIANT_TABLE, VARIANTS, Graph, kv_cache
from taperfold.interrupts import interrupted_line
from taperfold.opsets import MAX_OPSET, MIN_OPSET, TARGETS
from taperfold.presets import ARCHS, PRESETS, STAND_IN_NORMS
from taperfold.quantize import BITS

MAX_THREADS = 1024
# Shorter schedules diverged: 10-24 steps from scratch in 5 of 12 runs (tiny llama and gpt2, seeds 0-2), 30 in none
# (docs/training.md). The library's TrainOptions takes any count.
MIN_STEPS = 30


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="taperfold")
def cli() -> None:
    """Export, fold, verify and benchmark transformers trained with TaperNorm.

    \b
    Typical flow:
      taperfold train --preset tiny -o tiny.pt
      taperfold export tiny.pt -o out/
      taperfold verify out/
      taperfold bench out/ --engine ort
    """


# ---- commands are registered below, one section per command --------------------------------------


# ---- fold -----------------------------------------------------------------------------------------
@cli.command("fold")
@click.argument("src", metavar="IN.onnx", type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--output",
    "dst",
    metavar="OUT.onnx",
    required=True,
    type=click.Path(dir_okay=False),
    help="The folded model; its weights go to OUT.onnx.data.",
)
@click.option(
    "--report", "report_path", type=click.Path(dir_okay=False), help="Also write the report as JSON here ('-': stdout)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout instead of a table.")
@click.option(
    "--merge-norm-weights",
    is_flag=True,
    help="Also move the gain (γ, β) of real RMSNorm/LayerNorm layers into the layers that read them, "
    "as QuaRot/SpinQuant do. The norms stay; reported as weights_merged, never as folded.",
)
@click.option(
    "--fuse-projections",
    is_flag=True,
    help="Also fuse the linear layers that read one tensor (q/k/v, gate/up) into one layer and a Split "
    "(weights concatenated, no arithmetic; docs/folding.md). Off: fold does only the fold.",
)
@click.option(
    "--verify",
    "verify_fold",
    is_flag=True,
    help="Run IN and OUT in ONNX Runtime on inputs made from the graph's signature and compare every "
    "output (exit 1 on a mismatch).",
)
@click.option("--shapes", metavar="NAME:1x16,...", help="--verify: shapes of inputs with dynamic dimensions.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="--verify: seed of the generated inputs.")
def fold_command(src, dst, report_path, as_json, merge_norm_weights, fuse_projections, verify_fold, shapes, seed):
    """Fold g = 0 TaperNorm / TaperLN layers of IN.onnx into the linear layers that read them.

    Real RMSNorm / LayerNorm layers are never folded: with nothing to fold, OUT is IN unchanged.
    See docs/folding.md for which graph shapes fold and why. Exit 0: written (and, with --verify,
    within tolerance); 1: --verify found a mismatch; 2: bad input.
    """
    from taperfold.fsutil import Output, check_outputs, onnx_external_files
    from taperfold.passes import fold_onnx_file
    from taperfold.passes.check_fold import check_inputs, fold_and_check, parse_shapes
    from taperfold.ui import err, out, print_fold_check, print_fold_report

    wanted = parse_shapes(shapes)  # a bad --shapes fails before any work
    plan = check_outputs(
        [Output(dst, "-o", sidecars=(".data",)), Output(report_path, "--report", stream=True)],
        inputs=[src, *onnx_external_files(src)],
    )
    if as_json and plan.uses_stdout:
        raise click.UsageError("--json and --report - both write to stdout; pass one")
    if verify_fold:
        check_inputs(src, wanted)  # an input --verify cannot generate fails before anything is written
    options = {"merge_norm_weights": merge_norm_weights, "fuse_projections": fuse_projections}
    check = None
    if verify_fold:  # checked before it is put in place: a refusal leaves no output
        report, check = fold_and_check(src, dst, report_path, wanted, seed, **options)
    else:
        report = fold_onnx_file(src, dst, report_path, **options)
    if as_json:
        _print_json({**report.to_json(), **({"verify": check.to_dict()} if check else {})})
    else:
        console = err if plan.uses_stdout else out  # stdout holds the JSON report
        print_fold_report(src, dst, report, console)
        if check:
            print_fold_check(check, console)
    if check and not check.passed:
        raise NumericMismatch(check.failure_message())


# ---- train -------------------------------------------------------------------------------------------


@cli.command()
@click.option("--arch", type=click.Choice(list(ARCHS)), default="llama", show_default=True)
@click.option("--preset", type=click.Choice(list(PRESETS)), default="tiny", show_default=True)
@click.option(
    "--taper",
    type=click.Choice(["internal", "all", "none"]),
    default="internal",
    show_default=True,
    help="internal: every norm but the final one tapers; all: the final one too; none: the baseline.",
)
@click.option(
    "--norm",
    type=click.Choice(STAND_IN_NORMS),
    default=None,
    help="Put DyT (Zhu et al. 2025: tanh(αh)·γ + β, no gate) where --taper says instead of tapering the "
    "norms, and a learnable scalar after the embedding; export folds its γ and β and keeps the tanh "
    "(docs/dyt.md).",
)
@click.option(
    "--aux/--no-aux",
    default=True,
    show_default=True,
    help="Fixed-target scale anchoring loss (eq. 5); none with --norm dyt.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=MIN_STEPS),
    default=600,
    show_default=True,
    help=f"Optimizer steps; at least {MIN_STEPS}, the shortest schedule that settles at g = 0 (docs/training.md).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--lr", type=FiniteFloatRange(min=0, min_open=True), default=2e-3, show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option(
    "--data",
    "data",
    type=click.Path(dir_okay=False),
    multiple=True,
    help="Text file(s) to train on, as bytes. Default: the Python standard library's sources.",
)
@click.option(
    "-o",
    "--output",
    "--out",
    "out",
    type=click.Path(),
    required=True,
    cls=AliasedOption,
    aliases=("--out",),
    help="Checkpoint to write: NAME.pt, NAME.safetensors, or a directory.",
)
@click.option(
    "--from",
    "source",
    type=click.Path(),
    metavar="HF_DIR",
    help="Fine-tune this Hugging Face save_pretrained directory instead of a preset (--arch and "
    "--preset are ignored); -o is then a tapered Hugging Face directory (with --taper none: a plain one, trained "
    "with the same loop, the baseline to compare with).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def train(arch, preset, taper, norm, aux, steps, batch_size, lr, seed, data, out, source, as_json):
    """Train a preset through the whole taper schedule; the checkpoint's gate is exactly 0. With --norm dyt, train
    a DyT model instead (no gate: it is foldable from the start)."""
    from taperfold.checkpoint import checkpoint_output
    from taperfold.fsutil import check_outputs
    from taperfold.models import preset_config
    from taperfold.train import TrainOptions
    from taperfold.train import train as train_preset
    from taperfold.ui import print_trained, train_progress

    aux = aux and norm is None
    if norm and taper == "none":
        raise TaperfoldError(
            f"--norm {norm} with --taper none: --taper says which norms {norm} replaces (internal or all)"
        )
    if norm and source:
        raise TaperfoldError(
            f"--norm {norm} with --from: a Hugging Face model takes DyT through the Python API "
            "(taperfold.hf.taper_model(model, kind='dyt')), not train --from"
        )
    check_outputs([checkpoint_output(out, "-o")], inputs=[*data, source])
    if source:
        _check_fine_tune(source, out)
    opts = TrainOptions(steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    files = [Path(d) for d in data] or None
    with train_progress(steps, quiet=as_json) as on_step:
        if source:
            from taperfold.sources import fine_tune

            result = fine_tune(source, opts, files, taper=taper, aux=aux, on_step=on_step)
        else:
            result = train_preset(
                preset_config(preset, arch=arch, taper=taper, norm=norm, aux=aux), opts, files, on_step=on_step
            )
    result.save(out)
    gate = result.gate
    summary = {
        "checkpoint": out,
        **({"from": source} if source else {"arch": arch, "preset": preset}),
        "taper": taper,
        "norm": norm,
        "aux": aux and taper != "none",
        "steps": steps,
        "gate": gate,
        "val_loss": round(result.val_loss, 4),
        "seconds": round(result.seconds, 1),
        "tokenizer": result.tokenizer_name,
    }
    if as_json:
        _print_json(summary)
    else:
        print_trained(result.val_loss, gate, steps, result.seconds, out)


def _check_fine_tune(source: str, out: str) -> None:
    """`train --from`: what can be refused before anything is read."""
    out_path = Path(out)
    if out_path.suffix in (".pt", ".safetensors") or (out_path.exists() and not out_path.is_dir()):
        raise TaperfoldError(f"{out}: --out with --from is a directory (a save_pretrained directory)")
    if out_path.resolve() == Path(source).resolve():
        raise TaperfoldError(f"{out}: --out must differ from --from (the source directory is never overwritten)")


# ---- inspect -----------------------------------------------------------------------------------------


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
def inspect(checkpoint, as_json):
    """Architecture, parameters, every norm layer and whether export can fold it."""
    from taperfold.describe import describe
    from taperfold.sources import open_source
    from taperfold.ui import print_inspect

    info = describe(open_source(checkpoint))
    _print_json(info.to_json()) if as_json else print_inspect(info)


# ---- export ------------------------------------------------------------------------------------------


class _KindOptionsCommand(click.Command):
    """`taperfold export`: its own options, and after --onnx every registered artifact kind's (ArtifactKind.options,
    shipped kinds and plug-ins: taperfold.artifacts.command_options), asked for when the command is parsed or its
    help shown, so that `taperfold` alone imports no kind and a kind registered before then is offered."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        own = super().get_params(ctx)
        at = next(i for i, p in enumerate(own) if p.name == "onnx") + 1
        return [*own[:at], *_kind_params(tuple(self.params)), *own[at:]]


_KIND_PARAMS: dict[tuple, list[click.Parameter]] = {}


def _kind_params(own: tuple[click.Parameter, ...]) -> list[click.Parameter]:
    """The click options of the registered kinds' options (the same objects while the kinds are the same)."""
    from taperfold.artifacts import command_options

    declared = command_options()
    key = tuple((kind.name, id(option)) for kind, option in declared)
    if key not in _KIND_PARAMS:
        taken = {name for p in own for name in (p.name, *p.opts, *p.secondary_opts)}
        params: list[click.Parameter] = []
        for kind, option in declared:
            if option.flag in taken or option.key in taken:
                raise TaperfoldError(
                    f"artifact kind {kind.name!r}: option {option.flag} ({option.key}) is one of taperfold export's own"
                )
            params.append(
                click.Option(
                    [option.flag, option.key],
                    is_flag=option.is_flag,
                    type=click.Choice(option.choices) if option.choices else None if option.is_flag else option.type,
                    default=option.default if option.is_flag or option.show_default else None,
                    show_default=option.show_default,
                    metavar=option.metavar,
                    help=option.help,
                )
            )
        _KIND_PARAMS.clear()
        _KIND_PARAMS[key] = params
    return _KIND_PARAMS[key]


@cli.command(cls=_KindOptionsCommand)
@click.argument("checkpoint", type=click.Path())
@click.option(
    "--onnx/--no-onnx",
    "onnx",
    default=True,
    show_default=True,
    help="Write the ONNX graphs. --no-onnx traces nothing and writes only the folders converted from the model "
    "itself (--vllm, --openvino).",
)
@click.option(
    "-o",
    "--output",
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="taperfold-out",
    show_default=True,
    cls=AliasedOption,
    aliases=("--out",),
    help="The export directory; an existing one is replaced whole.",
)
@click.option("--overwrite", is_flag=True, help="Replace -o even if it is a non-empty directory of other files.")
@click.option(
    "--logits",
    type=click.Choice(LOGITS),
    default="last",
    show_default=True,
    help="last: logits of the final position only (the paper's benchmark mode).",
)
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True)
@click.option(
    "--target",
    type=click.Choice(TARGETS),
    help="What runs the graphs: ONNX Runtime or TensorRT; picks each graph's opset and the baseline's "
    "norm form (docs/opsets.md).  [default: trt with --trt, else ort]",
)
@click.option(
    "--opset",
    type=click.IntRange(MIN_OPSET, MAX_OPSET),
    help="One opset for every graph, instead of the per-graph table (docs/opsets.md).",
)
@click.option(
    "--kv-cache",
    metavar="[growing|static]",
    is_flag=False,
    flag_value="growing",
    help="Also export KV-cached decoders for bench --mode decode: growing (the flag alone; *.decoder.onnx, "
    "the cache grows every step), static (*.static.onnx: a fixed-size cache written at a position, "
    "the same shapes every step), or growing,static.",
)
@click.option(
    "--max-cache",
    type=click.IntRange(min=1),
    help="The static cache's length (with --kv-cache static).  [default: the model's context]",
)
@click.option("--force-gate0", is_flag=True, help="Export a checkpoint whose gate is not 0 as if it were 0.")
@click.option(
    "--baseline/--no-baseline",
    default=True,
    show_default=True,
    help="Also export baseline.onnx (plain norms, the benchmark's reference).",
)
@click.option(
    "--fuse-projections/--no-fuse-projections",
    default=True,
    show_default=True,
    help="In every graph, fuse the linear layers that read one tensor (q/k/v, gate/up) into one layer and "
    "a Split (docs/folding.md).",
)
@click.option(
    "--ort-fusions",
    is_flag=True,
    help="After the fold, ONNX Runtime's own LLM fusions on every graph (onnxscript's optimize_for_ort: "
    "MultiHeadAttention, SkipSimplifiedLayerNormalization, ...), baseline-decomposed aside; --target ort only "
    "(docs/deployment.md).",
)
@click.option(
    "--trace-every-layer",
    is_flag=True,
    help="Trace each decoder layer. By default a model whose layers are alike is traced from its first three (and "
    "any first layers unlike the rest) and the others are stamped out from them (docs/design.md, section Tracing).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON on stdout.")
def export(
    checkpoint,
    onnx,
    out_dir,
    overwrite,
    logits,
    dtype,
    target,
    opset,
    kv_cache,
    max_cache,
    force_gate0,
    baseline,
    fuse_projections,
    ort_fusions,
    trace_every_layer,
    as_json,
    **kind_values,
):
    """Export CHECKPOINT to ONNX: folded model.onnx, unfolded.onnx, baseline.onnx and manifest.json;
    with --trt, a TensorRT engine of model.onnx too; with --genai / --openvino / --vllm, those runtimes' folders
    (with --no-onnx, those folders alone that are converted from the model: --vllm, --openvino)."""
    from taperfold.artifacts import default_target, requests
    from taperfold.export import ExportOptions, export_to_dir
    from taperfold.ui import print_export

    opts = ExportOptions(
        logits=logits,
        dtype=dtype,
        opset=opset,
        target=target or "ort",
        decoders=_kv_caches(kv_cache),
        max_cache=max_cache,
        force_gate0=force_gate0,
        baseline=baseline,
        fuse_projections=fuse_projections,
        ort_fusions=ort_fusions,
        stamp_layers=not trace_every_layer,
        onnx=onnx,
    )
    artifacts = requests(kind_values, opts)  # each kind's request, made once from the values of every kind's options
    opts = replace(opts, artifacts=artifacts, target=target or default_target(artifacts))
    result = export_to_dir(checkpoint, out_dir, opts, overwrite=overwrite, quiet=as_json)
    _print_json(result.manifest.to_json()) if as_json else print_export(result.manifest, result.out_dir)


def _kv_caches(option: str | None) -> tuple[Graph, ...]:
    """--kv-cache's value as the decoders to export: none without the flag, the growing one for the flag alone (its
    spelling before static caches), else the comma-separated caches it names (an empty name is refused)."""
    if option is None:
        return ()
    caches = tuple(part.strip() for part in option.split(","))
    if not all(caches):
        raise TaperfoldError(f"--kv-cache {option!r}: name growing, static, or growing,static")
    return tuple(kv_cache(cache) for cache in caches)


# ---- verify ------------------------------------------------------------------------------------------


_VERIFY_HELP = f"""Check DIR's models against the checkpoint they were exported from; write DIR/verify.json.

    Pairs: checkpoint -> unfolded, checkpoint -> folded, unfolded -> folded (the fold alone), the
    plain-norm torch model -> baseline and baseline-decomposed, baseline-decomposed -> baseline (the
    fused norm), checkpoint -> engine when a TensorRT plan exists, and every *.decoder.onnx against
    its torch model (a prompt with an empty past, then KV-cached steps). Inputs: seeded random tokens,
    batch 1 and 4 by sequence 1, 16 and the model's longest (far from the traced shape), unless
    --tokens or --text is given.

    \b
    Default tolerances (export dtype, pair):
      {tolerance_help().replace(chr(10), chr(10) + "      ")}

    A --force-gate0 export is held to the checkpoint at g = 0; the checkpoint at its real gate vs
    model.onnx is reported as the cost of forcing g = 0 and never fails. Exit 0: all pairs pass;
    1: a pair is out of tolerance; 2: bad input.
    """


@cli.command(help=_VERIFY_HELP)
@click.argument("export_dir", metavar="[DIR]", required=False, default="taperfold-out", type=click.Path())
@click.option(
    "--device",
    type=click.Choice(ENGINES["ort"].devices),
    default="cpu",
    show_default=True,
    help="Where ONNX Runtime runs (the PyTorch reference always runs in fp32 on the CPU).",
)
@click.option(
    "--engine",
    type=click.Choice([e.name for e in ENGINES.values() if not e.runs_models]),
    default="ort",
    show_default=True,
    help="What runs the ONNX graphs: ONNX Runtime or OpenVINO (other artifacts run on their own engine). An engine of "
    "artifacts otherwise only checked also runs them: vllm holds vLLM's greedy generations of DIR/vllm/folded "
    "(export --vllm) to the checkpoint's.",
)
@click.option(
    "--tokens",
    "tokens_file",
    type=click.Path(dir_okay=False),
    help="Token ids: .npy integer array, or whitespace-separated ids, one sequence per line.",
)
@click.option(
    "--text",
    "text_file",
    type=click.Path(dir_okay=False),
    help="A text file, encoded with the checkpoint's tokenizer (bytes, or a Hugging Face directory's own), in windows "
    "of its context. With --text or --tokens the decoders decode those tokens too, and each pair reports the "
    "perplexity of both its models.",
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random token batches.")
@click.option(
    "--threads",
    type=click.IntRange(1, MAX_THREADS),
    help="CPU threads for the torch reference and ONNX Runtime. Default: theirs.",
)
@click.option("--rtol", type=FiniteFloatRange(min=0), help="Bound on max |error| / max |reference|, every pair.")
@click.option("--min-top1", type=FiniteFloatRange(0, 1), help="Bound on top-1 agreement (near-ties excluded).")
@click.option("--max-kl", type=FiniteFloatRange(min=0), help="Bound on the mean KL(reference ‖ candidate).")
@click.option(
    "--max-ppl-ratio",
    type=FiniteFloatRange(min=1),
    help="Bound on perplexity(candidate) / perplexity(reference) on --text or --tokens, quantized pairs.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def verify(
    export_dir, device, engine, tokens_file, text_file, seed, threads, rtol, min_top1, max_kl, max_ppl_ratio, as_json
):
    from taperfold.ui import print_verify
    from taperfold.verify import verify_and_write

    if tokens_file and text_file:
        raise click.UsageError("pass --tokens or --text, not both")
    report = verify_and_write(
        export_dir,
        tokens_file=tokens_file,
        text=text_file,
        device=device,
        engine=engine,
        tolerances={"rtol": rtol, "min_top1": min_top1, "max_kl": max_kl, "max_ppl_ratio": max_ppl_ratio},
        seed=seed,
        threads=threads,
        quiet=as_json,
    )
    _print_json(report.to_json()) if as_json else print_verify(report)
    if not report.passed:
        raise NumericMismatch(report.failure_message())


# ---- bench -------------------------------------------------------------------------------------------


def _engine_options(command):
    """One flag per engine option in the registry (e.g. --compile, --ort-optimization, --cuda-graph); an option
    several engines share (--cuda-graph) is one flag."""
    from taperfold.engines import all_options

    for option in reversed(all_options().values()):
        owners = "/".join(e.name for e in ENGINES.values() if option in e.options)
        help_text = f"--engine {owners}: {option.help}"
        if option.choices:
            decorate = click.option(
                option.flag,
                option.name,
                type=click.Choice(option.choices),
                default=option.default,
                show_default=True,
                help=help_text,
            )
        else:
            decorate = click.option(option.flag, option.name, is_flag=True, help=help_text)
        command = decorate(command)
    return command


@cli.command()
@click.argument("export_dir", metavar="[DIR]", required=False, type=click.Path(file_okay=False))
@click.option(
    "--engine", type=click.Choice(list(ENGINES)), help="Default: ort with DIR, torch with --checkpoint or --preset."
)
@click.option(
    "--variants",
    help="Any of "
    + ", ".join(v.name + "".join(f" (also spelt {a})" for a in v.aliases) for v in VARIANT_TABLE)
    + "; speedups are always against baseline.  [default: "
    + ",".join(VARIANTS)
    + "; with an engine whose artifacts exist of fewer, those: --engine vllm times folded]",
)
@click.option("--batch", "batches", default="1,4", show_default=True)
@click.option(
    "--seq", "seqs", help="Sequence lengths (prefill mode).  [default: 128,256,512, capped at the model's context]"
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Warm-up calls per variant and cell, spread over the rounds (at least one per round).",
)
@click.option(
    "--iters",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="Timed calls per variant and cell, spread over the rounds.",
)
@click.option("--rounds", type=click.IntRange(min=1), help="Alternation rounds. Default: min(5, iters).")
@click.option(
    "--mode",
    type=click.Choice(["prefill", "decode", "serve"]),
    default="prefill",
    show_default=True,
    help="decode: a prompt, then --new-tokens KV-cached greedy steps (needs an export with --kv-cache). serve "
    "(--engine vllm): vLLM's OpenAI server on DIR's folded checkpoint (and stock vLLM's with --against vllm), "
    "driven by vLLM's serving benchmark at each --concurrency.",
)
@click.option(
    "--concurrency",
    help="--mode serve: requests in flight, comma-separated.  [default: 1,8,32]",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    help="--mode serve: requests per concurrency.  [default: 4 x the concurrency, at least 16]",
)
@click.option(
    "--prompt",
    type=click.IntRange(min=1),
    help="Prompt length (decode).  [default: 128, or what leaves room for --new-tokens in the context; "
    "with a static cache, in the cache (export --max-cache)]",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=1),
    help="Decode steps after the prompt (decode).  [default: 32, or half a context or static cache too short for "
    "32 and a prompt]",
)
@click.option(
    "--kv-cache",
    type=click.Choice(KV_CACHES),
    help="The decoders' KV cache (decode): static (fixed-size buffers written at a position) or growing.  "
    "[default: on the CPU growing (measured as fast or faster), on CUDA static where the export has static "
    "decoders (torch: where the model takes one)]",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    help="Default: fp32 for torch, the export's dtype for engines that run exported graphs.",
)
@click.option(
    "--against",
    metavar="TOOL",
    help="Also time the untapered model as another tool builds it, in the same rounds (--mode decode, the precision "
    "timed): genai-builder (onnxruntime-genai's model builder), optimum-intel (its OpenVINO export; its optimum-cli "
    "on PATH, scripts/setup-optimum-intel). Comma-separated for several.",
)
@click.option(
    "--precision",
    type=click.Choice(list(BITS)),
    help="Time the export's weight-quantized graphs of this precision (export --quantize) instead of its dtype's.",
)
@click.option(
    "--device",
    type=click.Choice(sorted({d for e in ENGINES.values() for d in e.devices})),
    help="Default: " + ", ".join(f"{e.default_device} for {e.name}" for e in ENGINES.values()) + ".",
)
@click.option(
    "--threads", type=click.IntRange(1, MAX_THREADS), help="CPU threads (torch and ORT intra-op). Default: torch's."
)
@_engine_options
@click.option(
    "--fuse-projections/--no-fuse-projections",
    default=None,
    help="--engine torch: run each group of sibling projections (q/k/v, gate/up) as one linear layer, as "
    "export does in the graphs (other engines time the graphs as exported).  [default: as the export "
    "in DIR did, so that torch and its graphs time the same layers; unfused with --checkpoint or "
    "--preset]",
)
@click.option("--checkpoint", type=click.Path(), help="torch engine: a g = 0 checkpoint instead of DIR.")
@click.option(
    "--preset",
    type=click.Choice(list(PRESETS)),
    help="torch engine: random weights at g = 0 in a preset's shape instead of DIR.",
)
@click.option(
    "--arch", type=click.Choice(list(ARCHS)), default="llama", show_default=True, help="Architecture for --preset."
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random input tokens.")
@click.option(
    "--report",
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    cls=AliasedOption,
    aliases=("--json",),
    help="Write every timing, stats and the machine as JSON ('-': stdout).",
)
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False),
    help="Write one row per variant, cell and phase ('-': stdout).",
)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write throughput and speedup as a PNG.")
def bench(**params):
    """Throughput of baseline, unfolded and folded models (the paper's Table 3), variants alternated in rounds.

    \b
    Examples:
      taperfold bench out/ --engine ort --batch 1,4 --seq 128,256,512
      taperfold bench out/ --engine ort --mode decode --prompt 128 --new-tokens 32
      taperfold bench out/ --engine ort --mode decode --kv-cache growing
      taperfold bench out/ --engine ort --mode decode --precision int4
      taperfold bench out/ --engine genai --mode decode --against genai-builder
      taperfold bench out/ --engine openvino-ir --mode decode --against optimum-intel
      taperfold bench out/ --engine openvino-ir --mode decode --precision int4
      taperfold bench out/ --engine vllm --mode decode --against vllm
      taperfold bench out/ --engine vllm --mode serve --concurrency 1,8,32 --against vllm
      taperfold bench --preset paper-30m --engine torch --device cuda --dtype bf16
      taperfold bench --preset paper-30m --device cuda --dtype bf16 --cuda-graph
      taperfold bench --preset paper-30m --device cuda --dtype bf16 --compile --compile-mode reduce-overhead
      taperfold bench out/ --engine torch --no-fuse-projections
    Writes DIR/bench.json (prefill), DIR/bench-decode.json (decode) or DIR/bench-serve.json (serve, the servers' logs
    in DIR/bench-serve-logs/) when DIR is given.
    """
    from taperfold.bench.command import run_request
    from taperfold.bench.request import BenchRequest

    run_request(BenchRequest.from_cli(params))


# ---- demo --------------------------------------------------------------------------------------------


@cli.command()
@click.option(
    "-o",
    "--output",
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="taperfold-demo",
    show_default=True,
    cls=AliasedOption,
    aliases=("--out",),
)
@click.option(
    "--steps",
    type=click.IntRange(min=MIN_STEPS),
    default=300,
    show_default=True,
    help=f"Training steps (at least {MIN_STEPS}).",
)
def demo(out_dir, steps):
    """The whole flow on the embedded default: train the tiny Internal-Taper llama on the Python standard
    library's sources, inspect it, export it (with KV-cache decoders), verify the fold, benchmark it."""
    from taperfold.demo import run_demo

    run_demo(out_dir, steps)


def main() -> None:
    from taperfold import interrupts

    interrupts.install()  # SIGTERM like SIGINT: temporaries removed, exit 143 (SIGINT: 130)
    try:
        _run()
    finally:
        interrupts.finishing()  # kept to the very end: a late signal is still one line and 128 + its number


def _run() -> None:
    try:
        # not cli.main(): it prints a newline of its own on Ctrl-C before any message of ours
        with cli.make_context("taperfold", sys.argv[1:]) as ctx:
            cli.invoke(ctx)
    except click.exceptions.Exit as e:  # --help, --version
        sys.exit(e.exit_code)
    except click.exceptions.NoArgsIsHelpError as e:  # a bare `taperfold` or `taperfold fold`: the help, as asked
        e.show()
        sys.exit(2)
    except click.UsageError as e:  # click's own usage block is several lines: one line, as for any bad input
        command = e.ctx.command_path if e.ctx else "taperfold"
        click.echo(f"taperfold: error: {' '.join(e.format_message().split())} (see '{command} --help')", err=True)
        sys.exit(2)
    except click.ClickException as e:
        e.show()
        sys.exit(2 if e.exit_code == 2 else e.exit_code)
    except TaperfoldError as e:
        click.echo(f"taperfold: error: {e}", err=True)
        sys.exit(e.exit_code)
    except NumericMismatch as e:
        click.echo(f"taperfold: FAILED: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        click.echo(interrupted_line(e), err=True)
        sys.exit(getattr(e, "exit_code", 130))
    except BrokenPipeError:  # stdout closed early (`| head`): nothing left to say, and no flush error at exit
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except OSError as e:  # a write the checks could not foresee (disk full, I/O error): one line, exit 2
        where = f"{e.filename}: " if e.filename else ""
        click.echo(f"taperfold: error: {where}{e.strerror or e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
