"""The `taperfold` block of a tapered Hugging Face directory's config.json: how the model was tapered.

    "taperfold": {format_version, gate, taper, step, schedule, aux[, calibration][, norm][, family]}

A directory without it is a plain (untapered) model. `norm` is there only when a kind without a gate took the
norms' places (DyT: "dyt"), which has no `calibration`; without it the family's own norms are tapered. `family` is
there only when no family is shipped for the model_type: the family found by tracing the model, as data
(taperfold.families.serialize). The block is read (`parse_block`: every key checked, one error naming the file and the
key), made from a tapered model for saving (`TaperBlock.of`), and applied to a model built from config.json
(`taper_as_recorded`). See docs/checkpoint-format.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from torch import nn

from taperfold.errors import TaperfoldError
from taperfold.families import Family
from taperfold.families.serialize import family_from_data, family_to_data
from taperfold.hf.taper import taper_model
from taperfold.norms import norm_kinds
from taperfold.numeric import is_finite_number
from taperfold.taper import TAPERS, Tapering

BLOCK = "taperfold"
BLOCK_VERSION = 1
DEFAULT_CALIBRATION = {"momentum": 0.1, "delta": 1e-8}


@dataclass(frozen=True)
class TaperBlock:
    gate: float
    taper: str
    step: int = 0
    schedule: dict | None = None  # {"taper_start": int, "taper_end": int}
    aux: dict | None = None  # {"weight": λ, "target": s_tgt or null}
    # the calibration EMAs' rate and δ; None for a kind without a gate (DyT), which calibrates nothing
    calibration: dict | None = field(default_factory=lambda: dict(DEFAULT_CALIBRATION))
    norm: str | None = None  # a kind without a gate in the norms' places (DyT); None: the family's own, tapered
    family: Family | None = None  # a traced family (no shipped one for the model_type), as it was tapered with
    format_version: int = BLOCK_VERSION

    @classmethod
    def of(cls, tapering: Tapering, step: int = 0, schedule=None) -> TaperBlock:
        """The block a model tapered by `tapering` is saved with (`schedule`: its GateSchedule, or None)."""
        loss = tapering.scale_loss
        first = next(iter(tapering.norms.values()))
        gated = tapering.kind.gated
        return cls(
            gate=float(tapering.gate.value),
            taper=tapering.taper,
            step=int(step),
            schedule=None
            if schedule is None
            else {"taper_start": schedule.taper_start, "taper_end": schedule.taper_end},
            aux=None
            if loss is None
            else {"weight": loss.weight, "target": float(loss.target) if bool(loss.frozen) else None},
            calibration={"momentum": first.momentum, "delta": first.delta} if gated else None,
            norm=None if gated else tapering.kind.name,
            family=tapering.family if tapering.family.traced else None,
        )

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "gate": self.gate,
            "taper": self.taper,
            "step": self.step,
            "schedule": self.schedule,
            "aux": self.aux,
            **({"calibration": self.calibration} if self.calibration is not None else {}),
            **({"norm": self.norm} if self.norm is not None else {}),
            **({"family": family_to_data(self.family)} if self.family is not None else {}),
        }


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_BLOCK_KEYS = ("format_version", "gate", "taper", "step", "schedule", "aux", "calibration", "norm", "family")


def parse_block(raw, where: Path, model_type: str = "") -> TaperBlock:
    """Validate config.json's `taperfold` block; one error naming the file and the key otherwise."""

    def bad(key: str, why: str):
        return TaperfoldError(f"{where}: key '{BLOCK}.{key}' {why}")

    if not isinstance(raw, dict):
        raise TaperfoldError(f"{where}: key '{BLOCK}' must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_BLOCK_KEYS))
    if unknown:
        raise bad(unknown[0], f"is not a known key ({', '.join(_BLOCK_KEYS)})")
    if raw.get("format_version") != BLOCK_VERSION:
        raise bad("format_version", f"is {raw.get('format_version')!r}; this taperfold reads version {BLOCK_VERSION}")
    gate = raw.get("gate")
    if not is_finite_number(gate) or not 0.0 <= gate <= 1.0:
        raise bad("gate", f"must be a number in [0, 1], got {gate!r}")
    if raw.get("taper") not in TAPERS:
        raise bad("taper", f"must be one of {', '.join(TAPERS)}, got {raw.get('taper')!r}")
    step = raw.get("step", 0)
    if not _int(step):
        raise bad("step", f"must be a non-negative integer, got {step!r}")
    schedule = raw.get("schedule")
    if schedule is not None:
        if not isinstance(schedule, dict) or set(schedule) != {"taper_start", "taper_end"}:
            raise bad("schedule", "must be null or an object with taper_start and taper_end")
        start, end = schedule["taper_start"], schedule["taper_end"]
        if not (_int(start) and _int(end) and start < end):
            raise bad("schedule", f"needs integers 0 <= taper_start < taper_end, got {start!r}, {end!r}")
    aux = raw.get("aux")
    if aux is not None:
        if not isinstance(aux, dict) or not is_finite_number(aux.get("weight")) or aux["weight"] < 0:
            raise bad("aux", "must be null or an object with a non-negative number 'weight'")
        if aux.get("target") is not None and not is_finite_number(aux["target"]):
            raise bad("aux.target", f"must be a number or null, got {aux['target']!r}")
    norm = raw.get("norm")
    replacing = [kind.name for kind in norm_kinds() if not kind.gated]  # a gated kind is the family's own: no key
    if "norm" in raw and norm not in replacing:
        raise bad("norm", f"must be one of {', '.join(replacing)} (or absent: the family's own norms), got {norm!r}")
    if norm is not None and "calibration" in raw:
        raise bad("calibration", f"is set, but a {norm} model has no calibration")
    calibration = None if norm is not None else _calibration(raw.get("calibration", DEFAULT_CALIBRATION), bad)
    family = family_from_data(raw["family"], model_type, bad) if "family" in raw else None
    return TaperBlock(
        float(gate),
        raw["taper"],
        step,
        schedule,
        aux,
        calibration,
        norm,
        family,
    )


def _calibration(calibration: object, bad) -> dict:
    if not isinstance(calibration, dict):
        raise bad("calibration", "must be an object with 'momentum' and 'delta'")
    for key in ("momentum", "delta"):
        value = calibration.get(key)
        if not is_finite_number(value) or not (0 < value < 1 if key == "momentum" else value >= 0):
            raise bad(
                f"calibration.{key}",
                f"must be a number in {'(0, 1)' if key == 'momentum' else '[0, ∞)'}, got {value!r}",
            )
    return dict(calibration)


def taper_as_recorded(model: nn.Module, block: TaperBlock | None, family: Family, where: str) -> Tapering | None:
    """Taper a model built from config.json as `block` records (None: a plain directory, left as it is)."""
    if block is None:
        return None
    aux = block.aux or {}
    calibration = block.calibration or DEFAULT_CALIBRATION  # a kind without a gate does not read it
    tapering = taper_model(
        model,
        block.taper,
        kind=block.norm,
        family=family,
        aux=block.aux is not None,
        aux_weight=aux.get("weight", 0.1),
        momentum=calibration["momentum"],
        delta=calibration["delta"],
        where=where,
    )
    tapering.set_gate(block.gate)
    if tapering.scale_loss is not None and aux.get("target") is not None:
        tapering.scale_loss.target.fill_(aux["target"])
        tapering.scale_loss.frozen.fill_(True)
    return tapering
