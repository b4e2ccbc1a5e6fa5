"""PyTorch runner: eager or torch.compile, on the CPU or a CUDA device.

Two input/output layouts, so that one benchmark loop drives torch and ONNX Runtime alike:
- full forward: `input_ids` → `logits`;
- decoder (`decoder=True`): the names of the exported KV-cached decoders, `input_ids` and
  `past_key_values.{i}.key|value` → `logits` and `present.{i}.key|value` (see taperfold.exportdir).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from taperfold.exportdir import INPUT, OUTPUT, decoder_io_names
from taperfold.models import CausalLM
from taperfold.runners.base import InputSpec, Runner


class TorchRunner(Runner):
    """`name` labels the model in errors (a checkpoint path, or which variant was built)."""

    name = "torch"

    def __init__(self, model: CausalLM, device: str = "cpu", compile: bool = False, decoder: bool = False,
                 logits: str = "last", name: str = "torch model"):
        super().__init__(name, device)
        self.model, self.compile, self.decoder, self.logits = model, compile, decoder, logits
        if decoder:
            self._inputs, self._outputs = decoder_io_names(model.cfg.n_layers)
        else:
            self._inputs, self._outputs = [INPUT], [OUTPUT]
        self._specs = {n: InputSpec(rank=4, floating=True) for n in self._inputs}
        self._specs[INPUT] = InputSpec(rank=2, floating=False)
        self._module = None

    def _load(self) -> None:
        self.model.to(self.device).eval()
        self._module = torch.compile(self.model) if self.compile else self.model

    def _prepare(self, feeds: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Host arrays → tensors on the device; tensors this runner returned pass through without a copy."""
        dtype = next(self.model.parameters()).dtype
        out = {}
        for name, value in feeds.items():
            t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
            if t.is_floating_point():
                t = t.to(dtype)  # the KV cache lives in the model's dtype
            out[name] = t.to(self.device, non_blocking=True)
        return out

    def _run(self, prepared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            if not self.decoder:
                return {OUTPUT: self._module(prepared[INPUT], logits=self.logits)}
            n = self.model.cfg.n_layers
            past = [(prepared[f"past_key_values.{i}.key"], prepared[f"past_key_values.{i}.value"]) for i in range(n)]
            logits, present = self._module(prepared[INPUT], logits="last", past_key_values=past, use_cache=True)
        out = {OUTPUT: logits}
        for i, (k, v) in enumerate(present):
            out[f"present.{i}.key"], out[f"present.{i}.value"] = k, v
        return out

    def _timed_run(self, prepared: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
        if self.device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self._run(prepared)
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = self._run(prepared)
        return out, time.perf_counter() - t0

    def to_numpy(self, value: torch.Tensor) -> np.ndarray:
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16
            value = value.float()
        return value.detach().cpu().numpy()

    def _close(self) -> None:
        self._module = None
        self.model.to("cpu")
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
