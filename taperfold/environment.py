"""Versions and machine facts recorded in manifests and benchmark results."""

from __future__ import annotations

import importlib.metadata
import os
import platform


def install_hint(extra: str) -> str:
    """How taperfold's optional dependency `extra` (pyproject.toml's optional-dependencies) is installed."""
    return f"pip install 'taperfold[{extra}]'"


# What a result depends on: the exporter, the runtimes (both ONNX Runtime builds: whichever is installed shows)
PACKAGES = (
    "taperfold",
    "torch",
    "onnx",
    "onnx-ir",
    "onnxscript",
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-genai",
    "openvino",
    "tensorrt",
)


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return {k: v for k, v in out.items() if v is not None or k in ("taperfold", "torch", "onnx")}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import torch

    info: dict[str, object] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": package_versions(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu: dict[str, object] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}",
        }
        try:
            import subprocess

            gpu["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                .stdout.strip()
                .splitlines()[0]
            )
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
        info["gpu"] = gpu
    return info
