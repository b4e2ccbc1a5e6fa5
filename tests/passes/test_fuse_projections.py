"""FuseProjectionsPass alone on real exports (taperfold's llama and gpt2, transformers models, hand-written torch
modules), then through `taperfold export` (on by default, --no-fuse-projections) and `taperfold fold
--fuse-projections`.

Outputs are compared with a tight tolerance rather than bit for bit: one MatMul on the concatenated weight
computes every output column as the same dot product as before, but a BLAS may block, vectorize or thread a
wider matrix differently, which can change the summation order of a column (in fp32, ulps)."""

from __future__ import annotations

import json
import warnings
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from _graphs import F32, build, n, rand, rel_err, run, serialized
from torch import nn

from taperfold.export import ExportOptions
from taperfold.families import family_for
from taperfold.models import random_gate0_model
from taperfold.passes import FuseProjectionsPass, ProjectionReport, fold_model, load_model, save_model
from taperfold.tracing import export_to_ir

TOL = 1e-6  # fp32: see the module docstring


def from_bytes(proto: bytes) -> ir.Model:
    return ir.from_proto(onnx.load_from_string(proto))


def in_memory(path) -> ir.Model:
    """A model file with its weights read in, so that it runs from bytes."""
    return ir.external_data.load_to_model(load_model(path))


def linear_count(model: ir.Model) -> int:
    return sum(node.op_type in ("MatMul", "Gemm") for node in model.graph)


def fuse(model: ir.Model) -> ProjectionReport:
    report = ProjectionReport()
    FuseProjectionsPass(report)(model)
    return report


def fused_checked(model: ir.Model, feeds: dict, tol: float = TOL) -> ProjectionReport:
    """Fuse `model` in place; its outputs stay within `tol` (max rel) of what they were."""
    before = run(model, feeds)
    report = fuse(model)
    for b, a in zip(before, run(model, feeds), strict=True):
        assert rel_err(b, a) <= tol
    return report


def sibling_groups(family, n_layers: int, prefix: str = "") -> list[list[str]]:
    """What the family description says the sibling groups are: the readers of each norm, where there are several."""
    return [
        [prefix + r for r in readers]
        for readers in family.norm_readers(n_layers, "internal").values()
        if len(readers) > 1
    ]


@pytest.fixture(scope="module")
def builtin_exports():
    """taperfold's own tiny llama and gpt2 at g = 0, exported by torch.onnx (dynamo) and folded."""
    exports = {}
    for arch in ("llama", "gpt2"):
        model = random_gate0_model("tiny", arch, n_layers=2, max_seq_len=32)
        graph = export_to_ir(model, ExportOptions())
        fold_model(graph)
        exports[arch] = (model, serialized(graph))
    return exports


def ids_feed(batch=2, seq=11):
    return {"input_ids": np.random.default_rng(0).integers(0, 256, (batch, seq)).astype(np.int64)}


def test_llama_groups_are_the_familys_readers_and_the_residual_reader_stays(builtin_exports):
    model, proto = builtin_exports["llama"]
    graph = from_bytes(proto)
    before = linear_count(graph)
    report = fused_checked(graph, ids_feed())
    groups = [g.modules for g in report.groups]
    assert groups == sibling_groups(family_for("llama"), model.cfg.n_layers)  # q/k/v, then gate/up, per layer
    assert before - linear_count(graph) == (3 - 1 + 2 - 1) * model.cfg.n_layers
    assert report.summary()["linear_after"] == linear_count(graph)
    # after the fold, q/k/v read the residual stream, which the residual Add reads too: left, and still reading it
    for group in report.groups:
        x = next(v for node in graph.graph if node.name == group.fused for v in node.inputs[:1])
        readers = {u.node.op_type for u in x.uses()}
        assert readers == {"MatMul", "Add"}
        assert any(left.input == group.input and "not a linear layer" in left.reason for left in report.left)
    assert Counter(node.op_type for node in graph.graph)["Split"] == 2 * model.cfg.n_layers


def test_gpt2_c_attn_is_already_one_layer(builtin_exports):
    _, proto = builtin_exports["gpt2"]
    graph = from_bytes(proto)
    result = FuseProjectionsPass(report := ProjectionReport())(graph)
    assert not result.modified and report.groups == [] and serialized(graph) == proto
    assert sibling_groups(family_for("gpt2"), 2) == []  # ln_1 -> c_attn, ln_2 -> c_fc: one reader each


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "phi"])
def test_transformers_models(tmp_path, family):
    """Llama (GQA: k/v narrower than q; no biases) and Phi (q/k/v and fc1 read one norm; every layer biased)."""
    pytest.importorskip("transformers")
    from fold_models import constant_norms, export, tiny_model

    model, _ = constant_norms(tiny_model(family))
    graph = in_memory(export(model, tmp_path / "m.onnx", "dynamo", 18))
    ids = np.random.default_rng(0).integers(0, 64, (2, 7)).astype(np.int64)
    report = fused_checked(graph, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    expected = sibling_groups(family_for(family), model.config.num_hidden_layers, prefix="model.")
    assert [g.modules for g in report.groups] == expected
    assert all(g.bias == (family == "phi") for g in report.groups)
    if family == "llama":
        q, k, v = report.groups[0].widths
        assert q == 2 * k == 2 * v  # 4 query heads, 2 key/value heads
    adds = [node for node in graph.graph if node.name.endswith("_fused_bias")]
    assert len(adds) == (len(expected) if family == "phi" else 0)


class Siblings(nn.Module):
    """q/k/v on x, k's bias only, and an `other` layer on y that shares k's weight (tied)."""

    def __init__(self, d=8, tie=True):
        super().__init__()
        self.q, self.v = nn.Linear(d, d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.k = nn.Linear(d, d, bias=True)
        self.other = nn.Linear(d, d, bias=False)
        if tie:
            self.other.weight = self.k.weight

    def forward(self, x, y):
        return self.q(x) * self.k(x) + self.v(x)[..., :8] + self.other(y), torch.relu(x)


def export_siblings(path, tie=True, optimize=True, dtype=torch.float32):
    torch.manual_seed(0)
    module = Siblings(tie=tie).to(dtype).eval()
    args = (torch.randn(2, 3, 8).to(dtype), torch.randn(2, 3, 8).to(dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, optimize=optimize, input_names=["x", "y"], verbose=False)
    program.save(str(path), external_data=True)
    return str(path), {"x": args[0].float().numpy(), "y": args[1].float().numpy()}


@pytest.mark.parametrize("optimize", [True, False])  # False: the exporter keeps a Transpose of each weight
def test_a_tied_weight_is_not_consumed_and_the_other_readers_stay(tmp_path, optimize):
    src, feeds = export_siblings(tmp_path / "m.onnx", optimize=optimize)
    graph = in_memory(src)
    report = fused_checked(graph, feeds)
    (group,) = report.groups
    assert group.modules == ["q", "v"] and group.widths == [8, 16] and not group.bias
    reasons = {left.node: left.reason for left in report.left}
    tied = [r for r in reasons.values() if "(tied)" in r]
    assert len(tied) == 1 and "is also read by" in tied[0]
    assert any("Relu" in r and "not a linear layer" in r for r in reasons.values())  # x's other reader
    # k and other still read the one stored weight; relu still reads x
    assert linear_count(graph) == 3 and Counter(node.op_type for node in graph.graph)["Relu"] == 1


def test_a_bias_only_some_siblings_have_is_concatenated_with_zeros(tmp_path):
    src, feeds = export_siblings(tmp_path / "m.onnx", tie=False)
    graph = in_memory(src)
    report = fused_checked(graph, feeds)
    (group,) = report.groups
    assert group.modules == ["q", "k", "v"] and group.bias
    add = next(node for node in graph.graph if node.name == f"{group.fused}_bias")
    bias = add.inputs[1].const_value.numpy()
    k_bias = ir.load(src).graph.initializers["k.bias"].const_value.numpy()
    np.testing.assert_array_equal(bias, np.concatenate([np.zeros(8, np.float32), k_bias, np.zeros(16, np.float32)]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weights_are_concatenated_in_their_own_dtype(tmp_path, dtype):
    src, feeds = export_siblings(tmp_path / "m.onnx", tie=False, dtype=dtype)
    original = in_memory(src)
    weights = {node.name: node.inputs[1].const_value for node in original.graph if node.op_type == "MatMul"}
    graph = in_memory(src)
    (group,) = fuse(graph).groups
    fused = next(node for node in graph.graph if node.name == group.fused).inputs[1].const_value
    assert fused.dtype == weights[group.nodes[0]].dtype
    assert fused.dtype == (ir.DataType.FLOAT16 if dtype == torch.float16 else ir.DataType.BFLOAT16)
    parts = [weights[name].numpy() for name in group.nodes]
    assert fused.tobytes() == np.ascontiguousarray(np.concatenate(parts, axis=1)).tobytes()  # bit for bit
    if dtype == torch.float16:  # ONNX Runtime's CPU runs fp16 MatMul (not bf16)
        x = {name: value.astype(np.float16) for name, value in feeds.items()}
        for b, a in zip(run(original, x), run(graph, x), strict=True):
            assert rel_err(b, a) <= 1e-3


def test_external_data_is_read_only_when_written(tmp_path, monkeypatch):
    src, feeds = export_siblings(tmp_path / "m.onnx", tie=False)
    graph = load_model(src)
    assert any(isinstance(v.const_value, ir.ExternalTensor) for v in graph.graph.initializers.values())

    def no_reading(self, *args):
        raise AssertionError("the pass read a weight")

    with monkeypatch.context() as patched:
        for method in ("numpy", "tobytes", "__array__"):
            patched.setattr(ir.ExternalTensor, method, no_reading)
        report = fuse(graph)
    assert report.groups
    save_model(graph, tmp_path / "fused.onnx")
    written = ir.load(tmp_path / "fused.onnx")
    fused = next(node for node in written.graph if node.name == report.groups[0].fused).inputs[1]
    assert isinstance(fused.const_value, ir.ExternalTensor)  # written to fused.onnx.data like every weight
    assert not {"q.weight", "v.weight"} & set(written.graph.initializers)  # consumed: not stored twice
    for b, a in zip(run(src, feeds), run(str(tmp_path / "fused.onnx"), feeds), strict=True):
        assert rel_err(b, a) <= TOL


def gemm_graph(alpha=1.0, trans_b=1):
    """Three Gemm(x2d, W, C) on one input, the third with its own alpha."""
    K, widths = 5, (4, 6, 3)
    nodes = [
        n("Gemm", ["x", f"W{i}", f"b{i}"], [f"y{i}"], transB=trans_b, alpha=alpha if i == 2 else 1.0) for i in range(3)
    ]
    inits = {}
    for i, w in enumerate(widths):
        inits[f"W{i}"] = rand(w, K) if trans_b else rand(K, w)
        inits[f"b{i}"] = rand(w)
    return build(nodes, [("x", F32, [7, K])], [(f"y{i}", F32, [7, w]) for i, w in enumerate(widths)], inits)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_siblings_and_one_that_needs_arithmetic(trans_b):
    model = gemm_graph(alpha=0.5, trans_b=trans_b)
    report = fused_checked(model, {"x": rand(7, 5)})
    (group,) = report.groups
    assert group.nodes == ["y0", "y1"] and group.bias and group.widths == [4, 6]
    assert [left.node for left in report.left] == ["y2"] and "alpha ≠ 1" in report.left[0].reason
    gemm = next(node for node in model.graph if node.name == group.fused)
    assert gemm.attributes.get_int("transB") == trans_b
    assert [v.name for v in model.graph.outputs] == ["y0", "y1", "y2"]  # graph outputs keep their names


def test_an_old_opset_gets_split_sizes_as_an_attribute():
    nodes = [n("MatMul", ["x", "A"], ["a"]), n("MatMul", ["x", "B"], ["b"]), n("Add", ["a", "b"], ["y"])]
    model = build(nodes, [("x", F32, [2, 4])], [("y", F32, [2, 3])], {"A": rand(4, 3), "B": rand(4, 3)}, opset=11)
    fused_checked(model, {"x": rand(2, 4)})
    split = next(node for node in model.graph if node.op_type == "Split")
    assert len(split.inputs) == 1 and list(split.attributes.get_ints("split")) == [3, 3]


# ---- through the commands --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint

    model = random_gate0_model("tiny", "llama", n_layers=2, max_seq_len=32)
    return save_checkpoint(checkpoint_from_model(model, 0), tmp_path_factory.mktemp("ckpt") / "llama.safetensors")


@pytest.mark.slow
def test_export_fuses_every_graph_unless_told_not_to_and_verify_holds_it_to_the_folds_tolerance(
    tmp_path, cli, checkpoint
):
    from taperfold.verify import verify_export

    matmuls = {}
    for flag in ("--fuse-projections", "--no-fuse-projections"):
        out = tmp_path / flag
        result = cli("export", checkpoint, "-o", out, flag, "--json")
        assert result.exit_code == 0, result.stderr
        manifest = json.loads(result.stdout)
        assert manifest["export"]["fuse_projections"] is (flag == "--fuse-projections")
        for key, artifact in manifest["artifacts"].items():
            if flag == "--no-fuse-projections":
                assert artifact["projections"] is None
            else:  # baseline, unfolded and folded alike: the fold's own gain stays visible
                assert artifact["projections"]["summary"]["groups"] == 4, key
        matmuls[flag] = {key: linear_count(ir.load(out / a["path"])) for key, a in manifest["artifacts"].items()}
        report = verify_export(out)
        assert report.passed
        matmuls[flag + " rtol"] = {pair.name: pair.tolerance.rtol for pair in report.pairs}
    assert all(
        matmuls["--no-fuse-projections"][k] - matmuls["--fuse-projections"][k] == 6
        for k in matmuls["--fuse-projections"]
    )
    assert matmuls["--fuse-projections rtol"] == matmuls["--no-fuse-projections rtol"]


@pytest.mark.slow
def test_fold_fuses_projections_only_when_asked(tmp_path, cli, checkpoint):
    out = tmp_path / "out"
    assert cli("export", checkpoint, "-o", out, "--no-fuse-projections", "--no-baseline").exit_code == 0
    src = out / "unfolded.onnx"
    plain = cli("fold", src, "-o", tmp_path / "plain.onnx", "--json")
    assert "projections" not in json.loads(plain.stdout)
    result = cli("fold", src, "-o", tmp_path / "fused.onnx", "--fuse-projections", "--verify", "--json")
    assert result.exit_code == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["verify"]["passed"] and printed["summary"]["folded"] == 4
    assert printed["projections"]["summary"]["groups"] == 4
    assert linear_count(ir.load(tmp_path / "plain.onnx")) - linear_count(ir.load(tmp_path / "fused.onnx")) == 6
    table = cli("fold", src, "-o", tmp_path / "fused.onnx", "--fuse-projections")
    # after the fold, q/k/v and gate/up read the residual stream, which the residual Add reads too (left)
    assert "projections: 4 group(s) of 10 linear layers fused, linear layers 15 -> 9, 4 reader(s) left" in " ".join(
        table.stdout.split()
    )
    assert "model.layers.0.self_attn.q_proj + model.layers.0.self_attn.k_proj" in table.stdout


# ---- the torch variants ----------------------------------------------------------------------------------


def torch_variants(arch: str, fuse: bool) -> dict:
    from taperfold.checkpoint import checkpoint_from_model
    from taperfold.variants import build_variants

    model = random_gate0_model("tiny", arch, n_layers=2, max_seq_len=32)
    return build_variants(
        checkpoint_from_model(model, step=0), ["baseline", "unfolded", "folded"], torch.float32, fuse_projections=fuse
    )


def fused_modules(model) -> list:
    from taperfold.variants import FusedProjection

    return list(dict.fromkeys(m for m in model.modules() if isinstance(m, FusedProjection)))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_torch_variants_run_each_group_as_one_layer(arch):
    plain, fused = torch_variants(arch, False), torch_variants(arch, True)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    for name, model in fused.items():
        groups = fused_modules(model)
        assert len(groups) == (2 * 2 if arch == "llama" else 0), name  # gpt2's c_attn is one layer already
        calls: list = []
        for group in groups:
            group.register_forward_hook(lambda module, args, out, calls=calls: calls.append(module))
        with torch.no_grad():
            expected, got = plain[name](ids, logits="all"), model(ids, logits="all")
        assert float((got - expected).abs().max() / expected.abs().max()) <= TOL
        assert calls == groups  # one product per group and forward, in order: the siblings share it
        assert all(group._slices is None for group in groups)  # nothing held after the forward


def test_a_sibling_called_on_a_changed_input_computes_afresh():
    from taperfold.variants import FusedProjection, ProjectionPart

    torch.manual_seed(0)
    layers = [nn.Linear(4, 3), nn.Linear(4, 5, bias=False)]
    shared = FusedProjection(layers)
    first, second = ProjectionPart(shared, 0), ProjectionPart(shared, 1)
    x = torch.randn(2, 4)
    # A part slices one matmul on the concatenated weight: another GEMM than the layer's own, so fp32's tolerance (the
    # module docstring); a stale result would be off by the factor of 2.
    with torch.no_grad():
        torch.testing.assert_close(first(x), layers[0](x), rtol=1e-6, atol=1e-6)
        x.mul_(2)  # changed in place: same tensor object, new version
        torch.testing.assert_close(second(x), layers[1](x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(second(x), layers[1](x), rtol=1e-6, atol=1e-6)  # again, alone: computed again


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "phi"])
def test_torch_fusion_of_transformers_models_follows_the_family(family):
    pytest.importorskip("transformers")
    from fold_models import tiny_model

    from taperfold.hf.model import HFCausalLM, HFModelInfo
    from taperfold.variants import fuse_projections_in_torch

    hf = tiny_model(family)
    fam = family_for(family)
    model = HFCausalLM(hf, HFModelInfo.from_config(hf.config, fam, "none", False, "bytes"), fam)
    fused = model.copy()
    groups = fuse_projections_in_torch(fused, fam)
    assert groups == sibling_groups(fam, hf.config.num_hidden_layers)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = model(ids, logits="all"), fused(ids, logits="all")
    assert float((got - expected).abs().max() / expected.abs().max()) <= TOL


@pytest.mark.slow
def test_torch_compile_traces_one_linear_per_group():
    """dynamo follows the slices' bookkeeping: the graph it hands the compiler has one linear per group."""
    plain, fused = torch_variants("llama", False)["folded"], torch_variants("llama", True)["folded"]
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    counts = {}
    for name, model in (("plain", plain), ("fused", fused)):

        def count_linears(gm, example_inputs, name=name):
            counts[name] = sum(node.target is torch._C._nn.linear for node in gm.graph.nodes)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=count_linears, fullgraph=True)
        with torch.no_grad():
            got, expected = compiled(ids, logits="all"), model(ids, logits="all")
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert counts["plain"] - counts["fused"] == (3 - 1 + 2 - 1) * 2, counts
