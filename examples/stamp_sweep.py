"""Which tiny Hugging Face configurations of tests/hf_models.py export's layer stamping serves (docs/design.md,
"Tracing"): each given six layers, its prefill graph traced as `taperfold export` traces it, and the stage line that
says how (stamped from its first layers, or traced whole and why). Nothing downloaded.

    python examples/stamp_sweep.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import FAMILIES, UNLISTED, tapered_tiny_model, tiny_config

from taperfold.export import ExportOptions, StageClock, _trace
from taperfold.exportdir import PREFILL
from taperfold.hf import save_hf_directory
from taperfold.sources import open_source

LAYERS = 6


def main() -> None:
    counts = {"stamped": 0, "whole": 0, "not built": 0}
    for family in (*FAMILIES, *UNLISTED):
        types = getattr(tiny_config(family), "layer_types", None)
        changes = {"layer_types": [types[i % len(types)] for i in range(LAYERS)]} if types else {}
        with tempfile.TemporaryDirectory() as tmp:
            try:
                model = tapered_tiny_model(family, num_hidden_layers=LAYERS, **changes)
                source = open_source(save_hf_directory(model, Path(tmp) / family))
                tapered = source.build(gate=0.0)
            except Exception as e:  # noqa: BLE001 - a tiny config that cannot take six layers (per-layer lists)
                counts["not built"] += 1
                print(f"{family}: not built with {LAYERS} layers ({type(e).__name__}: {str(e)[:100]})", flush=True)
                continue
            stages: list[str] = []
            with source.export_context():
                _, how = _trace(tapered, ExportOptions(), PREFILL, 20, PREFILL, stages.append, StageClock())
        counts["stamped" if how.traced_layers else "whole"] += 1
        print(f"{family}: {stages[-1] if stages else 'traced whole'}", flush=True)
    print(", ".join(f"{kind} {n}" for kind, n in counts.items()))


if __name__ == "__main__":
    main()
