"""Physical floors of one benchmark cell: the least time any implementation can take on a GPU, from the bytes the
forward must read (weights, gathered embedding rows, the KV cache) over the memory bandwidth, and the matmul
FLOPs over the dense tensor-core peak. The floor is the larger of the two (a roofline with no overlap loss);
measured throughput divided by the floor's throughput says how far from the hardware a configuration is.

Counted for a llama-family decoder (taperfold.families.llama) in last-token-logits mode:
- prefill of B sequences of T tokens: every linear layer of every block on B·T tokens, the lm_head on the last
  token only, causal attention (QKᵀ and AV over the lower triangle: 2·B·T²·d FLOPs per layer);
- one decode step (B sequences, 1 new token, `past` cached positions): every weight once, the cache read once.
Norm vectors, RoPE and softmax are left out: they are < 0.1 % of the bytes and FLOPs at paper-30m's size.
"""

from __future__ import annotations

from dataclasses import dataclass

from taperfold.models import ModelConfig


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_tb_s: float  # HBM bandwidth, TB/s (10^12 bytes/s)
    dense_tflops_16: float  # dense BF16/FP16 tensor-core peak, TFLOPS (the datasheets' figure without sparsity)


# NVIDIA's datasheets list tensor-core peaks "with sparsity"; the dense peak is half of it.
# - H100 SXM5 80GB, H100 PCIe 80GB, H100 NVL 94GB: "NVIDIA H100 Tensor Core GPU" datasheet
#   (https://www.nvidia.com/en-us/data-center/h100/): BF16/FP16 1,979 / 1,513 / 1,671 TFLOPS with sparsity;
#   GPU memory bandwidth 3.35 / 2 / 3.9 TB/s.
# - H200 SXM 141GB, H200 NVL: "NVIDIA H200 Tensor Core GPU" (https://www.nvidia.com/en-us/data-center/h200/):
#   BF16/FP16 1,979 / 1,671 TFLOPS with sparsity; 4.8 TB/s both.
# Keys are substrings of torch.cuda.get_device_name(), most specific first ("NVIDIA H100 80GB HBM3" is the SXM5).
GPU_SPECS: tuple[tuple[str, GpuSpec], ...] = (
    ("H200 NVL", GpuSpec("H200 NVL", 4.8, 835.5)),
    ("H200", GpuSpec("H200 SXM", 4.8, 989.5)),
    ("H100 NVL", GpuSpec("H100 NVL", 3.9, 835.5)),
    ("H100 PCIe", GpuSpec("H100 PCIe", 2.0, 756.5)),
    ("H100", GpuSpec("H100 SXM5", 3.35, 989.5)),
)

BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def gpu_spec(device_name: str) -> GpuSpec | None:
    """The spec of a GPU named as torch.cuda.get_device_name() names it, or None for one not in the table."""
    for key, spec in GPU_SPECS:
        if key.lower() in device_name.lower():
            return spec
    return None


def _linear_params(cfg: ModelConfig) -> int:
    """Weights of the linear layers of every block (q, k, v, o, gate, up, down)."""
    kv = cfg.kv_heads * cfg.head_dim
    per_layer = 2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * kv + 3 * cfg.d_model * cfg.d_ff
    return cfg.n_layers * per_layer


def prefill_work(cfg: ModelConfig, batch: int, seq: int, dtype: str) -> tuple[float, float]:
    """(bytes read, FLOPs) of one last-token-logits forward of `batch` sequences of `seq` tokens."""
    size = BYTES[dtype]
    head = cfg.vocab_size * cfg.d_model
    weights = (_linear_params(cfg) + head) * size
    gathered = batch * seq * cfg.d_model * size  # embedding rows looked up
    flops = (
        2 * batch * seq * _linear_params(cfg) + 2 * batch * head + cfg.n_layers * 2 * batch * seq * seq * cfg.d_model
    )
    return float(weights + gathered), float(flops)


def decode_step_work(cfg: ModelConfig, batch: int, past: int, dtype: str) -> tuple[float, float]:
    """(bytes read, FLOPs) of one KV-cached decode step: one new token per sequence over `past` cached positions."""
    size = BYTES[dtype]
    head = cfg.vocab_size * cfg.d_model
    kv = cfg.kv_heads * cfg.head_dim
    cache = cfg.n_layers * 2 * batch * (past + 1) * kv * size
    weights = (_linear_params(cfg) + head) * size
    flops = 2 * batch * (_linear_params(cfg) + head) + cfg.n_layers * 4 * batch * (past + 1) * cfg.d_model
    return float(weights + cache + batch * cfg.d_model * size), float(flops)


@dataclass(frozen=True)
class Floor:
    memory_s: float
    compute_s: float
    tokens: int

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def prefill_floor(cfg: ModelConfig, spec: GpuSpec, batch: int, seq: int, dtype: str) -> Floor:
    nbytes, flops = prefill_work(cfg, batch, seq, dtype)
    return Floor(nbytes / (spec.memory_tb_s * 1e12), flops / (spec.dense_tflops_16 * 1e12), batch * seq)


def decode_floor(cfg: ModelConfig, spec: GpuSpec, batch: int, prompt: int, steps: int, dtype: str) -> Floor:
    """The floor of `steps` decode steps after a prompt of `prompt` tokens (the cache grows by one each step)."""
    memory = compute = 0.0
    for i in range(steps):
        nbytes, flops = decode_step_work(cfg, batch, prompt + i, dtype)
        memory += nbytes / (spec.memory_tb_s * 1e12)
        compute += flops / (spec.dense_tflops_16 * 1e12)
    return Floor(memory, compute, batch * steps)
