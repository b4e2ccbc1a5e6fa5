"""Hugging Face models in: taper a transformers causal LM, fine-tune it through the taper, save it as a
tapered save_pretrained directory, and export / verify / bench it with transformers' own modeling code.

    from taperfold.hf import taper_model, TaperHook, save_hf_directory
    model = AutoModelForCausalLM.from_pretrained(DIR)
    taper_model(model, "internal")          # norms -> TaperNorm / TaperLN, one shared gate

Needs the `[hf]` extra (transformers). See docs/hf.md.
"""

from taperfold.hf.directory import HFCheckpoint, is_hf_directory, load_hf_directory, save_hf_directory
from taperfold.hf.families import Family, family_for, supported_model_types
from taperfold.hf.taper import Tapering, taper_model, tapering_of

__all__ = ["Family", "HFCheckpoint", "Tapering", "family_for", "is_hf_directory", "load_hf_directory",
           "save_hf_directory", "supported_model_types", "taper_model", "tapering_of"]
