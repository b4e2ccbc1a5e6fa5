"""Where the benchmark's models come from, and which runner runs them.

Variant names are the paper's: `baseline` (ordinary RMSNorm / LayerNorm), `unfused` (tapered norms at
g = 0 kept as explicit constant multiplies) and `folded` (those constants folded into the next MatMul).

- ONNX Runtime and TensorRT run the files of an export directory (manifest.json's artifacts:
  baseline.onnx, unfolded.onnx, model.onnx, and the *.decoder.onnx graphs for decoding).
- torch builds all three variants from one g = 0 checkpoint: the export's checkpoint, `--checkpoint`,
  or `--preset` (random weights at g = 0 with random c and γ̃: a timing model needing no training).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from taperfold.checkpoint import load_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.export import DTYPES, MANIFEST, read_manifest
from taperfold.models import CausalLM, ModelConfig, baseline_of, build_model, fold_model_in_torch, preset_config
from taperfold.runners.base import Runner

ENGINES = ("torch", "ort", "trt")
VARIANTS = ("baseline", "unfused", "folded")
ARTIFACT_OF = {"baseline": "baseline", "unfused": "unfolded", "folded": "folded"}  # manifest artifact keys


@dataclass
class Source:
    """What was asked to be benchmarked: an export directory, a checkpoint, or a preset."""

    export_dir: Path | None = None
    manifest: dict | None = None
    checkpoint: Path | None = None
    preset: str | None = None
    arch: str = "llama"

    def to_dict(self) -> dict:
        return {"export_dir": str(self.export_dir) if self.export_dir else None,
                "checkpoint": str(self.checkpoint) if self.checkpoint else None, "preset": self.preset,
                "arch": self.arch if self.preset else None}


def resolve_source(export_dir: str | None, checkpoint: str | None, preset: str | None, arch: str = "llama") -> Source:
    given = [name for name, value in (("DIR", export_dir), ("--checkpoint", checkpoint), ("--preset", preset)) if value]
    if len(given) != 1:
        raise TaperfoldError("give exactly one of DIR (an export directory), --checkpoint CKPT or --preset NAME"
                             + (f"; got {' and '.join(given)}" if given else ""))
    if preset:
        return Source(preset=preset, arch=arch)
    if checkpoint:
        return Source(checkpoint=Path(checkpoint))
    folder = Path(export_dir)
    manifest = read_manifest(folder)
    return Source(export_dir=folder, manifest=manifest)


def model_config(source: Source) -> ModelConfig:
    if source.manifest is not None:
        from taperfold.hf.model import HFModelInfo, is_hf_info

        if is_hf_info(source.manifest["config"]):  # exported from a Hugging Face directory
            return HFModelInfo.from_dict(source.manifest["config"])
        try:
            return ModelConfig.from_dict(source.manifest["config"])
        except (TypeError, ValueError) as e:
            raise TaperfoldError(f"{source.export_dir / MANIFEST}: key 'config': {e}") from None
    if source.preset:
        return preset_config(source.preset, arch=source.arch)
    return load_checkpoint(source.checkpoint).config


def default_device(engine: str) -> str:
    return "cuda" if engine == "trt" else "cpu"


def default_dtype(engine: str, source: Source) -> str:
    """torch runs fp32 unless told; ONNX engines run the dtype the graphs were exported in."""
    return source.manifest["export"].get("dtype", "fp32") if engine != "torch" and source.manifest else "fp32"


# ---- torch variants ----------------------------------------------------------------------------------


@torch.no_grad()
def random_gate0_model(preset: str, arch: str = "llama", seed: int = 0) -> CausalLM:
    """A preset at g = 0 with random weights, and random c and γ̃ in every tapered norm (never all ones:
    graph tools delete a multiply by ones, which would make the unfused graph look like the folded one)."""
    torch.manual_seed(seed)
    model = build_model(preset_config(preset, arch=arch))
    for norm in model.tapered_norms().values():
        norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))
        norm.weight_tilde.copy_(1 + 0.1 * torch.randn_like(norm.weight_tilde))
        norm.c.fill_(float(torch.empty(()).uniform_(0.5, 2.0)))
        norm.calibrated.fill_(True)
    model.set_gate(0.0)
    return model.eval()


def torch_variants(source: Source, names: list[str], dtype: str) -> dict[str, CausalLM]:
    """The variants in `names`, built from one tapered model at g = 0 (folded in float64, then cast)."""
    if source.preset:
        tapered, origin = random_gate0_model(source.preset, source.arch), f"--preset {source.preset}"
    else:
        path = source.checkpoint
        if source.manifest is not None:
            path = Path(source.manifest["checkpoint"].get("path", ""))
            if not path.exists():
                raise TaperfoldError(f"{source.export_dir / MANIFEST}: key 'checkpoint.path': {path} no longer "
                                     "exists; pass --checkpoint CKPT instead of DIR for the torch engine")
        ckpt = load_checkpoint(path)
        if ckpt.config.taper != "none" and hasattr(ckpt, "build_baseline"):  # a Hugging Face directory
            from taperfold.hf.variants import torch_variants as hf_variants

            return {name: m.to(DTYPES[dtype]).eval() for name, m in hf_variants(ckpt, names).items()}
        tapered, origin = ckpt.build(gate=0.0), str(path)
    if tapered.cfg.taper == "none":
        raise TaperfoldError(f"{origin}: the checkpoint has no tapered norms (taper=none): nothing to compare")
    build = {"baseline": lambda: baseline_of(tapered), "unfused": lambda: tapered,
             "folded": lambda: fold_model_in_torch(tapered)}
    models = {name: build[name]() for name in names}  # all from the fp32 model before any is cast
    return {name: m.to(DTYPES[dtype]).eval() for name, m in models.items()}


# ---- runners -----------------------------------------------------------------------------------------


def onnx_paths(source: Source, names: list[str], decoder: bool) -> dict[str, Path]:
    manifest_path = source.export_dir / MANIFEST
    artifacts = source.manifest["artifacts"]
    out = {}
    for name in names:
        key = ARTIFACT_OF[name] + (".decoder" if decoder else "")
        if key not in artifacts:
            hint = ": re-export with --kv-cache" if decoder else ""
            raise TaperfoldError(f"{manifest_path}: no '{key}' artifact{hint}")
        path = source.export_dir / artifacts[key]["path"]
        if not path.is_file():
            raise TaperfoldError(f"{path}: missing (listed in {manifest_path} as '{key}')")
        out[name] = path
    return out


def _graph_runners(engine: str, source: Source, names: list[str], decoder: bool, device: str,
                   threads: int) -> dict[str, Runner]:
    """ONNX Runtime or TensorRT runners, imported only when asked for: a missing optional backend is one line."""
    if engine == "ort":
        from taperfold.runners.ort import OrtRunner

        return {name: OrtRunner(str(path), device=device, threads=threads)
                for name, path in onnx_paths(source, names, decoder).items()}
    from taperfold.trt import ensure_engines, require_tensorrt

    require_tensorrt()
    if decoder:
        raise TaperfoldError("--mode decode: TensorRT engines take input_ids only (no KV-cache engines); "
                             "use --engine ort or --engine torch")
    from taperfold.runners.trt import TrtRunner

    onnx_paths(source, names, decoder=False)  # the engines are built from these
    plans = ensure_engines(source.export_dir, [ARTIFACT_OF[name] for name in names])
    return {name: TrtRunner(plans[ARTIFACT_OF[name]], device=device) for name in names}


def open_runners(engine: str, source: Source, names: list[str], *, decoder: bool, device: str, dtype: str,
                 threads: int, compile: bool = False) -> dict[str, Runner]:
    """Build and load one runner per variant, all up front, before anything is timed."""
    if engine == "torch":
        from taperfold.runners.torch_runner import TorchRunner

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise TaperfoldError("--device cuda: torch sees no CUDA device on this machine")
        logits = source.manifest["export"].get("logits", "last") if source.manifest else "last"
        models = torch_variants(source, names, dtype)
        runners = {name: TorchRunner(m, device=device, compile=compile, decoder=decoder, logits=logits)
                   for name, m in models.items()}
    else:
        if source.export_dir is None:
            raise TaperfoldError(f"--engine {engine} runs exported graphs: give an export directory (DIR), "
                                 "not --checkpoint or --preset")
        exported = default_dtype(engine, source)
        if dtype != exported:
            raise TaperfoldError(f"{source.export_dir / MANIFEST}: the graphs were exported in {exported} "
                                 f"(key 'export.dtype'); re-export with --dtype {dtype} to benchmark {dtype}")
        if compile:
            raise TaperfoldError("--compile applies to --engine torch only")
        runners = _graph_runners(engine, source, names, decoder, device, threads)
    for runner in runners.values():
        runner.load()
    return runners
