"""`taperfold export`: checkpoint → ONNX (baseline, unfolded, folded) + manifest.json.

The tapered model is exported once at g = 0 with the torch dynamo exporter; its graph holds each
tapered norm as plain ops (`Mul` by c, `Mul` by γ̃; LN adds mean subtraction and `Add` β) tagged with
the module path in the node metadata. That graph is written as `unfolded.onnx`, then the passes in
`taperfold.passes` fold the norms into their readers and the result is written as `model.onnx`.
`baseline.onnx` is the same architecture with ordinary RMSNorm / LayerNorm: the benchmark's reference.

With `kv_cache=True` each variant also gets a KV-cached decoder (`*.decoder.onnx`), with the tensor
names optimum and onnxruntime-genai use: inputs `input_ids`, `past_key_values.{i}.key|value`,
outputs `logits`, `present.{i}.key|value` (axes batch, kv_heads, past_sequence_length, head_dim).
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from taperfold import exportdir
from taperfold.checkpoint import Checkpoint, load_checkpoint
from taperfold.environment import package_versions
from taperfold.errors import TaperfoldError, first_line
from taperfold.exportdir import DTYPES, INPUT, LOGITS, MANIFEST, OUTPUT, decoder_io_names, onnx_file, torch_dtype
from taperfold.fsutil import atomic_dir, sha256_file, write_json_atomic
from taperfold.models import CausalLM
from taperfold.variants import baseline_of


@dataclass
class ExportOptions:
    logits: str = "last"  # "last": [batch, vocab] (the paper's benchmark mode) | "all": [batch, seq, vocab]
    dtype: str = "fp32"
    opset: int = 20
    kv_cache: bool = False
    force_gate0: bool = False
    baseline: bool = True  # also export baseline.onnx (plain norms), the benchmark's reference


@dataclass
class ExportResult:
    out_dir: Path
    manifest: dict
    timings: dict = field(default_factory=dict)


class _Decoder(nn.Module):
    """Flattens the KV cache into named tensors for export."""

    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids, past: list[torch.Tensor]):
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, present = self.model(input_ids, logits="last", past_key_values=pairs, use_cache=True)
        return logits, *[t for kv in present for t in kv]


@contextlib.contextmanager
def _quiet():
    """torch.onnx prints progress lines and warnings meant for its own debugging; keep ours clean."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)


def export_to_ir(model: CausalLM, opts: ExportOptions, decoder: bool = False):
    """torch model → onnx_ir.Model with dynamic batch and sequence (and past) axes."""
    cfg = model.cfg
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("sequence", min=1, max=cfg.max_seq_len)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    if decoder:
        past_len = torch.export.Dim("past_sequence_length", min=1, max=cfg.max_seq_len)
        kv = torch.zeros(2, cfg.kv_heads, 5, cfg.head_dim, dtype=torch_dtype(opts.dtype))
        past = [kv.clone() for _ in range(2 * cfg.n_layers)]
        inputs, outputs = decoder_io_names(cfg.n_layers)
        module, args = _Decoder(model), (ids, past)
        shapes = ({0: batch, 1: seq}, [{0: batch, 2: past_len}] * len(past))
        kwargs = {}
    else:
        module, args, kwargs = model, (ids,), {"logits": opts.logits}
        inputs, outputs = [INPUT], [OUTPUT]
        shapes = {INPUT: {0: batch, 1: seq}, OUTPUT: None}
    with _quiet():
        try:
            program = torch.onnx.export(module, args, kwargs=kwargs, dynamo=True, opset_version=opts.opset,
                                        input_names=inputs, output_names=outputs, dynamic_shapes=shapes,
                                        optimize=True, verbose=False)
        except Exception as e:  # the exporter raises many types and wraps the cause in a long banner
            cause = e.__cause__ or e
            raise TaperfoldError(f"torch.onnx export failed: {type(cause).__name__}: {first_line(cause)}") from e
    return program.model


def _save(model_ir, path: Path) -> None:
    import onnx_ir as ir

    ir.save(model_ir, path, external_data=path.name + ".data")


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, opts: ExportOptions,
                      on_stage=lambda name: None) -> ExportResult:
    """Write baseline.onnx, unfolded.onnx, model.onnx (folded) and manifest.json into `out_dir`."""
    from taperfold.passes import fold_model

    if opts.dtype not in DTYPES:
        raise TaperfoldError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
    if opts.logits not in LOGITS:
        raise TaperfoldError(f"--logits must be 'last' or 'all', got {opts.logits!r}")
    ckpt_path = Path(ckpt_path)
    ckpt = load_checkpoint(ckpt_path)
    _check_gate(ckpt, opts)
    tapered = ckpt.build(gate=0.0).to(torch_dtype(opts.dtype))
    baseline = baseline_of(tapered)
    out_dir = Path(out_dir)
    timings = {"torch_export_s": 0.0, "passes_s": 0.0, "write_s": 0.0}
    reports = {}
    with atomic_dir(out_dir) as tmp:
        # (variant, model) pairs; the folded graphs are the unfolded ones after the passes
        sources = [("baseline", baseline), ("unfolded", tapered)] if opts.baseline else [("unfolded", tapered)]
        for decoder in (False, True) if opts.kv_cache else (False,):
            for variant, model in sources:
                name = exportdir.artifact_key(variant, decoder)
                on_stage(f"exporting {name}")
                t0 = time.perf_counter()
                model_ir = export_to_ir(model, opts, decoder)
                timings["torch_export_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                _save(model_ir, tmp / onnx_file(variant, decoder))
                timings["write_s"] += time.perf_counter() - t0
                if variant == "unfolded":
                    on_stage(f"folding {name}")
                    t0 = time.perf_counter()
                    reports[name] = fold_model(model_ir).to_dict()
                    timings["passes_s"] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    _save(model_ir, tmp / onnx_file("folded", decoder))
                    timings["write_s"] += time.perf_counter() - t0
        on_stage("writing manifest")
        manifest = _manifest(ckpt, ckpt_path, opts, tmp, reports, timings)
        write_json_atomic(tmp / MANIFEST, manifest)
    return ExportResult(out_dir, manifest, timings)


def _check_gate(ckpt: Checkpoint, opts: ExportOptions) -> None:
    if ckpt.config.taper == "none" or ckpt.gate == 0.0:
        return
    if not opts.force_gate0:
        raise TaperfoldError(f"{ckpt.path}: gate is {ckpt.gate:g}, not 0: its tapered norms still use per-token "
                             "statistics, so folding changes the function; train to the end of the taper, or "
                             "pass --force-gate0 to export at g = 0 anyway (`taperfold verify` then reports the cost)")


def _manifest(ckpt: Checkpoint, ckpt_path: Path, opts: ExportOptions, folder: Path, reports: dict,
              timings: dict) -> dict:
    return exportdir.new_manifest(
        checkpoint={"path": str(ckpt_path.resolve()), "sha256": checkpoint_digest(ckpt_path), "step": ckpt.step},
        config=ckpt.config.to_dict(), gate=ckpt.gate, forced_gate0=ckpt.gate != 0.0 and ckpt.config.taper != "none",
        export={"logits": opts.logits, "dtype": opts.dtype, "opset": opts.opset, "kv_cache": opts.kv_cache,
                "inputs": [INPUT], "outputs": [OUTPUT]},
        versions=package_versions(), artifacts=exportdir.describe_artifacts(folder),
        fold_report=reports.get("unfolded"), decoder_fold_report=reports.get("unfolded.decoder"), timings=timings)


def checkpoint_digest(path: Path) -> str:
    """sha256 of the checkpoint file; for a directory, of its files in name order."""
    if path.is_file():
        return sha256_file(path)
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode())
    return h.hexdigest()
