"""`export --ort-fusions`: ONNX Runtime's own LLM fusions (onnxscript's optimize_for_ort, passes/ort_fusions.py) on
every graph of a transformers model's export, after the fold; each fused graph verified against the checkpoint."""

import json

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


def _traced_decoder(root, model_type: str):
    """The folded growing-cache decoder of a tapered tiny `model_type`, exported without the fusions."""
    source = save_hf_directory(tapered_tiny_model(model_type), root / "tapered", step=1)
    options = ExportOptions(decoders=(GROWING,), baseline=False)
    out = export_checkpoint(source, root / "export", options).out_dir
    return out / json.loads((out / "manifest.json").read_text())["artifacts"]["folded.decoder"]["path"]


def test_the_grouped_attention_decoder_is_the_traced_one_on_every_call_onnx_runtime_takes(tmp_path):
    """The traced decoder and the pass's GroupQueryAttention form of it, side by side in ONNX Runtime: prompts (an
    empty past) of batch 1 and 4, single-token steps after a past, and a chunk of tokens after a past at batch 1
    (ONNX Runtime's kernel refuses that chunk at batch > 1, docs/deployment.md)."""
    import onnxruntime as ort

    path = _traced_decoder(tmp_path, "llama")
    model = ir.load(path)
    fusions = OrtFusionsPass()
    fusions(model)
    layers = 2
    assert fusions.fused == {"GroupQueryAttention": layers, "SkipSimplifiedLayerNormalization": 1}
    fused_path = path.with_name("fused.onnx")
    ir.save(model, fused_path, external_data="fused.onnx.data")
    fused, traced = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (fused_path, path))
    rng = np.random.default_rng(0)
    for batch, new, past in [(1, 7, 0), (4, 9, 0), (4, 1, 9), (2, 1, 20), (1, 5, 3)]:
        feeds = {"input_ids": rng.integers(0, 256, size=(batch, new), dtype=np.int64)}
        for arg in traced.get_inputs()[1:]:
            feeds[arg.name] = rng.normal(size=[batch, arg.shape[1], past, arg.shape[3]]).astype(np.float32)
        for got, want in zip(fused.run(None, feeds), traced.run(None, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_sliding_window_mask_keeps_its_attention_as_it_is(tmp_path):
    """Mistral's window (16 tokens here) is in its mask: GroupQueryAttention without the window would attend to
    tokens the model does not see, so the rule leaves such an attention to onnxscript's MultiHeadAttention."""
    model = ir.load(_traced_decoder(tmp_path, "mistral"))
    fusions = OrtFusionsPass()
    fusions(model)
    assert "GroupQueryAttention" not in fusions.fused and fusions.fused.get("MultiHeadAttention") == 2


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
