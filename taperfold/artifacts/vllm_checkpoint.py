"""Folded checkpoints that serving engines read (`export --vllm`): a Hugging Face-style directory of the folded model,
which vLLM serves through taperfold's plugin and transformers loads through taperfold's registration
(taperfold.serving).

    vllm/folded/config.json             the source's config, its model type and architecture taperfold's own
                                        (`taperfold_llama`, `TaperfoldLlamaForCausalLM`), the folded norms' paths
                                        (`taperfold_folded_norms`) and kind (`taperfold_norm_kind`), those kept whole
                                        (`taperfold_kept_norms`, DyT's only), the layers a β gave a bias they are
                                        built without (`taperfold_added_biases`)
    vllm/folded/model.safetensors       the folded weights in the export's dtype, or model-0000i-of-0000n.safetensors
                                        and model.safetensors.index.json past 2 GB; of each folded norm only what its
                                        served form keeps (a DyT's α), of a norm kept whole all of it
    vllm/folded/tokenizer.json ...      the source's tokenizer files (a byte-level source: its byte tokenizer)

A stock tool must refuse the directory, never build the stock model with the missing norms initialised to ones and
normalize: transformers and vLLM do not know the model type. The untapered model needs no folder of its own: stock
vLLM serves the source directory itself.

The weights are written tensor by tensor, each folded reader (q/k/v, gate/up) folded in float64 from the source's
weights and cast once just before it is written, so the export holds no second copy of the model (the writer, which
needs torch, is taperfold.artifacts.vllm_weights, imported by `build`). Served: Hugging Face sources of the families in
taperfold.serving.SERVED whose norms are tapered RMS norms (TaperNorm) or LayerNorms (TaperLN, whose centering folds
into the readers' weights and β into their biases, given to a layer that has none), which leave the residual add in
their place, or DyTs (γ into the readers' weights, β into their biases), which leave tanh(α·h); a DyT whose γ, β no
layer of the served model takes (the final norm, whose β vLLM's head cannot add) is kept whole
(taperfold.serving.served_split). Anything else is refused in one line before the export's work.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taperfold.artifacts import VLLM, register_kind
from taperfold.artifacts.base import (
    EXPORT,
    ArtifactKind,
    ArtifactRecord,
    Export,
    Option,
    details_of,
    tokenizer_files,
    tokenizer_names,
)
from taperfold.errors import TaperfoldError
from taperfold.exportdir import FOLDED, Graph, torch_dtype
from taperfold.fsutil import atomic_dir
from taperfold.jsonfields import Fields, is_file_name
from taperfold.serving import BIAS_KEY, CONFIG_KEY, KEPT_KEY, KIND_KEY, ServedFamily, served_family, served_split

if TYPE_CHECKING:
    import torch

    from taperfold.artifacts.vllm_weights import FoldedWeights
    from taperfold.hf.source import HFCheckpoint

FOLDER = "vllm"  # the folders' parent in the export directory
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SHARD_BYTES = 2 * 1024**3  # the largest shard


@dataclass(frozen=True)
class VllmRequest:
    """The folded model's folder, its weights in files of at most `shard_bytes`."""

    shard_bytes: int = SHARD_BYTES


@dataclass(frozen=True)
class VllmDetails:
    """A vLLM checkpoint folder's own keys in the manifest."""

    architecture: str  # config.json's architecture, taperfold's own class
    weights: tuple[str, ...]  # the safetensors files (and index) in the folder
    folded_norms: int | None = None  # the norms folded away (config.json lists their paths)
    tokenizer: tuple[str, ...] = ()  # the tokenizer files in the folder

    @classmethod
    def from_json(cls, entry: Fields) -> VllmDetails:
        return cls(
            architecture=entry.text("architecture"),
            weights=tuple(entry.items("weights", is_file_name, "file names in the folder")),
            folded_norms=entry.optional_count("folded_norms"),
            tokenizer=tokenizer_names(entry),
        )

    def to_json(self) -> dict[str, Any]:
        folded = {"folded_norms": self.folded_norms} if self.folded_norms is not None else {}
        return {
            "architecture": self.architecture,
            "weights": list(self.weights),
            **folded,
            "tokenizer": list(self.tokenizer),
        }


class VllmCheckpoint(ArtifactKind):
    name = VLLM
    title = "folded checkpoint for vLLM"
    built_from = EXPORT
    suffix = "vllm"
    options = (
        Option(
            "--vllm",
            is_flag=True,
            help="Also write the folded model as a Hugging Face-style checkpoint that vLLM serves through taperfold's "
            "plugin (vllm/folded/: safetensors, config.json naming taperfold's architecture, tokenizer); Hugging Face "
            "sources of the served families (docs/deployment.md, Serving with vLLM).",
        ),
    )
    request_type = VllmRequest  # asked for by --vllm (ArtifactKind.request: its flag)
    details_type = VllmDetails
    variants = (FOLDED,)  # the untapered model needs no checkpoint: stock vLLM serves its source (bench --against vllm)

    def plan(self, request: VllmRequest, source: Any, tapered: Any, dtype: str) -> VllmRequest:
        """A source the plugin cannot serve is refused here, before the export's work."""
        _served(source, tapered)
        return request

    def needed_graphs(self, request: VllmRequest) -> tuple[Graph, ...]:
        """None: the folder is written from the source itself."""
        return ()

    def build(
        self, manifest: Export, request: VllmRequest, on_stage: Callable[[str], None] = lambda s: None
    ) -> list[ArtifactRecord]:
        """The folded model's folder (the largest weights file: `request.shard_bytes`, default 2 GB)."""
        from taperfold.artifacts.vllm_weights import FoldedWeights, write_safetensors
        from taperfold.hf.tokenizer import save_byte_tokenizer
        from taperfold.sources import open_source

        plain_source = open_source(manifest.checkpoint)
        tapered = plain_source.build(gate=0.0)  # holds the source's tensors, no copy
        source, served = _served(plain_source, tapered)
        dtype = torch_dtype(manifest.dtype)
        tokenizer = tokenizer_files(manifest)
        folder = manifest.directory / FOLDER / FOLDED
        with atomic_dir(folder, manifest.directory) as tmp:
            on_stage("writing the folded weights for vLLM")
            weights = FoldedWeights(tapered, dtype)
            files = write_safetensors(tmp, weights, request.shard_bytes)
            config = _config(source.hf_config_dict, served, weights, dtype)
            (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            for file in [*tokenizer, source.path / GENERATION_CONFIG]:
                if file.is_file():
                    shutil.copyfile(file, tmp / file.name)
            if not tokenizer and source.config.tokenizer == "bytes":  # what vLLM's tokenizer and server need
                save_byte_tokenizer(tmp)
            in_folder = sorted({p.name for p in tmp.iterdir()} - {CONFIG, GENERATION_CONFIG, *files})
        path = f"{FOLDER}/{FOLDED}/{CONFIG}"
        record = ArtifactRecord(
            key=self.key(FOLDED, None),
            kind=self.name,
            path=path,
            variant=FOLDED,
            graph=None,
            precision=manifest.dtype,
            bytes=(manifest.directory / path).stat().st_size,
            details=VllmDetails(
                architecture=served.architecture,
                weights=tuple(files),
                folded_norms=len(weights.folded_norms),
                tokenizer=tuple(in_folder),
            ),
        )
        return [record]

    def files(
        self, manifest: Export, variants: list[str], graph: Graph, precision: str | None = None
    ) -> dict[str, Path]:
        """{variant: its folder's config.json} of the variants among `variants` the export has a folder of (the folded
        one: the untapered model needs none, and `bench --against vllm` times it from the source directory); one line
        where it has none of them. A folder serves any cache: `graph` is not asked."""
        records = {r.variant: r for r in manifest.records(self.name) if r.precision == (precision or manifest.dtype)}
        files = {v: manifest.file(records[v]) for v in variants if v in records}
        if not files:
            raise TaperfoldError(
                f"{manifest.path}: no vLLM checkpoint of {', '.join(variants)} (export --vllm writes the folded "
                "model's; stock vLLM runs the untapered model: bench --against vllm)"
            )
        return files

    def check(self, manifest: Export, record: ArtifactRecord) -> list[str]:
        """The default's, and each weights file the record names present."""
        folder = Path(record.path).parent.as_posix()
        names = [f"{folder}/{name}" for name in details_of(record, VllmDetails).weights]
        missing = [f"{name}: missing" for name in names if not (manifest.directory / name).is_file()]
        return super().check(manifest, record) + missing


def _served(source: Any, tapered: Any) -> tuple[HFCheckpoint, ServedFamily]:
    """`source` (a taperfold.sources model source; `tapered` its tapered torch model at g = 0, None for a plain one) as
    the Hugging Face directory it must be, and its served family; or one line saying why the plugin cannot serve its
    folded form."""
    from taperfold.hf.source import HFCheckpoint

    origin = str(source.path)
    if not isinstance(source, HFCheckpoint):
        raise TaperfoldError(
            f"{origin}: --vllm writes the folded form of a Hugging Face directory (save_pretrained); this is a "
            "taperfold checkpoint, whose architecture no serving engine knows"
        )
    tapering = tapered.tapering if tapered is not None else None
    if tapering is None:
        raise TaperfoldError(
            f"{origin}: --vllm: the model is untapered, so there is nothing to fold; stock vLLM serves the directory "
            f"itself (python -m vllm.entrypoints.openai.api_server --model {origin})"
        )
    served = served_family(source.family.name, origin)
    try:
        folded, _ = served_split(tapering, tapered.network)
    except ValueError as e:
        raise TaperfoldError(f"{origin}: --vllm: {e}; export it without --vllm") from None
    for key, why in served.refused_config:
        if source.hf_config_dict.get(key):
            raise TaperfoldError(f"{origin}: --vllm: its config sets {key}, and {why}; export it without --vllm")
    if served.tied_head:
        head = source.family.head
        if not source.hf_config_dict.get("tie_word_embeddings", True):
            raise TaperfoldError(
                f"{origin}: --vllm: its head is untied (tie_word_embeddings false), and vLLM's "
                f"{served.model_class} reads the logits from the embedding: it would serve the wrong head"
            )
        if any(head in tapering.folds_into(path) for path in folded):
            raise TaperfoldError(
                f"{origin}: --vllm: the final norm folds into the head, which unties it from the embedding, and "
                f"vLLM's {served.model_class} reads the logits from the embedding; taper the internal norms only"
            )
    return source, served


def _config(source_config: dict, served: ServedFamily, weights: FoldedWeights, dtype: torch.dtype) -> dict:
    """The source's config.json as the folded checkpoint's: taperfold's model type and architecture, the folded
    norms' paths and kind, those kept whole, the layers the fold gave a bias, the weights' dtype; the head untied where
    a fold rewrote it."""
    from taperfold.hf.taper_block import BLOCK

    config = {key: value for key, value in source_config.items() if key not in (BLOCK, "torch_dtype")}
    config.update(
        model_type=served.model_type,
        architectures=[served.architecture],
        dtype=str(dtype).removeprefix("torch."),
        **{CONFIG_KEY: weights.folded_norms, KIND_KEY: weights.tapering.kind.name},
    )
    if weights.kept_norms:
        config[KEPT_KEY] = weights.kept_norms
    if weights.added_biases:
        config[BIAS_KEY] = weights.added_biases
    if weights.untied:
        config["tie_word_embeddings"] = False
    return config


VLLM_CHECKPOINT = VllmCheckpoint()
register_kind(VLLM_CHECKPOINT)
