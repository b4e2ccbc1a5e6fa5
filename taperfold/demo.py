"""`taperfold demo`: the whole flow on the embedded default, each stage the library call its command makes and
printed as that command prints it."""

from __future__ import annotations

import shutil
from pathlib import Path

from taperfold.errors import NumericMismatch
from taperfold.exportdir import GROWING
from taperfold.fsutil import Output, check_outputs, write_errors
from taperfold.manifest import is_export_dir


def run_demo(out_dir: str | Path = "taperfold-demo", steps: int = 300) -> None:
    """Train the tiny Internal-Taper llama on the Python standard library's sources, inspect it, export it (with
    KV-cache decoders), verify the fold and benchmark it (prefill, then decoding) on ONNX Runtime's CPU, into
    `out_dir`: the checkpoint, and the export with its reports. Every output is checked before the training; a
    folder the demo made for itself goes with a failed stage."""
    from rich.rule import Rule

    from taperfold.ui import out

    root = Path(out_dir)
    ckpt, export_dir = root / "tiny.safetensors", root / "export"
    created = not root.is_dir()
    if created:
        check_outputs([Output(root, "-o", directory="taperfold demo")])
        with write_errors(root):
            root.mkdir(parents=True)
    else:  # every output checked before the training, as each command does for its own
        check_outputs([Output(ckpt, "-o"), Output(export_dir, "-o", directory="taperfold export", owned=is_export_dir)])
    stages = [
        ("1/6 train: tiny llama, Internal-Taper (+aux), through the whole taper", lambda: _train(ckpt, steps)),
        ("2/6 inspect", lambda: _inspect(ckpt)),
        ("3/6 export: baseline, unfolded and folded ONNX", lambda: _export(ckpt, export_dir)),
        ("4/6 verify: checkpoint vs unfolded vs folded in ONNX Runtime", lambda: _verify(export_dir)),
        ("5/6 bench: last-token logits (prefill), ONNX Runtime CPU", lambda: _bench_prefill(export_dir)),
        ("6/6 bench: KV-cached decoding, ONNX Runtime CPU", lambda: _bench_decode(export_dir)),
    ]
    rule_width = min(out.width, 100)  # piped output is laid out 240 wide for tables; rules need not be
    try:
        for title, stage in stages:
            out.print(Rule(title), width=rule_width)
            stage()
    except BaseException:  # a failed stage, or a signal: a folder the demo made for itself goes with it
        if created:
            shutil.rmtree(root, ignore_errors=True)
        raise
    out.print(Rule(), width=rule_width)
    written = ", ".join(sorted(p.name for p in export_dir.glob("*.json")))
    out.print(f"done: checkpoint {ckpt}, export {export_dir} ({written})")


def _train(ckpt: Path, steps: int) -> None:
    from taperfold.models import preset_config
    from taperfold.train import TrainOptions, train
    from taperfold.ui import print_trained, train_progress

    with train_progress(steps) as on_step:
        tiny = preset_config("tiny", arch="llama", taper="internal", aux=True)
        result = train(tiny, TrainOptions(steps=steps), on_step=on_step)
    result.save(ckpt)
    print_trained(result.val_loss, result.gate, steps, result.seconds, ckpt)


def _inspect(ckpt: Path) -> None:
    from taperfold.describe import describe
    from taperfold.sources import open_source
    from taperfold.ui import print_inspect

    print_inspect(describe(open_source(ckpt)))


def _export(ckpt: Path, export_dir: Path) -> None:
    from taperfold.export import ExportOptions, export_to_dir
    from taperfold.ui import print_export

    result = export_to_dir(ckpt, export_dir, ExportOptions(decoders=(GROWING,)))
    print_export(result.manifest, result.out_dir)


def _verify(export_dir: Path) -> None:
    from taperfold.ui import print_verify
    from taperfold.verify import verify_and_write

    report = verify_and_write(export_dir)
    print_verify(report)
    if not report.passed:
        raise NumericMismatch(report.failure_message())


def _bench_prefill(export_dir: Path) -> None:
    from taperfold.bench.command import run_request
    from taperfold.bench.request import BenchRequest

    run_request(
        BenchRequest(
            export_dir=str(export_dir), engine="ort", batches="1,4", seqs="32,128", warmup=3, iters=20, threads=1
        )
    )


def _bench_decode(export_dir: Path) -> None:
    from taperfold.bench.command import run_request
    from taperfold.bench.request import BenchRequest

    run_request(
        BenchRequest(
            export_dir=str(export_dir),
            engine="ort",
            mode="decode",
            batches="1",
            prompt=32,
            new_tokens=32,
            warmup=2,
            iters=4,
            threads=1,
        )
    )
