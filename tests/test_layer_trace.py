"""Export's three-layer trace: the layers after the third stamped out from it (taperfold.layer_trace,
passes/stamp_layers.py), checked against the torch model, a trace of every layer, and the models it must not serve."""

import json
import re

import numpy as np
import pytest

pytest.importorskip("transformers")

from hf_models import tapered_tiny_model, tiny_config

from taperfold.export import ExportOptions, StageClock, _trace, export_checkpoint
from taperfold.exportdir import GROWING, PREFILL, STATIC
from taperfold.hf import save_hf_directory
from taperfold.layer_trace import few_layer_model, why_trace_every_layer
from taperfold.passes.stamp_layers import StampLayersPass
from taperfold.sources import open_source
from taperfold.verify import verify_export

LAYERS = 6


def _model(family, tmp_path, **changes):
    """A tiny tapered model of `family` with LAYERS layers (its config's pattern of layer types repeated) and
    `changes` to its config, saved."""
    types = getattr(tiny_config(family), "layer_types", None)
    changes = ({"layer_types": [types[i % len(types)] for i in range(LAYERS)]} if types else {}) | changes
    folder = save_hf_directory(tapered_tiny_model(family, num_hidden_layers=LAYERS, **changes), tmp_path / family)
    return folder, open_source(folder).build(gate=0.0)


def _run(model_ir, seed=0):
    import onnx_ir as ir
    import onnxruntime as ort

    session = ort.InferenceSession(ir.serde.serialize_model(model_ir).SerializeToString())
    rng = np.random.default_rng(seed)
    feeds = {}
    for arg in session.get_inputs():
        shape = [2 if d == "batch" else 3 if isinstance(d, str) else d for d in arg.shape]
        if arg.name == "input_ids":
            feeds[arg.name] = rng.integers(0, 256, shape).astype(np.int64)
        elif arg.name == "cache_position":
            feeds[arg.name] = np.arange(3, dtype=np.int64)
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(np.float32)
    return [o.name for o in session.get_outputs()], session.run(None, feeds)


@pytest.mark.parametrize(
    "family,graph,changes,traced",
    [
        ("llama", PREFILL, {}, 3),
        ("llama", GROWING, {}, 3),
        ("llama", STATIC, {}, 3),
        ("gemma", PREFILL, {}, 3),  # each norm's gain 1 + γ: a constant the optimizer folds from a weight and the 1
        ("gemma", GROWING, {}, 3),
        ("falcon", PREFILL, {}, 3),  # constants folded from a tensor of layer 0's, one for every layer
        ("deepseek_v3", PREFILL, {"first_k_dense_replace": 2}, 4),  # two dense layers, then MoE ones
    ],
)
def test_stamped_graph_computes_what_a_trace_of_every_layer_computes(tmp_path, family, graph, changes, traced):
    folder, model = _model(family, tmp_path, **changes)
    opset = 20
    with open_source(folder).export_context():
        stamped, how = _trace(model, ExportOptions(), graph, opset, graph, lambda stage: None, StageClock())
        whole, how_whole = _trace(
            model, ExportOptions(stamp_layers=False), graph, opset, graph, lambda stage: None, StageClock()
        )
    assert (how.traced_layers, how_whole.traced_layers) == (traced, None)
    names, outputs = _run(stamped)
    whole_names, whole_outputs = _run(whole)
    assert names == whole_names  # present.0.key ... present.5.value in layer order, as decoder_io_names
    for name, a, b in zip(names, outputs, whole_outputs, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize(
    "family,decoders",
    [
        ("llama", ("growing", "static")),
        ("gpt2", ("growing",)),  # Conv1D weights stored [in, out]: read as they are, not transposed
        ("qwen2", ()),  # q/k/v biases
        ("olmo2", ()),  # post-norms, per-layer q/k norms
        ("mixtral", ("growing",)),  # experts and a router per layer
        ("gemma", ("growing",)),  # gains 1 + γ
    ],
)
def test_stamped_export_verifies_against_the_torch_model(tmp_path, family, decoders):
    folder, _ = _model(family, tmp_path)
    out = export_checkpoint(folder, tmp_path / "out", ExportOptions(decoders=decoders)).out_dir
    artifacts = json.loads((out / "manifest.json").read_text())["artifacts"]
    assert {key: entry.get("traced_layers") for key, entry in artifacts.items()} == dict.fromkeys(artifacts, 3)
    report = verify_export(out, threads=1)
    assert report.passed, report.failure_message()


def test_layers_of_several_types_are_traced_each(tmp_path):
    _, gemma2 = _model("gemma2", tmp_path)  # sliding and full attention, alternating
    assert "2 types" in why_trace_every_layer(gemma2)


def test_a_layer_whose_settings_differ_is_named(tmp_path):
    _, model = _model("llama", tmp_path)
    model.get_submodule(model.layers_path)[4].self_attn.scaling = 0.5
    assert why_trace_every_layer(model) == "layer 4 differs from layer 1 in the settings of self_attn"


def test_layers_unlike_the_rest_are_traced_only_where_they_come_first(tmp_path):
    _, model = _model("deepseek_v3", tmp_path, first_k_dense_replace=2)  # dense layers 0 and 1, then MoE ones
    assert why_trace_every_layer(model) is None
    assert few_layer_model(model, "hf.model.layers")[1].in_trace == 4
    layers = model.get_submodule(model.layers_path)
    layers[4] = layers[1]  # a dense layer among the MoE ones
    assert why_trace_every_layer(model) == "layer 4 differs from layer 2 in its modules (mlp.act_fn)"


def test_few_layers_are_traced_each(tmp_path):
    model = open_source(save_hf_directory(tapered_tiny_model("llama"), tmp_path / "two")).build(gate=0.0)
    assert "2 layers" in why_trace_every_layer(model)


def test_a_trace_whose_layers_differ_is_refused_and_left_as_it_was(tmp_path):
    import onnx_ir as ir

    from taperfold.tracing import export_to_ir

    _, model = _model("llama", tmp_path)
    few, layers = few_layer_model(model, "hf.model.layers")
    traced = export_to_ir(few, ExportOptions(), PREFILL, opset=20)
    softmax = next(
        n for n in traced.graph if n.op_type == "Softmax" and "hf.model.layers.2" in n.metadata_props["namespace"]
    )
    softmax.attributes["axis"] = ir.Attr("axis", ir.AttributeType.INT, 0)
    before = [n.name for n in traced.graph]
    stamp = StampLayersPass(layers)
    assert not stamp(traced).modified
    assert re.search(r"\(Softmax\) differs", stamp.refused or ""), stamp.refused
    assert [n.name for n in traced.graph] == before


def test_a_constant_made_from_a_weight_other_than_by_adding_a_number_is_refused(tmp_path):
    import ast

    import onnx_ir as ir

    from taperfold.passes.stamp_layers import FOLDED_FROM
    from taperfold.tracing import export_to_ir

    _, model = _model("gemma", tmp_path)
    few, layers = few_layer_model(model, "hf.model.layers")
    traced = export_to_ir(few, ExportOptions(), PREFILL, opset=20)
    gain = next(  # layer 2's first 1 + γ
        v
        for v in traced.graph.initializers.values()
        if len(ast.literal_eval(v.metadata_props.get(FOLDED_FROM, "[]"))) == 2
        and ast.literal_eval(v.metadata_props[FOLDED_FROM])[0].startswith("hf.model.layers.2.")
    )
    array = gain.const_value.numpy()
    gain.const_value = ir.tensor(array * np.linspace(1, 2, array.size, dtype=array.dtype).reshape(array.shape))
    before = [n.name for n in traced.graph]
    stamp = StampLayersPass(layers)
    assert not stamp(traced).modified
    assert re.search(rf"constant {gain.name} is .* changed in a way not stamped", stamp.refused or ""), stamp.refused
    assert [n.name for n in traced.graph] == before


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_taperfolds_own_models_are_stamped_unless_told_to_trace_every_layer(cli, tmp_path, arch):
    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
    from taperfold.models import random_gate0_model

    ckpt = save_checkpoint(
        checkpoint_from_model(random_gate0_model("tiny", arch, n_layers=LAYERS, d_model=64, d_ff=128), 0),
        tmp_path / "m.safetensors",
    )
    for flags, traced in [((), 3), (("--trace-every-layer",), None)]:
        out = tmp_path / f"out{len(flags)}"
        result = cli("export", str(ckpt), "-o", str(out), "--kv-cache", "growing", *flags)
        assert result.exit_code == 0, result.stderr
        assert ("3 of 6 layers traced, the others stamped out" in result.stdout) == bool(traced)
        artifacts = json.loads((out / "manifest.json").read_text())["artifacts"]
        assert {entry.get("traced_layers") for entry in artifacts.values()} == {traced}
    assert verify_export(tmp_path / "out0", threads=1).passed
