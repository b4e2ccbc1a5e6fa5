"""Memory: a model built from a checkpoint holds the checkpoint's tensors (no copy), and verify opens one model at a
time. The peak of each command on a multi-GB model is measured by examples/big_model.py (docs/benchmarks.md)."""

import pytest
import torch

from taperfold.sources.builtin import read_checkpoint
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.models import build_model
from taperfold.runners.base import Runner
from taperfold.verify import verify_export


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_built_models_hold_the_checkpoints_tensors(tiny_checkpoint):
    ckpt = read_checkpoint(tiny_checkpoint)
    held = _storages(ckpt.state_dict.values())
    copied = build_model(ckpt.config)  # the plain way: fresh weights, then a copy of the checkpoint's
    copied.load_state_dict(ckpt.state_dict, strict=False)
    copied.set_gate(ckpt.gate)
    ids = torch.randint(0, ckpt.config.vocab_size, (2, 11))
    for model in (ckpt.build(), ckpt.build_baseline()):
        assert _storages(model.parameters()) <= held
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied: one parameter
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with torch.no_grad():
        assert torch.equal(ckpt.build().eval()(ids, logits="all"), copied.eval()(ids, logits="all"))


@pytest.mark.parametrize("kv_cache", [False, ("growing", "static")])
def test_verify_opens_one_model_at_a_time(tiny_checkpoint, tmp_path, monkeypatch, kv_cache):
    out = export_checkpoint(tiny_checkpoint, tmp_path / "out", ExportOptions(kv_cache=kv_cache)).out_dir
    loaded, most = set(), []
    load, close = Runner.load, Runner.close

    def counting_load(runner):
        load(runner)
        loaded.add(id(runner))
        most.append(len(loaded))

    def counting_close(runner):
        loaded.discard(id(runner))
        close(runner)

    monkeypatch.setattr(Runner, "load", counting_load)
    monkeypatch.setattr(Runner, "close", counting_close)
    report = verify_export(out, threads=1)
    assert report.passed
    # the torch checkpoint and baseline, then unfolded, folded, baseline and baseline-decomposed: one after another;
    # with decoders, the same six again for each cache (the two torch models decode for both)
    assert len(most) == (6 if not kv_cache else 6 + 2 + 4 * 2) and max(most) == 1 and not loaded
    decoders = [p for p in report.pairs if p.candidate.endswith((".decoder", ".static"))]
    assert len(decoders) == (0 if not kv_cache else 8) and all(p.status == "pass" for p in decoders)
