"""Memory: a model built from a checkpoint holds the checkpoint's tensors (no copy), bench's variants hold one copy of
the weights between them plus the folded layers, export's stamped layers read the model's weights when written and
export lets its models go before it builds an artifact that reads the source again, and verify opens one model at a
time. The peak of each command on a multi-GB model is measured by examples/big_model.py and examples/vllm_1b.py
(docs/benchmarks.md)."""

import re
import weakref
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch

from taperfold.export import ExportOptions, export_checkpoint
from taperfold.exportdir import ALL_VARIANTS, FOLDED, UNFOLDED
from taperfold.models import build_model
from taperfold.runners.base import Runner
from taperfold.sources.builtin import read_checkpoint
from taperfold.taper import fold_target
from taperfold.variants import build_variants
from taperfold.verify import verify_export


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_built_models_hold_the_checkpoints_tensors(tiny_checkpoint):
    ckpt = read_checkpoint(tiny_checkpoint)
    held = _storages(ckpt.state_dict.values())
    copied = build_model(ckpt.config)  # the plain way: fresh weights, then a copy of the checkpoint's
    copied.load_state_dict(ckpt.state_dict, strict=False)
    copied.set_gate(ckpt.gate)
    ids = torch.randint(0, ckpt.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    for model in (ckpt.build(), ckpt.build_baseline()):
        assert _storages(model.parameters()) <= held
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied: one parameter
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with torch.no_grad():  # two models, the weights at other addresses: MKL may sum in another order (test_checkpoint)
        torch.testing.assert_close(
            ckpt.build().eval()(ids, logits="all"), copied.eval()(ids, logits="all"), rtol=1e-6, atol=1e-6
        )


def _storage_bytes(model) -> dict[int, int]:
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bench_variants_share_the_weights_the_fold_leaves(tiny_checkpoint, fuse, dtype):
    ckpt = read_checkpoint(tiny_checkpoint)
    variants = build_variants(ckpt, list(ALL_VARIANTS), dtype, fuse_projections=fuse)
    unfolded = _storage_bytes(variants[UNFOLDED])
    for name, model in variants.items():
        if name != FOLDED:  # baseline, baseline-decomposed, nonorm: the unfolded model's tensors (one cast, one fusion)
            assert _storage_bytes(model).keys() <= unfolded.keys(), name
    # folded: its own copy of each layer a norm folds into (q/k/v, gate/up), nothing more
    model = ckpt.build(gate=0.0)
    targets = {t for norm in model.tapering.norms for t in model.tapering.folds_into(norm)}
    assert len(targets) == 5 * ckpt.config.n_layers
    folded_layers = sum(p.numel() for t in targets for p in fold_target(model.network, t).parameters())
    own = {ptr: n for ptr, n in _storage_bytes(variants[FOLDED]).items() if ptr not in unfolded}
    assert sum(own.values()) == folded_layers * dtype.itemsize


@pytest.mark.parametrize("kv_cache", [(), ("growing", "static")])
def test_verify_opens_one_model_at_a_time(tiny_checkpoint, tmp_path, monkeypatch, kv_cache):
    out = export_checkpoint(tiny_checkpoint, tmp_path / "out", ExportOptions(decoders=kv_cache)).out_dir
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


def test_stamped_layers_hold_no_copy_of_the_models_weights(tmp_path):
    """Layer stamping gives each layer after the trace the model's own weights as the graph reads them (a Linear's
    transposed for its MatMul): either the model's tensor itself or computed from it when read or written, never a
    copy of every layer at once (which held a 1.1 B model twice, examples/vllm_1b.py)."""
    from hf_models import tapered_tiny_model

    from taperfold.export import StageClock, _trace
    from taperfold.exportdir import PREFILL
    from taperfold.hf import save_hf_directory
    from taperfold.sources import open_source

    source = open_source(save_hf_directory(tapered_tiny_model("llama", num_hidden_layers=6), tmp_path / "tapered"))
    model = source.build(gate=0.0)
    model_ir, how = _trace(model, ExportOptions(), PREFILL, 20, "unfolded", lambda stage: None, StageClock())
    assert how.traced_layers == 3
    layers = model.network.model.layers
    held = [t.detach().numpy() for t in [*model.parameters(), *model.buffers()]]
    computed = 0
    for name, value in model_ir.graph.initializers.items():
        found = re.search(r"\.layers\.(\d+)\.(.+?)(_transposed)?$", name)
        if found is None or int(found[1]) == 0:  # layer 0 stays as traced
            continue
        tensor = value.const_value
        if isinstance(tensor, ir.LazyTensor):
            layer = layers[int(found[1])]
            weight = dict([*layer.named_parameters(), *layer.named_buffers()])[found[2]].detach().numpy()
            np.testing.assert_array_equal(tensor.numpy(), weight.T if found[3] else weight)
            computed += 1
        else:
            assert any(np.shares_memory(tensor.numpy(), w) for w in held), name
    assert computed >= 5 * 7  # q, k, v, o, gate, up, down of layers 1 to 5, transposed for their MatMuls


@pytest.mark.parametrize("graph_options", [{}, {"opset": 22, "ort_fusions": True}], ids=["default", "ort_fusions"])
def test_export_lets_the_source_go_before_building_an_artifact_that_reads_it_again(
    tmp_path, monkeypatch, graph_options
):
    """--vllm reads the source again to write the folded checkpoint: by then export has let go of its own models and
    of the source's tensors, memory-mapped from its safetensors files, so a model past 2 GB is not mapped twice. (The
    exporter's optimizer runs onnxscript's rewrite rules, whose matchers kept the last graph they matched: at opset
    23, tried first, its RMSNorm and RoPE fusions too; and --ort-fusions runs ONNX Runtime's and taperfold's own
    rules after the last trace.)"""
    from hf_models import tapered_tiny_model

    import taperfold.export as export
    from taperfold.artifacts.vllm_checkpoint import VllmCheckpoint, VllmRequest
    from taperfold.hf import save_hf_directory

    models: list[weakref.ref] = []
    held: list[tuple[bool, ...]] = []  # when the graphs are made, then when the artifact is built
    maps = Path("/proc/self/maps")
    export_graphs, build = export.export_graphs, VllmCheckpoint.build

    def note_what_is_held() -> None:
        held.append((*(model() is not None for model in models), str(source.resolve()) in maps.read_text()))

    def keeping_track(sources, *args, **kwargs):
        models.extend(weakref.ref(model) for _, model in sources)
        note_what_is_held()
        return export_graphs(sources, *args, **kwargs)

    def built_after(self, *args, **kwargs):
        note_what_is_held()
        return build(self, *args, **kwargs)

    monkeypatch.setattr(export, "export_graphs", keeping_track)
    monkeypatch.setattr(VllmCheckpoint, "build", built_after)
    tapered = tapered_tiny_model("llama", num_hidden_layers=6, tie_word_embeddings=False)
    source = save_hf_directory(tapered, tmp_path / "tapered", max_shard_size="100KB")  # several files
    options = ExportOptions(artifacts={"vllm": VllmRequest()}, **graph_options)
    result = export_checkpoint(source, tmp_path / "out", options)
    assert (result.out_dir / "vllm" / "folded" / "model.safetensors").is_file()
    assert held == [(True, True, True), (False, False, False)]  # the baseline, the unfolded model, the source's files
    assert not _rules_holding_a_graph()


def _rules_holding_a_graph() -> list[str]:
    """The module-level rewrite rules (onnxscript's, taperfold's) whose matcher still holds the last graph it matched,
    and through it the model's weights."""
    import sys

    from onnxscript.rewriter import RewriteRule, RewriteRuleSet

    holding = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("onnxscript.rewriter", "taperfold.passes")):
            continue
        for key, value in vars(module).items():
            rules = (
                value.rules
                if isinstance(value, RewriteRuleSet)
                else value
                if isinstance(value, list | tuple)
                else [value]
            )
            matchers = [rule._matcher for rule in rules if isinstance(rule, RewriteRule)]
            if any(getattr(matcher, "_graph", None) is not None for matcher in matchers):
                holding.append(f"{name}.{key}")
    return holding
