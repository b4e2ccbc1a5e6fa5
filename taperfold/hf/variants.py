"""The benchmark's torch variants of a tapered HF directory: baseline, unfused (g = 0) and folded.

`fold_in_torch` is the fold the ONNX passes do, on the transformers model itself: each g = 0 tapered
norm's constant map goes into the linear layers the family says read it (float64, cast once), and the
norm becomes Identity. It is also an independent check of the passes (tests compare the two).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from taperfold.hf.model import HFCausalLM
from taperfold.nn import TaperLN
from taperfold.variants import fold_into_reader


@torch.no_grad()
def fold_in_torch(model: HFCausalLM) -> HFCausalLM:
    tapering = model.tapering
    if tapering is None or tapering.gate.value != 0.0:
        raise ValueError("fold_in_torch needs a tapered model at gate 0: only then are its norms constant maps")
    hf = copy.deepcopy(model.hf)
    tapering = hf.tapering
    for path, readers in tapering.readers.items():
        norm = hf.get_submodule(path)
        scale = norm.c.double() * norm.gain(norm.weight_tilde.double())
        beta = norm.bias.double() if isinstance(norm, TaperLN) else None
        for reader_path in readers:
            reader = hf.get_submodule(reader_path)
            if reader.weight is hf.get_input_embeddings().weight:  # a tied head: the embedding stays as it is
                reader.weight = nn.Parameter(reader.weight.detach().clone())
            fold_into_reader(reader, scale, beta)
        hf.set_submodule(path, nn.Identity())
    object.__setattr__(hf, "tapering", None)
    return HFCausalLM(hf, model.cfg, model.family, reference=model.reference, checkpoint=model.checkpoint).eval()


def build_variants(tapered: HFCausalLM, names: list[str], dtype: torch.dtype) -> dict[str, HFCausalLM]:
    """`names` ⊆ {baseline, unfolded, folded} of a tapered HF model at g = 0, built in fp32 then cast; all
    run the exported graphs' forward (the last position taken before the final norm)."""
    if tapered.checkpoint is None:
        raise ValueError("the baseline needs the directory the model came from (HFCheckpoint.build)")
    tapered = tapered.for_export()
    build = {"baseline": lambda: tapered.checkpoint.build_baseline().for_export(), "unfolded": lambda: tapered,
             "folded": lambda: fold_in_torch(tapered)}
    models = {name: build[name]() for name in names}
    return {name: m.to(dtype).eval() for name, m in models.items()}
