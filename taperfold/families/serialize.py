"""A Family as JSON data: what a tapered Hugging Face directory records in its `taperfold.family` key for a family
found by tracing the model (taperfold.hf.trace), so export and verify read it back instead of tracing again
(docs/checkpoint-format.md)."""

from __future__ import annotations

import dataclasses
import re

from taperfold.families import Family
from taperfold.nn import Gating
from taperfold.norms import norm_kind, norm_kinds
from taperfold.numeric import is_finite_number

_DATA_KEYS = ("norm", "gain_offset", "layers", "internal", "post", "final", "head", "untapered", "norm_eps")
# absent in what taperfold wrote before it had them
_OPTIONAL_KEYS = ("layer_readers", "layer_producers", "gated", "heads", "gain_offsets")
_PATH = re.compile(r"[A-Za-z_]\w*(\.\w+)*")


def family_to_data(family: Family) -> dict:
    """A traced family as the JSON a tapered directory's `taperfold.family` key holds."""
    return {
        "norm": family.norm,
        "gain_offset": family.gain_offset,
        "layers": family.layers,
        "internal": {norm: list(readers) for norm, readers in family.internal.items()},
        "post": dict(family.post),
        "final": family.final,
        "head": family.head,
        "untapered": dict(family.untapered),
        "norm_eps": family.norm_eps,
        **(
            {
                "layer_readers": {
                    str(i): {norm: list(readers) for norm, readers in by_norm.items()}
                    for i, by_norm in family.layer_readers.items()
                }
            }
            if family.layer_readers
            else {}
        ),
        **(
            {"layer_producers": {str(i): dict(by_norm) for i, by_norm in family.layer_producers.items()}}
            if family.layer_producers
            else {}
        ),
        **({"gated": {norm: dataclasses.asdict(g) for norm, g in family.gated.items()}} if family.gated else {}),
        **({"heads": dict(family.heads)} if family.heads else {}),
        **({"gain_offsets": dict(family.gain_offsets)} if family.gain_offsets else {}),
    }


def family_from_data(raw, model_type: str, bad) -> Family:
    """The family a `taperfold.family` key holds; `bad(key, why)` makes the error for a wrong one."""
    if not isinstance(raw, dict):
        raise bad("family", f"must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_DATA_KEYS) - set(_OPTIONAL_KEYS))
    if unknown:
        raise bad(f"family.{unknown[0]}", f"is not a known key ({', '.join(_DATA_KEYS + _OPTIONAL_KEYS)})")
    missing = [key for key in _DATA_KEYS if key not in raw]
    if missing:
        raise bad(f"family.{missing[0]}", "is missing")
    schedulable = [k.name for k in norm_kinds() if k.gated]
    if raw["norm"] not in schedulable:
        raise bad("family.norm", f"must be one of {', '.join(schedulable)}, got {raw['norm']!r}")
    offset = raw["gain_offset"]
    if offset not in (0, 1) or isinstance(offset, bool) or (offset and not norm_kind(raw["norm"]).gain_offset_allowed):
        raise bad(
            "family.gain_offset",
            f"must be 0{' or 1' if norm_kind(raw['norm']).gain_offset_allowed else ''}, got {offset!r}",
        )
    for key in ("layers", "final", "head"):
        if not _is_path(raw[key]):
            raise bad(f"family.{key}", f"must be a module path, got {raw[key]!r}")
    internal, post, untapered = raw["internal"], raw["post"], raw["untapered"]
    if not isinstance(internal, dict) or not all(
        _is_path(k) and isinstance(v, list) and v and all(map(_is_path, v)) for k, v in internal.items()
    ):
        raise bad("family.internal", "must map each norm's path in a layer to a non-empty list of reader paths")
    for norm, readers in internal.items():
        if twice := next((r for i, r in enumerate(readers) if r in readers[:i]), None):
            raise bad("family.internal", f"lists {twice!r} twice among the readers of {norm!r}")
    layer_readers = _layer_readers(raw.get("layer_readers", {}), bad)
    layer_producers = _layer_producers(raw.get("layer_producers", {}), bad)
    for index, by_norm in layer_producers.items():
        if both := next((norm for norm in by_norm if norm in layer_readers.get(index, {})), None):
            raise bad("family.layer_producers", f"layer {index} names {both!r}, which its layer_readers name too")
    gated = _gated(raw.get("gated", {}), bad)
    if not isinstance(post, dict) or not all(_is_path(k) and _is_path(v) for k, v in post.items()):
        raise bad("family.post", "must map each post-norm's path in a layer to its producer's path")
    heads = raw.get("heads", {})
    if not isinstance(heads, dict) or not all(_is_path(k) and _int(v) and v > 1 for k, v in heads.items()):
        raise bad("family.heads", "must map norm paths in a layer to the number of heads (> 1) their readers join")
    offsets = raw.get("gain_offsets", {})
    allowed = (0, 1) if norm_kind(raw["norm"]).gain_offset_allowed else (0,)
    if not isinstance(offsets, dict) or not all(
        _is_path(k) and v in allowed and not isinstance(v, bool) for k, v in offsets.items()
    ):
        raise bad("family.gain_offsets", f"must map norm paths in a layer to {' or '.join(map(str, allowed))}")
    per_layer = {norm for by_norm in layer_readers.values() for norm in by_norm} | {
        norm for by_norm in layer_producers.values() for norm in by_norm
    }
    tapered = {*internal, *post, *per_layer}
    for key, norms in (("gated", gated), ("heads", heads), ("gain_offsets", offsets)):
        if stray := next((norm for norm in norms if norm not in tapered), None):
            raise bad(f"family.{key}", f"names {stray!r}, which the family does not taper")
    if not tapered:
        raise bad("family.internal", "and 'post' are both empty, and no layer has norms of its own: no norm to taper")
    if set(internal) & set(post):
        raise bad("family.post", f"names {sorted(set(internal) & set(post))[0]!r}, which 'internal' names too")
    if not isinstance(untapered, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in untapered.items()
    ):
        raise bad("family.untapered", "must map module names to the reasons they are left untapered")
    eps = raw["norm_eps"]
    if eps is not None and not (is_finite_number(eps) and 0 < eps <= 1):
        raise bad("family.norm_eps", f"must be null or a number in (0, 1], got {eps!r}")
    return Family(
        name=model_type,
        model_types=(model_type,),
        norm=raw["norm"],
        layers=raw["layers"],
        internal={k: tuple(v) for k, v in internal.items()},
        final=raw["final"],
        post=dict(post),
        head=raw["head"],
        gain_offset=float(offset),
        untapered=dict(untapered),
        norm_eps=None if eps is None else float(eps),
        traced=True,
        layer_readers=layer_readers,
        layer_producers=layer_producers,
        gated=gated,
        heads=dict(heads),
        gain_offsets={k: float(v) for k, v in offsets.items()},
    )


def _by_layer(raw, key: str, bad) -> dict[int, dict]:
    """`raw` as {layer index (a string of digits): an object}, or the error naming `family.<key>`."""
    if not isinstance(raw, dict):
        raise bad(f"family.{key}", f"must be an object, got {type(raw).__name__}")
    for index, by_norm in raw.items():
        if not (isinstance(index, str) and index.isdigit() and len(index) <= 6) or not isinstance(by_norm, dict):
            raise bad(f"family.{key}", f"must map layer indices to objects, got {index!r}")
    return {int(index): by_norm for index, by_norm in raw.items()}


def _layer_readers(raw, bad) -> dict[int, dict[str, tuple[str, ...]]]:
    """`layer_readers`: layer index -> {a norm: its readers in that layer}."""
    out = _by_layer(raw, "layer_readers", bad)
    for index, by_norm in out.items():
        for norm, readers in by_norm.items():
            if not _is_path(norm):
                raise bad("family.layer_readers", f"layer {index} must name norms by their paths, got {norm!r}")
            if not (isinstance(readers, list) and readers and all(map(_is_path, readers))):
                raise bad("family.layer_readers", f"layer {index} must give {norm!r} a non-empty list of reader paths")
            if len(set(readers)) != len(readers):
                raise bad("family.layer_readers", f"layer {index} lists a reader of {norm!r} twice")
    return {index: {norm: tuple(readers) for norm, readers in by_norm.items()} for index, by_norm in out.items()}


def _layer_producers(raw, bad) -> dict[int, dict[str, str]]:
    """`layer_producers`: layer index -> {a post-norm: its producer in that layer}."""
    out = _by_layer(raw, "layer_producers", bad)
    for index, by_norm in out.items():
        if not all(_is_path(norm) and _is_path(producer) for norm, producer in by_norm.items()):
            raise bad("family.layer_producers", f"layer {index} must map post-norm paths to their producers' paths")
    return {index: dict(by_norm) for index, by_norm in out.items()}


def _gated(raw, bad) -> dict[str, Gating]:
    """`gated`: a gated norm's path in a layer -> {"activation", "norm_first", "groups"} (taperfold.nn.Gating)."""
    if not isinstance(raw, dict):
        raise bad("family.gated", f"must be an object, got {type(raw).__name__}")
    out = {}
    fields = {f.name for f in dataclasses.fields(Gating)}
    for norm, form in raw.items():
        if not _is_path(norm) or not isinstance(form, dict) or set(form) != fields:
            raise bad("family.gated", f"must map norm paths to objects with {', '.join(sorted(fields))}, got {norm!r}")
        if not isinstance(form["norm_first"], bool) or not _int(form["groups"]):
            raise bad("family.gated", f"{norm!r} needs a boolean norm_first and an integer groups")
        try:
            out[norm] = Gating(**form)
        except ValueError as e:
            raise bad("family.gated", f"{norm!r}: {e}") from None
    return out


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_path(value) -> bool:
    return isinstance(value, str) and _PATH.fullmatch(value) is not None
