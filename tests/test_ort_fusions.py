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
    manifest = json.loads((fused_export / "manifest.json").read_text())
    layers = manifest["config"]["n_layers"]
    for key, record in manifest["artifacts"].items():
        graph = ir.load(fused_export / record["path"])
        if key.startswith("baseline-decomposed"):  # its norms stay written out: the fusions would fuse them
            assert "ort_fusions" not in record and not contrib_ops(graph)
            continue
        assert record["ort_fusions"]["MultiHeadAttention"] == layers, key
        assert contrib_ops(graph)["MultiHeadAttention"] == layers  # the manifest says what the graph holds
    assert manifest["timings"]["ort_fusions_s"] > 0


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
