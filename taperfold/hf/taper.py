"""Taper a transformers causal LM in place: `taper_model(model, "internal")`. Its family comes from
`model.config.model_type` (taperfold.families), or, for a model_type no family is shipped for, from tracing
transformers' model (taperfold.hf.trace); the tapering itself is taperfold.taper's, the same as for taperfold's
own models."""

from __future__ import annotations

from torch import nn

from taperfold import taper as core
from taperfold.errors import TaperfoldError
from taperfold.families import Family
from taperfold.hf.trace import family_for_model


def taper_model(
    model: nn.Module,
    taper: str = "internal",
    *,
    kind: str | None = None,
    family: Family | None = None,
    aux: bool = True,
    aux_weight: float = 0.1,
    momentum: float = 0.1,
    delta: float = 1e-8,
    gate: float = 1.0,
    where: str = "model",
) -> core.Tapering:
    """Replace `model`'s norms with tapered ones in place and return what was done (also `model.tapering`).

    `taper`: "internal" (every norm but the final one) or "all". `aux`: the fixed-target scale anchoring
    loss (eq. 5) on the final norm's input, added to the loss the model returns once its target is frozen
    (see taperfold.hf.training). `momentum`: μ of the calibration EMAs (the paper's GPT-2 fine-tuning uses
    0.1). `gate`: the initial gate value. `kind="dyt"` swaps the norms for DyT instead (taperfold.norms.dyt).
    `family`: the model's family as already found (a directory's); by default the shipped one for its model_type,
    else one traced from transformers' model for its config.
    """
    family = family or family_for_model(model, where)
    return core.taper_model(
        model,
        family,
        taper,
        kind=kind,
        aux=aux,
        aux_weight=aux_weight,
        momentum=momentum,
        delta=delta,
        gate=gate,
        where=where,
    )


def tapering_of(model: nn.Module) -> core.Tapering:
    tapering = getattr(model, "tapering", None)
    if tapering is None:
        raise TaperfoldError("the model is not tapered: call taperfold.hf.taper_model(model) first")
    return tapering
