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
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from taperfold.checkpoint import Checkpoint, load_checkpoint
from taperfold.environment import package_versions
from taperfold.errors import TaperfoldError
from taperfold.fsutil import atomic_dir, read_json_object, sha256_file, write_json_atomic
from taperfold.models import CausalLM, baseline_of

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MANIFEST = "manifest.json"
ARTIFACTS = {"folded": "model.onnx", "unfolded": "unfolded.onnx", "baseline": "baseline.onnx"}


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


def decoder_io_names(n_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    return ["input_ids", *past], ["logits", *present]


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
        kv = torch.zeros(2, cfg.kv_heads, 5, cfg.head_dim, dtype=DTYPES[opts.dtype])
        past = [kv.clone() for _ in range(2 * cfg.n_layers)]
        inputs, outputs = decoder_io_names(cfg.n_layers)
        module, args = _Decoder(model), (ids, past)
        shapes = ({0: batch, 1: seq}, [{0: batch, 2: past_len}] * len(past))
        kwargs = {}
    else:
        module, args, kwargs = model, (ids,), {"logits": opts.logits}
        inputs, outputs = ["input_ids"], ["logits"]
        shapes = {"input_ids": {0: batch, 1: seq}, "logits": None}
    with _quiet():
        try:
            program = torch.onnx.export(module, args, kwargs=kwargs, dynamo=True, opset_version=opts.opset,
                                        input_names=inputs, output_names=outputs, dynamic_shapes=shapes,
                                        optimize=True, verbose=False)
        except Exception as e:  # the exporter raises many types and wraps the cause in a long banner
            raise TaperfoldError(f"torch.onnx export failed: {_first_line(e.__cause__ or e)}") from e
    return program.model


def _first_line(error: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _save(model_ir, path: Path) -> None:
    import onnx_ir as ir

    ir.save(model_ir, path, external_data=path.name + ".data")


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, opts: ExportOptions,
                      on_stage=lambda name: None) -> ExportResult:
    """Write baseline.onnx, unfolded.onnx, model.onnx (folded) and manifest.json into `out_dir`."""
    from taperfold.passes import fold_model

    if opts.dtype not in DTYPES:
        raise TaperfoldError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
    if opts.logits not in ("last", "all"):
        raise TaperfoldError(f"--logits must be 'last' or 'all', got {opts.logits!r}")
    ckpt_path = Path(ckpt_path)
    ckpt = load_checkpoint(ckpt_path)
    _check_gate(ckpt, opts)
    dtype = DTYPES[opts.dtype]
    tapered = ckpt.build(gate=0.0).to(dtype)
    baseline = baseline_of(tapered)
    out_dir = Path(out_dir)
    timings = {"torch_export_s": 0.0, "passes_s": 0.0, "write_s": 0.0}
    reports = {}
    with atomic_dir(out_dir) as tmp:
        variants = [("baseline", baseline, False), ("unfolded", tapered, False)]
        if opts.kv_cache:
            variants += [("baseline.decoder", baseline, True), ("unfolded.decoder", tapered, True)]
        if not opts.baseline:
            variants = [v for v in variants if not v[0].startswith("baseline")]
        for name, model, decoder in variants:
            on_stage(f"exporting {name}")
            t0 = time.perf_counter()
            model_ir = export_to_ir(model, opts, decoder)
            timings["torch_export_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            _save(model_ir, tmp / f"{name}.onnx")
            timings["write_s"] += time.perf_counter() - t0
            if name.startswith("unfolded"):
                on_stage(f"folding {name}")
                t0 = time.perf_counter()
                report = fold_model(model_ir)
                timings["passes_s"] += time.perf_counter() - t0
                reports[name] = report.to_dict()
                folded_name = "model" + name[len("unfolded"):]
                t0 = time.perf_counter()
                _save(model_ir, tmp / f"{folded_name}.onnx")
                timings["write_s"] += time.perf_counter() - t0
        on_stage("writing manifest")
        manifest = _manifest(ckpt, ckpt_path, opts, tmp, reports, timings)
        write_json_atomic(tmp / MANIFEST, manifest)
    return ExportResult(out_dir, manifest, timings)


def read_manifest(export_dir: str | Path) -> dict:
    export_dir = Path(export_dir)
    if not export_dir.exists():
        raise TaperfoldError(f"{export_dir}: no such directory (run `taperfold export` first)")
    if not export_dir.is_dir():
        raise TaperfoldError(f"{export_dir}: not a directory; pass the folder `taperfold export` wrote")
    path = export_dir / MANIFEST
    if not path.is_file():
        raise TaperfoldError(f"{path}: missing; is {export_dir} a taperfold export directory?")
    manifest = read_json_object(path)
    if manifest.get("format") != "taperfold-export":
        raise TaperfoldError(f"{path}: not a taperfold export manifest (key 'format' is not 'taperfold-export')")
    for key in ("checkpoint.path", "checkpoint.sha256", "config", "gate", "forced_gate0", "export.logits",
                "export.dtype", "artifacts.unfolded.path", "artifacts.folded.path"):
        node = manifest
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise TaperfoldError(f"{path}: missing key '{key}'")
            node = node[part]
    logits, dtype = manifest["export"]["logits"], manifest["export"]["dtype"]
    if logits not in ("last", "all"):
        raise TaperfoldError(f"{path}: key 'export.logits' must be 'last' or 'all', got {logits!r}")
    if dtype not in ("fp32", "fp16", "bf16"):
        raise TaperfoldError(f"{path}: key 'export.dtype' must be fp32, fp16 or bf16, got {dtype!r}")
    return manifest


def is_export_dir(path: Path) -> bool:
    """Whether `path` holds a taperfold export (which a new export may replace whole)."""
    try:
        return read_json_object(path / MANIFEST).get("format") == "taperfold-export"
    except TaperfoldError:
        return False


def _check_gate(ckpt: Checkpoint, opts: ExportOptions) -> None:
    if ckpt.config.taper == "none" or ckpt.gate == 0.0:
        return
    if not opts.force_gate0:
        raise TaperfoldError(f"{ckpt.path}: gate is {ckpt.gate:g}, not 0: its tapered norms still use per-token "
                             "statistics, so folding changes the function; train to the end of the taper, or "
                             "pass --force-gate0 to export at g = 0 anyway (`taperfold verify` then reports the cost)")


def _artifacts(folder: Path) -> dict:
    out = {}
    for path in sorted(folder.glob("*.onnx")):
        variant = path.stem.replace("model", "folded", 1) if path.stem.startswith("model") else path.stem
        data = path.with_name(path.name + ".data")
        out[variant] = {"path": path.name, "bytes": path.stat().st_size,
                        "external_data": data.name if data.exists() else None,
                        "external_data_bytes": data.stat().st_size if data.exists() else 0}
    return out


def _manifest(ckpt: Checkpoint, ckpt_path: Path, opts: ExportOptions, folder: Path, reports: dict,
              timings: dict) -> dict:
    return {
        "format": "taperfold-export",
        "format_version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": {"path": str(ckpt_path.resolve()), "sha256": checkpoint_digest(ckpt_path),
                       "step": ckpt.step},
        "config": ckpt.config.to_dict(),
        "gate": ckpt.gate,
        "exported_gate": 0.0,
        "forced_gate0": ckpt.gate != 0.0 and ckpt.config.taper != "none",
        "export": {"logits": opts.logits, "dtype": opts.dtype, "opset": opts.opset, "kv_cache": opts.kv_cache,
                   "inputs": ["input_ids"], "outputs": ["logits"]},
        "versions": package_versions(),
        "artifacts": _artifacts(folder),
        "fold_report": reports.get("unfolded"),
        "decoder_fold_report": reports.get("unfolded.decoder"),
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }


def checkpoint_digest(path: Path) -> str:
    """sha256 of the checkpoint file; for a directory, of its files in name order."""
    if path.is_file():
        return sha256_file(path)
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode())
    return h.hexdigest()
