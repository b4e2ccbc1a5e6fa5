"""manifest.json's `source` block (`ManifestSource`): what an export recorded of its source beyond the checkpoint.
Torch-free, and below both the source that writes it (taperfold.hf) and the manifest that reads it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from taperfold.jsonfields import Fields, is_file_name

HUGGINGFACE = "huggingface"  # manifest `source.format` of a Hugging Face directory (taperfold.hf)


@dataclass(frozen=True)
class ManifestSource:
    """manifest `source`: what the export recorded of a source beyond its checkpoint block (a Hugging Face directory,
    taperfold.hf), which the folders and builds made later from the export read. None where a key is absent (an
    older export's); keys this class does not model are kept in `unmodeled` and written back."""

    format: str | None = None  # "huggingface"
    family: str | None = None  # the family that describes it (taperfold.families)
    family_traced: bool | None = None  # whether that family was found by tracing the model (no shipped family)
    model_type: str | None = None  # config.json's
    taper: str | None = None  # none | internal | all
    untapered: dict[str, str] | None = None  # norm-like modules the tapering left alone, and why
    special_tokens: dict[str, int | list[int]] | None = None  # bos/eos/pad token ids, as a runtime's config takes them
    tokenizer_files: tuple[str, ...] | None = None  # the tokenizer files in the source directory, by name
    unmodeled: dict[str, Any] = field(default_factory=dict)

    @property
    def is_huggingface(self) -> bool:
        return self.format == HUGGINGFACE

    @classmethod
    def from_json(cls, source: Fields) -> ManifestSource:
        tokenizer_files = source.value(
            "tokenizer_files",
            lambda v: isinstance(v, list) and all(is_file_name(n) for n in v),
            "a list of file names (no directory part)",
            None,
        )
        read = cls(
            format=source.optional_text("format"),
            family=source.optional_text("family"),
            family_traced=source.optional_flag("family_traced"),
            model_type=source.optional_text("model_type"),
            taper=source.optional_text("taper"),
            untapered=source.value(
                "untapered",
                lambda v: isinstance(v, dict) and all(isinstance(why, str) for why in v.values()),
                "an object of strings",
                None,
            ),
            special_tokens=source.value(
                "special_tokens",
                lambda v: isinstance(v, dict) and all(_is_token_ids(ids) for ids in v.values()),
                "an object of token ids",
                None,
            ),
            tokenizer_files=tuple(tokenizer_files) if tokenizer_files is not None else None,
        )
        return replace(read, unmodeled={k: v for k, v in source.data.items() if k not in source.read})

    def to_json(self) -> dict[str, Any]:
        modeled = {
            "format": self.format,
            "family": self.family,
            "family_traced": self.family_traced,
            "model_type": self.model_type,
            "taper": self.taper,
            "untapered": self.untapered,
            "special_tokens": self.special_tokens,
            "tokenizer_files": list(self.tokenizer_files) if self.tokenizer_files is not None else None,
        }
        return {**{k: v for k, v in modeled.items() if v is not None}, **self.unmodeled}


def _is_token_ids(value: Any) -> bool:
    ids = value if isinstance(value, list) else [value]
    return all(type(i) is int and i >= 0 for i in ids)
