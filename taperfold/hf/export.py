"""`taperfold export HF_DIR`: a save_pretrained directory → baseline / unfolded / folded ONNX + manifest.json.

The graphs come from transformers' own modeling code (taperfold.hf.model.HFCausalLM), exported with the
same exporter, tensor names, dynamic axes and fold passes as taperfold's own models (taperfold.export):
`baseline.onnx` is the directory with its original norms, `unfolded.onnx` the tapered model at g = 0,
`model.onnx` the latter after `taperfold.passes.fold_model`. A plain (untapered) directory gets its
baseline only: there is nothing to fold.
"""

from __future__ import annotations

import time
from pathlib import Path

from taperfold import exportdir
from taperfold.errors import TaperfoldError
from taperfold.export import ExportOptions, ExportResult, _check_gate, _manifest, _save, export_to_ir
from taperfold.exportdir import DTYPES, LOGITS, MANIFEST, onnx_file, torch_dtype
from taperfold.fsutil import atomic_dir, write_json_atomic
from taperfold.hf.directory import load_hf_directory

NOTHING_TO_FOLD = "nothing to fold: {path} has no 'taperfold' block in config.json (a plain model); wrote the baseline only"


def _hf_names(report: dict) -> dict:
    """Norm names as the transformers model has them: drop the export wrappers' prefixes ("hf.", "model.hf.")."""
    for entry in report["norms"]:
        for prefix in ("model.hf.", "hf."):
            if entry["name"].startswith(prefix):
                entry["name"] = entry["name"][len(prefix):]
                break
    return report


def export_hf_directory(path: str | Path, out_dir: str | Path, opts: ExportOptions,
                        on_stage=lambda name: None) -> ExportResult:
    from taperfold.passes import fold_model

    if opts.dtype not in DTYPES:
        raise TaperfoldError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
    if opts.logits not in LOGITS:
        raise TaperfoldError(f"--logits must be 'last' or 'all', got {opts.logits!r}")
    path = Path(path)
    ckpt = load_hf_directory(path)
    if ckpt.tapered:
        _check_gate(ckpt, opts)
    dtype = torch_dtype(opts.dtype)
    # (variant, model) pairs; the folded graphs are the unfolded ones after the passes
    sources = []
    if opts.baseline or not ckpt.tapered:
        sources.append(("baseline", ckpt.build_baseline().for_export().to(dtype)))
    if ckpt.tapered:
        tapered = ckpt.build(gate=0.0).for_export().to(dtype)
        sources.append(("unfolded", tapered))
    out_dir = Path(out_dir)
    timings = {"torch_export_s": 0.0, "passes_s": 0.0, "write_s": 0.0}
    reports = {}
    with atomic_dir(out_dir) as tmp:
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
                    reports[name] = _hf_names(fold_model(model_ir).to_dict())
                    timings["passes_s"] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    _save(model_ir, tmp / onnx_file("folded", decoder))
                    timings["write_s"] += time.perf_counter() - t0
        on_stage("writing manifest")
        manifest = _manifest(ckpt, path, opts, tmp, reports, timings)
        manifest["source"] = {"format": "huggingface", "family": ckpt.family.name, "model_type": ckpt.config.arch,
                              "taper": ckpt.config.taper,
                              "untapered": tapered.hf.tapering.untapered if ckpt.tapered else {}}
        if not ckpt.tapered:
            manifest["note"] = NOTHING_TO_FOLD.format(path=path)
        write_json_atomic(tmp / MANIFEST, manifest)
    return ExportResult(out_dir, manifest, timings)
