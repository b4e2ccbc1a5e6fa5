"""taperfold.bench.floors: a GPU's specs found by device name, and the physical floors of prefill and decode (the
bytes every call must read, the flops it must do) against hand arithmetic."""

import pytest

from taperfold.bench.floors import decode_floor, gpu_spec, prefill_floor, prefill_work
from taperfold.models import preset_config


def test_gpu_specs_are_found_by_device_name():
    assert gpu_spec("NVIDIA H100 80GB HBM3").name == "H100 SXM5"
    assert gpu_spec("NVIDIA H100 PCIe").memory_tb_s == 2.0
    assert gpu_spec("NVIDIA H100 NVL").name == "H100 NVL"
    assert gpu_spec("NVIDIA H200").memory_tb_s == 4.8 and gpu_spec("NVIDIA H200 NVL").name == "H200 NVL"
    assert gpu_spec("NVIDIA A100-SXM4-80GB") is None


def test_prefill_floor_of_paper_30m_by_hand():
    cfg = preset_config("paper-30m")  # d 512, 8 layers, d_ff 2048, vocab 10k, no GQA
    linear = 8 * (2 * 512 * 512 + 2 * 512 * 512 + 3 * 512 * 2048)  # q, o, k, v; gate, up, down
    head = 10_000 * 512
    nbytes, flops = prefill_work(cfg, 1, 128, "bf16")
    assert nbytes == 2 * (linear + head) + 2 * 128 * 512  # weights + the gathered embedding rows
    assert flops == 2 * 128 * linear + 2 * head + 8 * 2 * 128 * 128 * 512
    floor = prefill_floor(cfg, gpu_spec("NVIDIA H100 80GB HBM3"), 1, 128, "bf16")
    assert floor.bound == "memory" and floor.seconds == pytest.approx(nbytes / 3.35e12)
    assert floor.tokens_per_s == pytest.approx(128 * 3.35e12 / nbytes)
    big = prefill_floor(cfg, gpu_spec("NVIDIA H100 80GB HBM3"), 4, 512, "bf16")
    assert big.bound == "compute" and big.seconds == pytest.approx(prefill_work(cfg, 4, 512, "bf16")[1] / 989.5e12)


def test_decode_floor_reads_the_weights_every_step():
    cfg = preset_config("paper-30m")
    spec = gpu_spec("NVIDIA H200")
    one, many = decode_floor(cfg, spec, 1, 128, 1, "fp16"), decode_floor(cfg, spec, 1, 128, 32, "fp16")
    assert one.bound == "memory" and many.tokens == 32
    assert 32 * one.memory_s < many.memory_s < 33 * one.memory_s  # the cache grows by one position per step
