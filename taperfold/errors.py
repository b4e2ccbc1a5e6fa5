"""Errors the CLI turns into one line and an exit code, never a traceback."""


class TaperfoldError(Exception):
    """Bad input or usage: the message names what is wrong and where (file, key, node). Exit code 2."""

    exit_code = 2


class NumericMismatch(Exception):
    """A comparison ran and failed its tolerance (`taperfold verify`). Exit code 1."""

    exit_code = 1


def first_line(error: BaseException) -> str:
    """The first line of an exception's message without terminal colours, or its type name when it has none:
    libraries (torch.onnx, ONNX Runtime, protobuf) put banners and stack dumps after the line that matters."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__
