"""TensorRT on this machine: the `tensorrt` module and a CUDA GPU, or one line saying what is missing. Shared by the
TensorRT runner (taperfold.runners.trt) and the engine builder (taperfold.artifacts.tensorrt_plan)."""

from __future__ import annotations

NOT_INSTALLED = "tensorrt is not installed: pip install 'taperfold[trt]' on a machine with an NVIDIA GPU"
NO_GPU = "no CUDA GPU found: TensorRT engines need an NVIDIA GPU"


def gpu() -> dict | None:
    """Name and compute capability of CUDA device 0, or None. torch's view is the one that counts:
    TrtRunner's buffers are torch CUDA tensors, so the TensorRT path needs a CUDA build of torch anyway."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}"}


def import_tensorrt():
    """The `tensorrt` module, or a one-line TaperfoldError saying it is not installed."""
    from taperfold.errors import TaperfoldError

    try:
        import tensorrt
    except (ImportError, OSError):  # OSError: wheel present, its CUDA libraries not
        raise TaperfoldError(NOT_INSTALLED) from None
    return tensorrt


def require_tensorrt():
    """The `tensorrt` module, or a one-line TaperfoldError saying what is missing and how to get it."""
    from taperfold.errors import TaperfoldError

    trt = import_tensorrt()
    if gpu() is None:
        raise TaperfoldError(NO_GPU)
    return trt


def unavailable() -> str | None:
    """Why TensorRT cannot run here, or None."""
    from taperfold.errors import TaperfoldError

    try:
        require_tensorrt()
    except TaperfoldError as e:
        return str(e)
    return None
