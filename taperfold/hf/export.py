"""`taperfold export HF_DIR`: a save_pretrained directory → baseline / unfolded / folded ONNX + manifest.json.

The graphs come from transformers' own modeling code (taperfold.hf.model.HFCausalLM), exported with the
same exporter, tensor names, dynamic axes and fold passes as taperfold's own models (taperfold.export):
`baseline.onnx` is the directory with its original norms, `unfolded.onnx` the tapered model at g = 0,
`model.onnx` the latter after `taperfold.passes.fold_model`. A plain (untapered) directory gets its
baseline only: there is nothing to fold.
"""

from __future__ import annotations

from pathlib import Path

from taperfold.export import ExportOptions, ExportResult, _check_gate, _manifest, check_options, export_graphs
from taperfold.exportdir import MANIFEST, torch_dtype
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
    check_options(opts)
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
    with atomic_dir(out_dir) as tmp:
        exported = export_graphs(sources, tmp, opts, on_stage)
        for report in exported.reports.values():
            _hf_names(report)
        on_stage("writing manifest")
        manifest = _manifest(ckpt, path, opts, tmp, exported)
        manifest["source"] = {"format": "huggingface", "family": ckpt.family.name, "model_type": ckpt.config.arch,
                              "taper": ckpt.config.taper,
                              "untapered": tapered.hf.tapering.untapered if ckpt.tapered else {}}
        if not ckpt.tapered:
            manifest["note"] = NOTHING_TO_FOLD.format(path=path)
        write_json_atomic(tmp / MANIFEST, manifest)
    return ExportResult(out_dir, manifest, exported.timings)
