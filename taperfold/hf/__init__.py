"""Hugging Face models in: taper a transformers causal LM, fine-tune it through the taper, save it as a
tapered save_pretrained directory, and export / verify / bench it with transformers' own modeling code.

    from taperfold.hf import taper_model, TaperHook, save_hf_directory
    model = AutoModelForCausalLM.from_pretrained(DIR)
    taper_model(model, "internal")          # norms -> TaperNorm / TaperLN, one shared gate

Needs the `[hf]` extra (transformers). See docs/hf.md. The rest of taperfold reaches this package through
taperfold.sources only, by `KIND`: how a save_pretrained directory is recognised, opened and fine-tuned.
"""

from taperfold.families import Family, family_for, supported_model_types
from taperfold.hf import hub
from taperfold.hf.model import SOURCE, HFModelInfo
from taperfold.hf.save import save_hf_directory
from taperfold.hf.source import HFCheckpoint, is_hf_directory, load_hf_directory
from taperfold.hf.taper import taper_model, tapering_of
from taperfold.hf.training import TaperHook, train_hf_directory
from taperfold.sources.base import SourceKind
from taperfold.taper import Tapering

__all__ = [
    "KIND",
    "Family",
    "HFCheckpoint",
    "TaperHook",
    "Tapering",
    "family_for",
    "is_hf_directory",
    "load_hf_directory",
    "save_hf_directory",
    "supported_model_types",
    "taper_model",
    "tapering_of",
]

KIND = SourceKind(
    SOURCE,
    claims=is_hf_directory,
    open=load_hf_directory,
    wrote_config=lambda config: config.get("source") == SOURCE,
    config_from_dict=HFModelInfo.from_dict,
    fine_tune=train_hf_directory,
    resolve=hub.resolve,
)
