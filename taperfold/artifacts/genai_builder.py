"""onnxruntime-genai folders made by onnxruntime-genai's own model builder, the graph form ONNX Runtime runs fastest
(GroupQueryAttention with rotary fused, packed QKV, SkipSimplifiedLayerNormalization), for every variant alike:

- baseline: the builder on the source's own weights, its norms real;
- unfolded: the same graph with each tapered norm as what it is at g = 0, a constant diagonal map: the norm op
  becomes its residual Add (SkipSimplifiedLayerNormalization) or nothing (SimplifiedLayerNormalization), then a Mul
  by c·γ̃, the constant a graph tool leaves in front of the next MatMul;
- folded: the builder on the folded weights (c·γ̃ in the readers, taperfold's torch fold in float64), each tapered
  norm op replaced by its Add alone.

The builder reads a Hugging Face directory, so the route takes one (a source whose `write_plain_directory` writes
it) and a family whose tapered norms are each layer's `input_layernorm` / `post_attention_layernorm` of an RMS kind
with no bias, the names the builder gives its norm nodes (`/model/layers.{i}/input_layernorm/...`). It runs as a
subprocess (`python -m onnxruntime_genai.models.builder`), offline.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from taperfold.errors import TaperfoldError
from taperfold.exportdir import BASELINE, FOLDED, UNFOLDED
from taperfold.fsutil import is_write_failure

BUILDER = "onnxruntime_genai.models.builder"
NORM_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
_LAYER_NORM = re.compile(r"(?:^|\.)layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\Z")
VARIANTS = (BASELINE, UNFOLDED, FOLDED)


class NotBuildable(TaperfoldError):
    """The model is not one the builder route covers (the traced route still is): `reason` says why."""

    def __init__(self, origin: str, reason: str):
        super().__init__(f"{origin}: {reason}; use --genai-route traced")
        self.reason = reason


def builder_missing() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(BUILDER) is None
    except ModuleNotFoundError:  # onnxruntime_genai itself is not installed
        return True


def node_prefix(norm_path: str) -> str | None:
    """The builder's node-name prefix of a tapered norm (`model.layers.3.input_layernorm` ->
    `/model/layers.3/input_layernorm`), or None when the builder names no norm so."""
    match = _LAYER_NORM.search(norm_path)
    return f"/model/layers.{match[1]}/{match[2]}" if match else None


def builder_scales(tapered, origin: str, source_dir: Path) -> dict[str, torch.Tensor]:
    """{the builder's node prefix: c·γ̃} of each tapered norm of `tapered` (a tapered torch model at g = 0, read from
    the Hugging Face directory `source_dir`), or one line (NotBuildable) saying why the builder cannot make its
    folders: what it reads, or a graph with no place for a norm."""
    tapering = tapered.tapering
    if tapering is None:
        raise TaperfoldError(
            f"{origin}: the builder route needs a tapered model (its baseline alone: --genai-route traced)"
        )
    architecture = type(tapered.network).__name__  # what save_pretrained writes as the plain directory's architecture
    known = builder_architectures()
    if known and architecture not in known:
        raise NotBuildable(origin, f"onnxruntime-genai's builder does not build {architecture}")
    if tapered.cfg.window is not None:
        raise NotBuildable(
            origin,
            f"the model attends through a window of {tapered.cfg.window} tokens, shorter than its context "
            f"({tapered.cfg.max_seq_len}), and the builder's folders of such a model fail in onnxruntime-genai once "
            "the past passes the window",
        )
    no_rope = nope_layers(tapered.network.config)
    if no_rope:
        raise NotBuildable(origin, NOPE_REASON.format(layer=no_rope[0]))
    missing = missing_special_token(tapered.network.config, source_dir)
    if missing:
        raise NotBuildable(
            origin,
            f"{missing} is in neither config.json nor the tokenizer's files, and the builder "
            + ("stops without it" if missing == "eos_token_id" else "would write 1, a token the model never named"),
        )
    modules = dict(tapered.network.named_modules())
    for path in tapering.norms:
        for target in tapering.folds_into(path):  # a module's path, or a parameter's (fused experts)
            if not isinstance(modules.get(target), torch.nn.Linear):
                raise NotBuildable(
                    origin,
                    f"{path} is read by {target}, no linear layer (MoE experts), and the builder route "
                    "folds into linear layers only",
                )
    if tapered.cfg.head_dim % 16:  # ONNX Runtime's GroupQueryAttention on the CPU
        raise NotBuildable(
            origin,
            f"head size {tapered.cfg.head_dim} is no multiple of 16, which the builder's attention needs on the CPU",
        )
    vocab_wide = vocab_wide_layers(tapered)
    if len(vocab_wide) > 1:  # onnxruntime-genai 0.18's builder: every such layer is its LM head, the last one wins
        raise NotBuildable(
            origin,
            f"{vocab_wide[0]} has vocab_size ({tapered.cfg.vocab_size}) outputs, and the builder takes every "
            "linear layer of that width for the LM head (its graph would be wrong)",
        )
    scales = {}
    for path, norm in tapering.norms.items():
        prefix = node_prefix(path)
        constant = tapering.kind.constant_map(norm)
        if prefix is None or constant.centered or constant.bias is not None:
            raise NotBuildable(
                origin, f"{path} is no pre-norm RMS norm the builder names (input_layernorm, post_attention_layernorm)"
            )
        scales[prefix] = constant.scale.detach()
    return scales


NOPE_REASON = (
    "layer {layer} has no rotary embedding (NoPE), and onnxruntime-genai's builder fails on such a layer (it reads "
    "position_ids its graph does not have)"
)


def nope_layers(config) -> list[int]:
    """The layers of a Hugging Face config that apply no rotary embedding (SmolLM3's `no_rope_layers`, 0 for such a
    layer): onnxruntime-genai 0.18's builder gives them a separate RotaryEmbedding of position_ids, an input its graph
    (rotary fused into GroupQueryAttention) does not have, and fails."""
    return [i for i, rope in enumerate(getattr(config, "no_rope_layers", None) or []) if not rope]


def builder_architectures() -> set[str]:
    """The architectures (config.json's `architectures`) the installed builder builds, as its source lists them
    (`config.architectures[0] == "..."`), read as text; empty where it is not installed or lists none so."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(BUILDER)
    except ModuleNotFoundError:
        return set()
    if spec is None or spec.origin is None:
        return set()
    return set(re.findall(r'architectures\[0\] == "(\w+)"', Path(spec.origin).read_text(errors="replace")))


def missing_special_token(config, source_dir: Path) -> str | None:
    """bos_token_id or eos_token_id, where the builder finds neither in the config (or its text config) nor as a
    token the tokenizer's files name (it would stop on a missing eos id, and write bos id 1 for a missing bos)."""
    from taperfold.fsutil import read_json_object

    named: dict[str, object] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (source_dir / name).is_file():
            named.update({k: v for k, v in read_json_object(source_dir / name).items() if v is not None})
    text_config = getattr(config, "text_config", None)
    for key in ("bos_token_id", "eos_token_id"):
        in_config = any(getattr(c, key, None) is not None for c in (config, text_config) if c is not None)
        if not in_config and not named.get(key.removesuffix("_id")):
            return key
    return None


def vocab_wide_layers(model) -> list[str]:
    """The linear layers of `model` (a TaperedLM) with vocab_size outputs: onnxruntime-genai 0.18's builder takes each
    for the LM head, the last one winning, so a model with two gets a wrong graph."""
    width = model.cfg.vocab_size
    return [
        name for name, m in model.network.named_modules() if isinstance(m, torch.nn.Linear) and m.out_features == width
    ]


class BuilderRoute:
    """The builder route for one export's source: the tapered model's constant maps, the folded weights, and the
    two builds (plain and folded weights) the three variants come from."""

    def __init__(self, source, origin: str):
        from taperfold.variants import fold_in_torch

        self.source, self.origin = source, origin
        tapered = source.build(gate=0.0)
        tapering = tapered.tapering
        self.scales = builder_scales(tapered, origin, Path(source.path))
        folded = fold_in_torch(tapered)
        if folded.kept_norms:  # the builder's graph has every norm node replaced: a kept one would be lost
            path, reason = next(iter(folded.kept_norms.items()))
            raise TaperfoldError(
                f"{origin}: {path} cannot be folded ({reason}); the genai builder route needs every "
                "norm folded: use --genai-route traced"
            )
        self.folded_weights: dict[str, torch.Tensor] = {}
        for path in tapering.norms:
            for target in tapering.folds_into(path):
                self.folded_weights[f"{target}.weight"] = folded.network.get_parameter(f"{target}.weight").detach()
            self.folded_weights[f"{path}.weight"] = torch.ones(tapered.cfg.d_model)  # the node goes: any value

    def build(
        self,
        folders: dict[str, Path],
        precision: str,
        scratch_in: Path,
        on_stage: Callable[[str], None],
        extra_options: list[str] | tuple[str, ...] = (),
    ) -> None:
        """Write into `folders` (empty directories) the folder of each of their variants (VARIANTS) in `precision`
        (fp32, or int4 / int8 with the builder's `extra_options`: taperfold.quantize.Quantization.builder_options);
        the builder's inputs and outputs go to a scratch directory in `scratch_in`, removed afterwards."""
        unknown = sorted(set(folders) - set(VARIANTS))
        if unknown:
            raise TaperfoldError(f"{self.origin}: the builder route builds {', '.join(VARIANTS)}, not {unknown[0]}")
        with tempfile.TemporaryDirectory(prefix=".builder-", dir=scratch_in) as scratch:
            work = Path(scratch)
            for weights in ("plain", "folded"):
                wanted = [v for v in folders if (v == FOLDED) == (weights == "folded")]
                if not wanted:
                    continue
                on_stage(f"onnxruntime-genai builder: {weights} weights, {precision}")
                source_dir, built = work / f"{weights}-hf", work / f"{weights}-built"
                self.source.write_plain_directory(source_dir, self.folded_weights if weights == "folded" else None)
                _run_builder(source_dir, built, precision, work / "cache", self.origin, extra_options)
                drop_unused_window(built)
                for variant in wanted:
                    shutil.copytree(built, folders[variant], dirs_exist_ok=True)
                    if variant != BASELINE:
                        replace_tapered_norms(
                            folders[variant] / "model.onnx", self.scales, keep_scale=variant == UNFOLDED
                        )


def builder_command(source_dir: Path, out: Path, precision: str, cache: Path, extra_options=()) -> list[str]:
    """The builder's command line for the CPU (what `bench --against genai-builder` reports too)."""
    command = [sys.executable, "-m", BUILDER, "-i", str(source_dir), "-o", str(out), "-p", precision, "-e", "cpu",
               "-c", str(cache)]  # fmt: skip
    return command + (["--extra_options", *extra_options] if extra_options else [])


def _run_builder(source_dir: Path, out: Path, precision: str, cache: Path, origin: str, extra_options=()) -> None:
    command = builder_command(source_dir, out, precision, cache, extra_options)
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run.returncode != 0:
        lines = [line.strip() for line in run.stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit code {run.returncode}"
        if is_write_failure(why):  # the disk, not the model: another route would not help
            raise TaperfoldError(f"{out}: cannot write (onnxruntime-genai's builder: {why})")
        raise TaperfoldError(
            f"{origin}: onnxruntime-genai's builder failed ({why}); --genai-route traced exports the decoder "
            "taperfold traces instead"
        )


def drop_unused_window(folder: Path) -> None:
    """onnxruntime-genai 0.18's builder writes a `sliding_window` section into genai_config.json whenever the model's
    config carries a `sliding_window`, also where no layer attends through it (SmolLM3 with use_sliding_window false:
    every layer full attention): the section then lists no layer, which onnxruntime-genai reads as every layer, and
    its windowed cache fails in GroupQueryAttention once the past passes the window. Where no attention node of the
    graph has a window, the section is dropped: the cache is the one the graph attends over."""
    import json

    import onnx
    from google.protobuf.message import DecodeError

    from taperfold.genai_config import CONFIG, attention_windows

    try:  # what the builder wrote is checked afterwards (check_genai_folder): here only a readable section matters
        config = json.loads((folder / CONFIG).read_text())
        decoder = config["model"]["decoder"]
        if not isinstance(decoder, dict) or "sliding_window" not in decoder:
            return
        graph = onnx.load(str(folder / str(decoder.get("filename"))), load_external_data=False).graph
    except (OSError, ValueError, KeyError, TypeError, DecodeError):
        return
    windows = attention_windows(graph)
    if windows and not any(size > 0 for size in windows.values()):
        del decoder["sliding_window"]
        (folder / CONFIG).write_text(json.dumps(config, indent=4) + "\n")


def replace_tapered_norms(model_path: Path, scales: dict[str, torch.Tensor], keep_scale: bool) -> None:
    """In a builder graph, each tapered norm op (named by its prefix in `scales`) becomes its residual Add
    (SkipSimplifiedLayerNormalization; the graph input itself for SimplifiedLayerNormalization), followed by a Mul by
    its c·γ̃ when `keep_scale` (the unfolded form). One line naming the norm the graph lacks."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    found, nodes, rename, dropped = set(), [], {}, set()
    for node in graph.node:
        prefix = node.name.rsplit("/", 1)[0]
        if node.op_type not in NORM_OPS or prefix not in scales:
            nodes.append(node)
            continue
        found.add(prefix)
        dropped.add(node.input[-1])  # its gain
        total = node.input[0]
        if node.op_type == "SkipSimplifiedLayerNormalization":
            total = f"{prefix}/residual_sum"
            nodes.append(helper.make_node("Add", list(node.input[:2]), [total], name=f"{prefix}/Add"))
            if len(node.output) > 3 and node.output[3]:
                rename[node.output[3]] = total
        if keep_scale:
            scale = numpy_helper.from_array(scales[prefix].numpy().astype(np.float32), f"{prefix}/c_gamma")
            graph.initializer.append(scale)
            nodes.append(helper.make_node("Mul", [total, scale.name], [node.output[0]], name=f"{prefix}/Mul"))
        else:
            rename[node.output[0]] = total
    missing = sorted(set(scales) - found)
    if missing:
        raise TaperfoldError(f"{model_path}: the builder's graph has no norm node {missing[0]}/... to replace")
    for node in nodes:
        node.input[:] = [rename.get(name, name) for name in node.input]
    for output in graph.output:
        if output.name in rename:  # a graph output is never a norm's here; kept exact if it were
            raise TaperfoldError(f"{model_path}: graph output {output.name} is a tapered norm's")
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [t for t in graph.initializer if t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    model_path.write_bytes(model.SerializeToString())
