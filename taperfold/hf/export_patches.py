"""Changes to a family's transformers modeling code for the ONNX export alone, where torch.onnx cannot translate the
family's own code and an equal real-valued form can be traced instead (the way export._attention gives Falcon's
multi-query attention a translation of its own). Applied around export's tracing only (`export_patches`); training,
inspect, verify's torch reference and every other tool run transformers' code as it is.

- llama4 / llama4_text: the rotary embedding is complex (`torch.polar`, `view_as_complex`), which torch.onnx fails to
  translate (a ConversionError on an unsqueeze of a complex tensor). The same rotation in real arithmetic: the
  embedding returns (cos, sin)·scale as a trailing axis of 2, and each pair (a, b) of a query or key becomes
  (a·cos − b·sin, a·sin + b·cos), which is (a + ib)(cos + i·sin).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from unittest import mock

import torch


@contextlib.contextmanager
def _llama4_real_rotary() -> Iterator[None]:
    from transformers.models.llama4 import modeling_llama4

    def rotary_forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return torch.stack([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling

    def apply_rotary_emb(xq, xk, freqs_cis):
        cos, sin = freqs_cis[..., 0][:, :, None, :], freqs_cis[..., 1][:, :, None, :]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            pairs = x.float().reshape(*x.shape[:-1], -1, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)

        return rotate(xq), rotate(xk)

    with (
        mock.patch.object(modeling_llama4.Llama4TextRotaryEmbedding, "forward", rotary_forward),
        mock.patch.object(modeling_llama4, "apply_rotary_emb", apply_rotary_emb),
    ):
        yield


PATCHES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "llama4": _llama4_real_rotary,
    "llama4_text": _llama4_real_rotary,
}


def export_patches(model_type: str) -> contextlib.AbstractContextManager:
    """What to hold while a model of `model_type` is traced for ONNX (nothing for most families)."""
    return PATCHES.get(model_type, contextlib.nullcontext)()
