"""`export --ort-fusions`: ONNX Runtime's own LLM fusions (onnxscript's optimize_for_ort, passes/ort_fusions.py) on
every graph of a transformers model's export, after the fold; each fused graph verified against the checkpoint."""

import json
from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript.rewriter.ort_fusions")
pytestmark = pytest.mark.slow  # exports a model

from hf_models import tapered_tiny_model  # noqa: E402

from taperfold.export import ExportOptions, export_checkpoint  # noqa: E402
from taperfold.exportdir import GROWING  # noqa: E402
from taperfold.hf import save_hf_directory  # noqa: E402
from taperfold.opsets import ORT_FUSIONS_OPSET  # noqa: E402
from taperfold.passes.ort_fusions import OrtFusionsPass, contrib_ops  # noqa: E402
from taperfold.verify import verify_export  # noqa: E402


@pytest.fixture(scope="module")
def fused_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("ort-fusions")
    source = save_hf_directory(tapered_tiny_model("llama"), root / "tapered", step=1)
    return export_checkpoint(source, root / "export", ExportOptions(decoders=(GROWING,), ort_fusions=True)).out_dir


def test_every_graph_but_the_decomposed_baseline_runs_onnx_runtimes_attention(fused_export):
    """The decoders' attention becomes GroupQueryAttention (its mask is the plain causal one); the prefill graphs'
    stays MultiHeadAttention: transformers builds their mask with a check for packed sequences, which no rule proves
    away."""
    manifest = json.loads((fused_export / "manifest.json").read_text())
    layers = manifest["config"]["n_layers"]
    for key, record in manifest["artifacts"].items():
        graph = ir.load(fused_export / record["path"])
        if key.startswith("baseline-decomposed"):  # its norms stay written out: the fusions would fuse them
            assert "ort_fusions" not in record and not contrib_ops(graph)
            continue
        attention = "GroupQueryAttention" if record["graph"] == GROWING else "MultiHeadAttention"
        other = {"GroupQueryAttention", "MultiHeadAttention"} - {attention}
        assert record["ort_fusions"][attention] == layers and not other & set(record["ort_fusions"]), key
        assert contrib_ops(graph)[attention] == layers  # the manifest says what the graph holds
    assert manifest["timings"]["ort_fusions_s"] > 0


def _traced_decoder(root, model_type: str, **changes):
    """The folded growing-cache decoder of a tapered tiny `model_type` (`changes` set on its config), exported
    without the fusions at the opset --ort-fusions takes."""
    source = save_hf_directory(tapered_tiny_model(model_type, **changes), root / "tapered", step=1)
    options = ExportOptions(decoders=(GROWING,), baseline=False, opset=ORT_FUSIONS_OPSET)
    out = export_checkpoint(source, root / "export", options).out_dir
    return out / json.loads((out / "manifest.json").read_text())["artifacts"]["folded.decoder"]["path"]


# (batch, new tokens, past length): prompts (an empty past) of batch 1 and 4, single-token steps after a past, and a
# chunk of tokens after a past at batch 1 (ONNX Runtime's kernel refuses that chunk at batch > 1, docs/deployment.md)
CALLS = [(1, 7, 0), (4, 9, 0), (4, 1, 9), (2, 1, 20), (1, 5, 3)]


def _fused_runs_as_traced(model: ir.Model, traced_path, calls=CALLS) -> None:
    """`model` (fused) gives the traced graph's logits and cache on every call of `calls`."""
    import onnxruntime as ort

    fused_path = traced_path.with_name("fused.onnx")
    ir.save(model, fused_path, external_data="fused.onnx.data")
    fused, traced = (
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (fused_path, traced_path)
    )
    rng = np.random.default_rng(0)
    for batch, new, past in calls:
        feeds = {"input_ids": rng.integers(0, 256, size=(batch, new), dtype=np.int64)}
        for arg in traced.get_inputs()[1:]:
            feeds[arg.name] = rng.normal(size=[batch, arg.shape[1], past, arg.shape[3]]).astype(np.float32)
        for got, want in zip(fused.run(None, feeds), traced.run(None, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "head_size, rotary",
    [
        (16, {"RotaryEmbedding in GroupQueryAttention": 2}),  # the attention rotates query and key itself
        (8, {"RotaryEmbedding": 4}),  # ONNX Runtime's attention rotates multiples of 16 dims only
    ],
)
def test_the_grouped_attention_decoder_is_the_traced_one_on_every_call_onnx_runtime_takes(tmp_path, head_size, rotary):
    """The traced decoder and the pass's GroupQueryAttention form of it, transformers 5's RoPE fused, side by side
    in ONNX Runtime on every call in CALLS."""
    path = _traced_decoder(tmp_path, "llama", hidden_size=4 * head_size, head_dim=head_size)
    model = ir.load(path)
    fusions = OrtFusionsPass()
    fusions(model)
    layers = 2
    expected = {"GroupQueryAttention": layers, "SkipSimplifiedLayerNormalization": 1, **rotary}
    assert {op: n for op, n in fusions.fused.items() if op != "FusedMatMul"} == expected  # FusedMatMul: the tied head
    ops = Counter(n.op_type for n in model.graph)
    assert "Neg" not in ops and ops["Cos"] == ops["Sin"] == 1  # RoPE as traced gone; one cache for every layer
    _fused_runs_as_traced(model, path)


def test_every_layer_fuses_where_export_stamps_layers_out(tmp_path):
    """Export traces three layers and stamps the others out of the last; torch.export names the past + new length
    in another order there ("sequence + past_sequence_length"), which onnxscript's rules, binding dims by name, took
    for another length: only the first two layers were fused until the pass wrote each such sum one way."""
    path = _traced_decoder(tmp_path, "llama", hidden_size=64, head_dim=16, num_hidden_layers=5)
    assert json.loads((path.parent / "manifest.json").read_text())["artifacts"]["folded.decoder"]["traced_layers"] == 3
    model = ir.load(path)
    fusions = OrtFusionsPass()
    fusions(model)
    assert fusions.fused["GroupQueryAttention"] == fusions.fused["RotaryEmbedding in GroupQueryAttention"] == 5
    _fused_runs_as_traced(model, path, calls=CALLS[:3])


def _shift_positions(path, readers: str):
    """The decoder at `path` with the positions (past length + 0..S-1) moved on by 5 where `readers` read them:
    "rope" (the rotary embedding alone) or "all" (its mask too); saved beside it, and loaded."""
    model = ir.load(path)
    positions = next(
        n for n in model.graph if n.op_type == "Add" and getattr(n.inputs[0].producer(), "op_type", "") == "Range"
    )
    five = ir.val("five", ir.DataType.INT64, ir.Shape([]), const_value=ir.tensor(np.int64(5)))
    model.graph.register_initializer(five)
    shifted = ir.node("Add", [positions.outputs[0], five], num_outputs=1)
    model.graph.insert_after(positions, shifted)
    uses = list(positions.outputs[0].uses())
    rope = next(u for u in uses if u.node.outputs[0].uses()[0].node.op_type == "Cast")  # Unsqueeze -> Cast -> angles
    for use in [rope] if readers == "rope" else [u for u in uses if u.node is not shifted]:
        use.node.replace_input_with(use.idx, shifted.outputs[0])
    changed = path.with_name(f"shifted-{readers}.onnx")
    ir.save(model, changed, external_data=changed.name + ".data")
    return ir.load(changed), changed


def test_rope_at_positions_the_attention_does_not_count_keeps_its_own_rotary_embedding(tmp_path):
    """GroupQueryAttention rotates by the past's length + 0..S-1. A decoder whose RoPE reads other positions keeps
    RotaryEmbedding apart from the attention, and its outputs."""
    model, path = _shift_positions(_traced_decoder(tmp_path, "llama", hidden_size=64, head_dim=16), "rope")
    fusions = OrtFusionsPass()
    fusions(model)
    assert "RotaryEmbedding in GroupQueryAttention" not in fusions.fused
    assert fusions.fused["GroupQueryAttention"] == 2 and fusions.fused["RotaryEmbedding"] == 4
    _fused_runs_as_traced(model, path)


def test_a_causal_mask_over_other_positions_keeps_multi_head_attention(tmp_path):
    """GroupQueryAttention's causal mask is that of the past's length + 0..S-1 over the keys 0..past + S - 1; a
    mask comparing other positions (its rows moved on by 5) is not, and the attention stays as onnxscript fused it."""
    model, path = _shift_positions(_traced_decoder(tmp_path, "llama", hidden_size=64, head_dim=16), "all")
    fusions = OrtFusionsPass()
    fusions(model)
    assert "GroupQueryAttention" not in fusions.fused and fusions.fused["MultiHeadAttention"] == 2
    _fused_runs_as_traced(model, path)


def test_a_decoder_that_crops_its_cache_is_left_as_traced(tmp_path, monkeypatch):
    """A decoder traced through transformers' own sliding-window cache (Mistral's window, 16 tokens here) crops the
    past before attention; onnxscript's attention rules lose the crop (their MultiHeadAttention takes the whole mask
    and fails past the window), so the pass leaves the graph as it is, and says why. (taperfold's decoders keep
    every position: the test traces with transformers' cache as it is.)"""
    monkeypatch.setattr("taperfold.hf.model._keeping_every_position", lambda cache, static_length=None: cache)
    model = ir.load(_traced_decoder(tmp_path, "mistral"))
    nodes = [n.op_type for n in model.graph]
    fusions = OrtFusionsPass()
    assert not fusions(model).modified
    assert fusions.fused == {} and "past_key_values.0.key is cropped" in fusions.skipped
    assert [n.op_type for n in model.graph] == nodes


def test_fused_graphs_verify_against_the_checkpoint(fused_export):
    report = verify_export(fused_export, threads=1)
    assert report.passed, report.failure_message()
    assert {"checkpoint -> folded", "checkpoint -> folded.decoder", "unfolded -> folded"} <= {
        p.name for p in report.pairs
    }


def test_an_opset_23_graph_is_left_as_the_exporter_wrote_it():
    # At 23 the exporter writes ONNX's own fused ops, which onnxscript's rules do not take.
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 8])
    weight = helper.make_tensor("w", TensorProto.FLOAT, [8], np.ones(8, np.float32))
    graph = helper.make_graph([helper.make_node("RMSNormalization", ["x", "w"], ["y"])], "g", [x], [y], [weight])
    model = ir.serde.deserialize_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    )
    fusions = OrtFusionsPass()
    assert not fusions(model).modified and fusions.fused == {}
    assert [n.op_type for n in model.graph] == ["RMSNormalization"]


def test_ort_fusions_for_tensorrt_is_one_line_before_any_work(cli, tmp_path, tiny_checkpoint):
    result = cli("export", tiny_checkpoint, "-o", tmp_path / "out", "--target", "trt", "--ort-fusions")
    assert result.exit_code == 2
    assert "--ort-fusions writes ONNX Runtime's own ops (com.microsoft), which --target trt cannot run" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_an_attention_whose_rows_may_be_padded_keeps_its_rotary_embedding(tmp_path):
    """GroupQueryAttention rotates row b's tokens from seqlens_k[b]: where those are not total - 1 for every row (a
    padded batch), its positions are not the model's, and RotaryIntoGqa leaves the rotation apart."""
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    from taperfold.passes.ort_fusions import _MHA_TO_GQA
    from taperfold.passes.ort_rotary import ROPE_RULES, ROTARY_INTO_GQA_RULES

    model = ir.load(_traced_decoder(tmp_path, "llama", hidden_size=64, head_dim=16))
    optimize_for_ort(model)
    assert _MHA_TO_GQA.apply_to_model(model) == 2 and ROPE_RULES.apply_to_model(model) == 4
    first = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    padded = ir.val("padded_seqlens", ir.DataType.INT32, ir.Shape([1]), const_value=ir.tensor(np.array([0], np.int32)))
    model.graph.register_initializer(padded)
    first.replace_input_with(5, padded)
    assert ROTARY_INTO_GQA_RULES.apply_to_model(model) == 1  # the other layer's attention
    reader = next(use.node for use in padded.uses())
    assert reader.op_type == "GroupQueryAttention" and not reader.attributes.get_int("do_rotary")


def test_a_windowed_decoder_keeps_its_past_and_fuses_with_the_window_in_its_mask(tmp_path):
    """Mistral's window (16 tokens) is shorter than its context (32): the decoder keeps every position of its past
    and the mask applies the window, so nothing is cropped, the attention fuses (MultiHeadAttention: the window keeps
    it from GroupQueryAttention) and runs as traced on calls whose past passes the window."""
    model = ir.load(path := _traced_decoder(tmp_path, "mistral"))
    fusions = OrtFusionsPass()
    fusions(model)
    assert fusions.skipped is None and fusions.fused.get("MultiHeadAttention") == 2
    assert "GroupQueryAttention" not in fusions.fused
    _fused_runs_as_traced(model, path, calls=[(1, 1, 15), (1, 4, 14), (2, 1, 20), (1, 3, 27)])
