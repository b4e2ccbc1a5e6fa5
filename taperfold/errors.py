"""Errors the CLI turns into one line and an exit code, never a traceback."""


class TaperfoldError(Exception):
    """Bad input or usage: the message names what is wrong and where (file, key, node). Exit code 2."""

    exit_code = 2


class NumericMismatch(Exception):
    """A comparison ran and failed its tolerance (`taperfold verify`). Exit code 1."""

    exit_code = 1
