"""Reading a report back from its JSON: every value checked as it is read, every problem one line naming the file
and the key (`bench.json: key 'results[3].synced.stats_ms.median' must be a number, got 'fast'`).

A leaf module (taperfold.errors only): the typed reports of bench and the fold passes, and manifest.json's typed parts
(taperfold.manifest: the source, the timings, each artifact kind's own keys), read through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from taperfold.errors import TaperfoldError

T = TypeVar("T")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # no default: the key is required


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_file_name(value: object) -> bool:
    """A file's name in a folder a report or manifest describes: no directory part, nothing that climbs out."""
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and not any(c in value for c in "/\\\0")
        and value.isprintable()
    )


def _shown(value: object) -> str:
    """A value as an error line shows it: short scalars as written, anything else by its JSON type."""
    if value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 40):
        return repr(value)
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "a long string" if isinstance(value, str) else type(value).__name__


class Fields:
    """The keys of one JSON object of a report, read by type: `origin` names the file, `path` where the object sits
    in it ("" at the top, `results[3]`, `results[3].synced`)."""

    def __init__(self, data: object, origin: str, path: str = ""):
        if not isinstance(data, dict):
            where = f"key '{path}'" if path else "the top level"
            raise TaperfoldError(f"{origin}: {where} must be an object, got {_shown(data)}")
        self.data: dict[str, Any] = data
        self.origin, self.path = origin, path
        self.read: set[str] = (
            set()
        )  # the keys asked for: what a reader kept of the object models (the rest it does not)

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str, expected: str) -> TaperfoldError:
        return TaperfoldError(
            f"{self.origin}: key '{self.key(name)}' must be {expected}, got {_shown(self.data[name])}"
        )

    def has(self, name: str) -> bool:
        return name in self.data

    def value(self, name: str, check: Callable[[Any], bool], expected: str, default: Any = MISSING) -> Any:
        """The value at `name`, held to `check` (`expected` says what it must be); `default` when it is absent (and
        one is given), else one line saying it is missing."""
        self.read.add(name)
        if name not in self.data:
            if default is MISSING:
                raise TaperfoldError(f"{self.origin}: missing key '{self.key(name)}'")
            return default
        value = self.data[name]
        if not check(value):
            raise self.error(name, expected)
        return value

    def text(self, name: str, default: str = MISSING) -> str:
        return self.value(name, lambda v: isinstance(v, str), "a string", default)

    def optional_text(self, name: str) -> str | None:
        return self.value(name, lambda v: v is None or isinstance(v, str), "null or a string", None)

    def count(self, name: str, default: int = MISSING) -> int:
        return self.value(name, is_count, "an integer", default)

    def optional_count(self, name: str) -> int | None:
        return self.value(name, lambda v: v is None or is_count(v), "null or an integer", None)

    def number(self, name: str, default: float = MISSING) -> float:
        return self.value(name, is_number, "a number", default)

    def optional_number(self, name: str) -> float | None:
        return self.value(name, lambda v: v is None or is_number(v), "null or a number", None)

    def flag(self, name: str, default: bool = MISSING) -> bool:
        return self.value(name, lambda v: isinstance(v, bool), "true or false", default)

    def optional_flag(self, name: str) -> bool | None:
        return self.value(name, lambda v: v is None or isinstance(v, bool), "null, true or false", None)

    def mapping(self, name: str, default: dict[str, Any] | None = MISSING) -> dict[str, Any]:
        """An object taken as it is (a blob the report carries: the environment, a config)."""
        value = self.value(name, lambda v: isinstance(v, dict), "an object", default)
        return dict(value) if value is not None else {}

    def counts_by_name(self, name: str, default: dict[str, int] | None = MISSING) -> dict[str, int]:
        value = self.value(
            name,
            lambda v: isinstance(v, dict) and all(is_count(n) for n in v.values()),
            "an object of integers",
            default,
        )
        return dict(value) if value is not None else {}

    def numbers_by_name(self, name: str, default: dict[str, float] | None = MISSING) -> dict[str, float]:
        value = self.value(
            name,
            lambda v: isinstance(v, dict) and all(is_number(n) for n in v.values()),
            "an object of numbers",
            default,
        )
        return dict(value) if value is not None else {}

    def items(self, name: str, check: Callable[[Any], bool], expected: str, default: list | None = MISSING) -> list:
        """A list whose every item passes `check` (`expected` names the items: "integers")."""
        value = self.value(
            name, lambda v: isinstance(v, list) and all(check(x) for x in v), f"a list of {expected}", default
        )
        return list(value) if value is not None else []

    def texts(self, name: str, default: list[str] | None = MISSING) -> list[str]:
        return self.items(name, lambda v: isinstance(v, str), "strings", default)

    def counts(self, name: str, default: list[int] | None = MISSING) -> list[int]:
        return self.items(name, is_count, "integers", default)

    def numbers(self, name: str, default: list[float] | None = MISSING) -> list[float]:
        return self.items(name, is_number, "numbers", default)

    def child(self, name: str) -> Fields:
        """The object at `name` (required)."""
        self.value(name, lambda v: isinstance(v, dict), "an object")
        return Fields(self.data[name], self.origin, self.key(name))

    def optional_child(self, name: str) -> Fields | None:
        """The object at `name`, or None where the key is absent or null."""
        self.read.add(name)
        if self.data.get(name) is None:
            return None
        return self.child(name)

    def children(self, name: str, default: list | None = MISSING) -> list[Fields]:
        """Each object of the list at `name`, keyed `name[i]`."""
        items = self.items(name, lambda v: isinstance(v, dict), "objects", default)
        return [Fields(item, self.origin, f"{self.key(name)}[{i}]") for i, item in enumerate(items)]

    def each(self, name: str, read: Callable[[Fields], T], default: list | None = MISSING) -> list[T]:
        return [read(item) for item in self.children(name, default)]
