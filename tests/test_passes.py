"""Graph passes: detect and fold constant-scale norms, checked numerically in ONNX Runtime."""

from __future__ import annotations

import json
import warnings
from collections import Counter

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from taperfold.errors import TaperfoldError
from taperfold.passes import fold_model, fold_onnx_file

D, N, V = 8, 6, 11
rng = np.random.default_rng(0)
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def rand(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def build(nodes, inputs, outputs, inits, opset=18) -> ir.Model:
    """A hand-built model; inputs/outputs are (name, elem_type, shape)."""
    graph = helper.make_graph(
        [helper.make_node(op, ins, outs, name=name, **attrs) for name, op, ins, outs, attrs in nodes],
        "g",
        [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info(*o) for o in outputs],
        [numpy_helper.from_array(array, name) for name, array in inits.items()],
    )
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", opset)])
    return ir.serde.deserialize_model(proto)


def n(op, ins, outs, name=None, **attrs):
    return (name or outs[0], op, ins, outs, attrs)


def run(model: ir.Model | str, feeds: dict) -> list[np.ndarray]:
    source = model if isinstance(model, str) else ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feeds)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(a).max())


def fold_checked(model: ir.Model, feeds: dict, tol: float = 1e-5):
    """Fold in place; the outputs in ORT must match the unfolded model's."""
    before = run(model, feeds)
    report = fold_model(model)
    after = run(model, feeds)
    for a, b in zip(before, after, strict=True):
        assert rel_err(a, b) <= tol
    return report, before, after


def ops(model: ir.Model) -> Counter:
    return Counter(node.op_type for node in model.graph)


def x3():
    return {"x": rand(2, 3, D)}


X = ("x", F32, [2, 3, D])


def mul_matmul(scale: np.ndarray, cols: int = N) -> ir.Model:
    """The smallest candidate: y = Mul(x, s) · W."""
    nodes = [n("Mul", ["x", "s"], ["h"]), n("MatMul", ["h", "W"], ["y"])]
    return build(nodes, [X], [("y", F32, [2, 3, cols])], {"s": scale, "W": rand(D, cols)})


# ---- RMS form ------------------------------------------------------------------------------------


def test_rms_fan_out_to_q_k_v_folds_every_reader():
    # HF operand order for the vector (weight * h), the scalar on the right.
    model = build(
        [
            n("Mul", ["x", "c"], ["hc"]),
            n("Mul", ["w", "hc"], ["h"]),
            n("MatMul", ["h", "Wq"], ["q"]),
            n("MatMul", ["h", "Wk"], ["k"]),
            n("MatMul", ["h", "Wv"], ["v"]),
            n("Add", ["q", "k"], ["qk"]),
            n("Add", ["qk", "v"], ["y"]),
        ],
        [X],
        [("y", F32, [2, 3, N])],
        {"c": np.array(0.7, np.float32), "w": rand(D), "Wq": rand(D, N), "Wk": rand(D, N), "Wv": rand(D, N)},
    )
    report, *_ = fold_checked(model, x3())
    (entry,) = report.norms
    assert (entry.kind, entry.status, entry.into) == ("rms", "folded", "consumers")
    assert sorted(entry.consumers) == ["k", "q", "v"]
    assert entry.bytes_rewritten == 3 * D * N * 4 and entry.copied == []
    assert ops(model) == Counter({"MatMul": 3, "Add": 2})
    assert not {"c", "w"} & set(model.graph.initializers)
    summary = report.to_dict()["summary"]
    assert summary["folded"] == 1 and summary["nodes_before"] == 7 and summary["nodes_after"] == 5
    json.dumps(report.to_dict())


def test_tied_transposed_weight_is_copied_and_the_gather_table_kept_bit_identical():
    table = rand(V, D)
    model = build(
        [
            n("Gather", ["E", "ids"], ["emb"]),
            n("Add", ["emb", "r"], ["x"]),
            n("Mul", ["x", "c"], ["hc"]),
            n("Mul", ["hc", "w"], ["h"]),
            n("Transpose", ["E"], ["Et"], perm=[1, 0]),
            n("MatMul", ["h", "Et"], ["logits"]),
        ],
        [("ids", TensorProto.INT64, [2, 3]), ("r", F32, [2, 3, D])],
        [("logits", F32, [2, 3, V]), ("emb", F32, [2, 3, D])],
        {"E": table, "c": np.array(1.3, np.float32), "w": rand(D)},
    )
    report, *_ = fold_checked(model, {"ids": rng.integers(0, V, (2, 3)), "r": rand(2, 3, D)})
    (entry,) = report.norms
    assert entry.status == "folded" and len(entry.copied) == 1 and entry.copied[0].startswith("E -> E.folded")
    assert model.graph.initializers["E"].const_value.tobytes() == table.tobytes()
    assert ops(model) == Counter({"Gather": 1, "Add": 1, "MatMul": 1})


def test_weight_shared_with_a_reader_outside_the_norm_is_copied():
    W = rand(D, N)
    model = build(
        [
            n("Mul", ["x", "w"], ["h"]),
            n("MatMul", ["h", "W"], ["a"]),
            n("MatMul", ["x", "W"], ["b"]),
        ],
        [X],
        [("a", F32, [2, 3, N]), ("b", F32, [2, 3, N])],
        {"w": rand(D), "W": W},
    )
    report, before, after = fold_checked(model, x3())
    assert report.norms[0].status == "folded" and report.norms[0].copied
    np.testing.assert_array_equal(before[1], after[1])
    assert model.graph.initializers["W"].const_value.tobytes() == W.tobytes()


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("with_c", [True, False])
def test_gemm_trans_b(kind, with_c):
    ln = kind == "ln"
    head = [n("ReduceMean", ["x", "axes"], ["m"], keepdims=1), n("Sub", ["x", "m"], ["xc"])] if ln else []
    model = build(
        [
            *head,
            n("Mul", ["xc" if ln else "x", "c"], ["hc"]),
            n("Mul", ["hc", "w"], ["hw"]),
            *([n("Add", ["beta", "hw"], ["h"])] if ln else [n("Identity", ["hw"], ["h"])]),
            n("Gemm", ["h", "B", *(["C"] if with_c else [])], ["y"], transB=1, alpha=0.5, beta=2.0),
        ],
        [("x", F32, [4, D])],
        [("y", F32, [4, N])],
        {"axes": np.array([-1]), "c": np.array(0.9, np.float32), "w": rand(D), "beta": rand(D), "B": rand(N, D),
         "C": rand(N)},
    )
    report, *_ = fold_checked(model, {"x": rand(4, D)})
    assert report.norms[0].kind == kind and report.norms[0].status == "folded"
    assert ops(model) == Counter({"Gemm": 1})


# ---- LN form -------------------------------------------------------------------------------------


def ln_block(bias_on_q: bool, opset=18, dtype=np.float32):
    """TaperLN at g = 0 feeding q (optionally with an Add bias, operands swapped) and a graph-output head."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    mean = (
        n("ReduceMean", ["x", "axes"], ["m"], keepdims=1)
        if opset >= 18
        else n("ReduceMean", ["x"], ["m"], axes=[-1], keepdims=1)
    )
    return build(
        [
            mean,
            n("Sub", ["x", "m"], ["xc"]),
            n("Mul", ["xc", "c"], ["hc"]),
            n("Mul", ["hc", "w"], ["hw"]),
            n("Add", ["hw", "beta"], ["h"]),
            n("MatMul", ["h", "Wq"], ["q0"]),
            *([n("Add", ["bq", "q0"], ["q"])] if bias_on_q else [n("Relu", ["q0"], ["q"])]),
            n("MatMul", ["h", "Wo"], ["logits"]),
        ],
        [("x", elem, [2, 3, D])],
        [("q", elem, [2, 3, N]), ("logits", elem, [2, 3, V])],
        {
            "axes": np.array([-1]),
            **{k: rand(*shape, dtype=dtype)
               for k, shape in {"c": (), "w": (D,), "beta": (D,), "Wq": (D, N), "bq": (N,), "Wo": (D, V)}.items()},
        },
        opset=opset,
    )


@pytest.mark.parametrize("bias_on_q", [True, False])
@pytest.mark.parametrize("opset", [17, 18])
def test_ln_folds_mean_scale_and_beta_with_and_without_a_reader_bias(bias_on_q, opset):
    model = ln_block(bias_on_q, opset)
    report, *_ = fold_checked(model, x3())
    (entry,) = report.norms
    assert (entry.kind, entry.status) == ("ln", "folded")
    counts = ops(model)
    assert counts["ReduceMean"] == counts["Sub"] == counts["Mul"] == 0
    assert counts["Add"] == 2  # q's bias (kept or created) and the head's created bias
    assert [v.name for v in model.graph.outputs] == ["q", "logits"]


def test_ln_fold_is_exact_in_float64():
    fold_checked(ln_block(True, dtype=np.float64), {"x": rand(2, 3, D, dtype=np.float64)}, tol=1e-13)


# ---- embedding tables ----------------------------------------------------------------------------


def embed_model(tied: bool, kind: str = "rms"):
    ln = kind == "ln"
    head = [n("ReduceMean", ["emb", "axes"], ["m"], keepdims=1), n("Sub", ["emb", "m"], ["ec"])] if ln else []
    return build(
        [
            n("Gather", ["E", "ids"], ["emb"]),
            *head,
            n("Mul", ["c", "ec" if ln else "emb"], ["hc"]),
            n("Mul", ["hc", "w"], ["hw"]),
            *([n("Add", ["hw", "beta"], ["h"])] if ln else [n("Identity", ["hw"], ["h"])]),
            n("Add", ["h", "r"], ["y"]),  # a residual: the readers cannot take the fold
            *([n("Transpose", ["E"], ["Et"]), n("MatMul", ["y", "Et"], ["logits"])] if tied else []),
        ],
        [("ids", TensorProto.INT64, [2, 3]), ("r", F32, [2, 3, D])],
        [("logits", F32, [2, 3, V])] if tied else [("y", F32, [2, 3, D])],
        {"E": rand(V, D), "axes": np.array([-1]), "c": np.array(1.7, np.float32), "w": rand(D), "beta": rand(D)},
    )


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_norm_after_an_embedding_folds_into_the_table(kind):
    model = embed_model(tied=False, kind=kind)
    report, *_ = fold_checked(model, {"ids": rng.integers(0, V, (2, 3)), "r": rand(2, 3, D)})
    (entry,) = report.norms
    assert (entry.status, entry.into) == ("folded", "embedding") and "'E'" in entry.reason
    assert ops(model) == Counter({"Gather": 1, "Add": 1})


def test_embedding_fold_is_blocked_when_the_table_is_tied():
    model = embed_model(tied=True)
    report, before, after = fold_checked(model, {"ids": rng.integers(0, V, (2, 3)), "r": rand(2, 3, D)})
    (entry,) = report.norms
    assert entry.status == "kept"
    assert "'y' (Add)" in entry.reason and "table 'E' is shared with 'Et' (Transpose)" in entry.reason
    np.testing.assert_array_equal(before[0], after[0])


# ---- refusals ------------------------------------------------------------------------------------


REFUSALS = {
    "residual": ([n("MatMul", ["h", "W"], ["a"]), n("Add", ["h", "a"], ["y"])], "'y' (Add) is not a linear layer"),
    "graph output": ([n("MatMul", ["h", "W"], ["y"])], "graph output"),
    "dynamic weight": ([n("MatMul", ["h", "x2"], ["y"])], "non-constant weight"),
    "weight side": ([n("MatMul", ["Wt", "h"], ["y"])], "reads the norm's output as its weight"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_norm_is_kept_unchanged_with_a_reason(case):
    readers, reason = REFUSALS[case]
    outputs = [("y", F32, [2, 3, D])] + ([("h", F32, [2, 3, D])] if case == "graph output" else [])
    model = build(
        [n("Mul", ["x", "c"], ["hc"]), n("Mul", ["hc", "w"], ["h"]), *readers],
        [X, ("x2", F32, [D, D])],
        outputs,
        {"c": np.array(0.5, np.float32), "w": rand(D), "W": rand(D, D), "Wt": rand(3, 3)},
    )
    feeds = {**x3(), "x2": rand(D, D)}
    report, before, after = fold_checked(model, feeds)
    (entry,) = report.norms
    assert entry.status == "kept" and reason in entry.reason
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert ops(model)["Mul"] == 2


def test_scale_fed_as_a_graph_input_is_not_a_match():
    # An initializer that is also a graph input can be overridden at run time: not a constant.
    model = mul_matmul(rand(D))
    model.graph.inputs.append(model.graph.initializers["s"])
    assert fold_model(model).norms == []


def test_scalar_only_chain_is_not_a_norm():
    model = mul_matmul(np.array(0.5, np.float32))
    assert fold_model(model).norms == []


def test_a_model_the_checker_already_rejects_is_still_folded():
    model = mul_matmul(rand(D))
    model.graph.name = ""  # onnx.checker requires a graph name; ONNX Runtime does not
    report, *_ = fold_checked(model, x3())
    assert report.norms[0].status == "folded"
    assert report.check_input.startswith("failed: ") and report.check_output == report.check_input


# ---- dtypes --------------------------------------------------------------------------------------


def test_round_trip_casts_in_the_chain_collapse():
    # fp16 in, widened to fp32 for the scalar, narrowed back, then the fp16 weight (HF: weight * h.to(dtype)).
    model = build(
        [
            n("Cast", ["x"], ["x32"], to=F32),
            n("Mul", ["x32", "c"], ["hc"]),
            n("Cast", ["hc"], ["hc16"], to=F16),
            n("Mul", ["w", "hc16"], ["h"]),
            n("MatMul", ["h", "W"], ["y"]),
        ],
        [("x", F16, [2, 3, D])],
        [("y", F16, [2, 3, N])],
        {"c": np.array(0.8, np.float32), "w": rand(D, dtype=np.float16), "W": rand(D, N, dtype=np.float16)},
    )
    report, *_ = fold_checked(model, {"x": rand(2, 3, D, dtype=np.float16)}, tol=5e-3)
    assert report.norms[0].status == "folded"
    assert ops(model) == Counter({"MatMul": 1})


def test_narrowing_cast_is_kept_and_a_cast_constant_is_resolved():
    model = build(
        [
            n("Mul", ["x", "c"], ["hc"]),
            n("Cast", ["hc"], ["hc16"], to=F16),
            n("Cast", ["w32"], ["w"], to=F16),
            n("Mul", ["hc16", "w"], ["h"]),
            n("MatMul", ["h", "W"], ["y"]),
        ],
        [X],
        [("y", F16, [2, 3, N])],
        {"c": np.array(0.8, np.float32), "w32": rand(D), "W": rand(D, N, dtype=np.float16)},
    )
    report, *_ = fold_checked(model, x3(), tol=5e-3)
    assert report.norms[0].status == "folded"
    assert ops(model) == Counter({"Cast": 1, "MatMul": 1})


def test_bf16_weight_is_scaled_in_float64_and_cast_once():
    w, W = rand(D).astype(ml_dtypes.bfloat16), rand(D, N).astype(ml_dtypes.bfloat16)
    model = mul_matmul(rand(D))
    for name, array in (("s", w), ("W", W)):
        model.graph.initializers[name].const_value = ir.tensor(array, name=name)
    fold_model(model)
    folded = model.graph.initializers["W"].const_value.numpy()
    assert folded.dtype == ml_dtypes.bfloat16
    expected = w.astype(np.float64)[:, None] * W.astype(np.float64)
    np.testing.assert_array_equal(folded, expected.astype(ml_dtypes.bfloat16))


# ---- torch exports -------------------------------------------------------------------------------


class TaperNorm(nn.Module):
    """g·RMSNorm(h) + (1-g)·c·h·w̃; exported at g = 0 as the constant diagonal map."""

    def __init__(self, d, g=0.0):
        super().__init__()
        self.g = g
        self.c = nn.Parameter(torch.tensor(0.7))
        self.weight = nn.Parameter(torch.randn(d))
        self.weight_tilde = nn.Parameter(torch.randn(d))

    def forward(self, h):
        if self.g == 0:
            return h * self.c * self.weight_tilde
        rms = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.g * rms + (1 - self.g) * self.c * h * self.weight_tilde


class TaperLN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c = nn.Parameter(torch.tensor(0.7))
        self.weight_tilde = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, h):
        hc = h - h.mean(-1, keepdim=True)
        return hc * self.c * self.weight_tilde + self.bias


class Block(nn.Module):
    def __init__(self, norm, d=D):
        super().__init__()
        self.input_layernorm = norm
        self.q_proj, self.v_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=True)

    def forward(self, x):
        h = self.input_layernorm(x)
        return x + self.q_proj(h) * self.k_proj(h) + self.v_proj(h)


class TinyLM(nn.Module):
    """Tied embedding / lm_head around one block and a final norm."""

    def __init__(self, g=0.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layer = Block(TaperNorm(D, g))
        self.norm = TaperNorm(D, g)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        return self.lm_head(self.norm(self.layer(self.embed_tokens(ids))))


def export(module, args, path, dynamo):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"optimize": False} if dynamo == "unoptimized" else {} if dynamo else {"opset_version": 17}
        torch.onnx.export(module.eval(), args, str(path), dynamo=bool(dynamo), input_names=["x"], **kwargs)
    return str(path)


def fold_file_checked(tmp_path, src, feeds, tol=1e-5):
    dst = str(tmp_path / "folded.onnx")
    report = fold_onnx_file(src, dst)
    for a, b in zip(run(src, feeds), run(dst, feeds), strict=True):
        assert rel_err(a, b) <= tol
    return report, ir.load(dst)


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [True, False, "unoptimized"])
@pytest.mark.parametrize("norm", [TaperNorm, TaperLN])
def test_torch_block_exports(tmp_path, norm, dynamo):
    torch.manual_seed(0)
    x = torch.randn(2, 3, D)
    src = export(Block(norm(D)), (x,), tmp_path / "block.onnx", dynamo)
    report, folded = fold_file_checked(tmp_path, src, {"x": x.numpy()})
    (entry,) = report.norms
    assert entry.status == "folded" and len(entry.consumers) == 3
    assert (entry.name == "input_layernorm") if dynamo else entry.name.startswith("/input_layernorm/")
    counts = ops(folded)
    assert counts["Mul"] == 1  # q * k; nothing of the norm is left
    assert not {"ReduceMean", "Sub", "Cast", "Identity", "Transpose"} & set(counts)


@pytest.mark.slow
def test_torch_tied_lm(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 5))
    src = export(TinyLM(), (ids,), tmp_path / "lm.onnx", dynamo="unoptimized")
    report, _ = fold_file_checked(tmp_path, src, {"x": ids.numpy()})
    assert [e.name for e in report.norms] == ["layer.input_layernorm", "norm"]
    assert {e.status for e in report.norms} == {"folded"}
    assert report.norms[1].copied[0].startswith("lm_head.weight -> lm_head.weight.folded (also read by")
    table = [ir.load(path).graph.initializers["lm_head.weight"].const_value.tobytes() for path in (src, report.output)]
    assert table[0] == table[1]  # the embedding lookup still reads the original, tied table


@pytest.mark.slow
def test_tapered_layer_with_gate_not_zero_is_not_foldable(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 5))
    src = export(TinyLM(g=0.5), (ids,), tmp_path / "lm.onnx", dynamo=True)
    report, folded = fold_file_checked(tmp_path, src, {"x": ids.numpy()}, tol=0)
    assert [(e.name, e.status) for e in report.norms] == [
        ("layer.input_layernorm", "not_foldable"),
        ("norm", "not_foldable"),
    ]
    assert all("gate ≠ 0" in e.reason for e in report.norms)
    assert len(folded.graph) == report.nodes_before


@pytest.mark.slow
def test_ordinary_rms_norm_weight_is_left_alone(tmp_path):
    # nn.RMSNorm's γ is a Mul by a constant vector, but its module computes statistics: not a taper norm.
    module = nn.Sequential(nn.RMSNorm(D), nn.Linear(D, N, bias=False))
    nn.init.normal_(module[0].weight)
    src = export(module, (torch.randn(2, 3, D),), tmp_path / "rms.onnx", dynamo=True)
    report, folded = fold_file_checked(tmp_path, src, {"x": rand(2, 3, D)}, tol=0)
    assert report.norms == [] and len(folded.graph) == report.nodes_before


# ---- files and errors ----------------------------------------------------------------------------


@pytest.mark.slow
def test_external_data_round_trip_and_in_place_refold(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32)
    src = export(Block(TaperNorm(32), d=32), (x,), tmp_path / "block.onnx", True)
    dst = tmp_path / "out" / "folded.onnx"
    fold_onnx_file(src, dst, report_path=tmp_path / "report.json")
    assert (tmp_path / "out" / "folded.onnx.data").is_file()
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["folded"] == 1
    assert any(isinstance(v.const_value, ir.ExternalTensor) for v in ir.load(dst).graph.initializers.values())
    expected = run(str(dst), {"x": x.numpy()})
    report = fold_onnx_file(dst, dst)  # reads its own .data lazily while writing the new one
    assert report.norms == []
    np.testing.assert_array_equal(run(str(dst), {"x": x.numpy()})[0], expected[0])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["folded.onnx", "folded.onnx.data"]


def small_model_file(path):
    model = mul_matmul(rand(D), cols=64)
    ir.save(model, path, external_data=path.name + ".data")
    return path


def bad_inputs(tmp_path):
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07garbage" * 50)
    no_data = small_model_file(tmp_path / "nodata.onnx")
    (tmp_path / "nodata.onnx.data").unlink()
    good = small_model_file(tmp_path / "good.onnx")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    return {
        "missing": (tmp_path / "missing.onnx", tmp_path / "o1.onnx", "no such file"),
        "corrupt": (corrupt, tmp_path / "o2.onnx", "not a readable ONNX model"),
        "missing data": (no_data, tmp_path / "o3.onnx", "'nodata.onnx.data' (initializer 'W') is missing"),
        "unwritable": (good, blocker / "o4.onnx", "cannot create output directory"),
    }


@pytest.mark.parametrize("case", ["missing", "corrupt", "missing data", "unwritable"])
def test_bad_input_raises_one_line_and_writes_nothing(tmp_path, case, cli):
    src, dst, message = bad_inputs(tmp_path)[case]
    with pytest.raises(TaperfoldError) as info:
        fold_onnx_file(src, dst)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not dst.exists() and not dst.with_name(dst.name + ".data").exists()
    result = cli("fold", src, "-o", dst)
    assert result.exit_code == 2 and message in result.stderr and result.stderr.count("\n") == 1
    assert not dst.exists()


def test_cli_json_report_and_table(tmp_path, cli):
    src = small_model_file(tmp_path / "m.onnx")
    result = cli("fold", src, "-o", tmp_path / "f.onnx", "--json", "--report", tmp_path / "r.json")
    printed = json.loads(result.stdout)
    assert result.exit_code == 0 and printed == json.loads((tmp_path / "r.json").read_text())
    assert printed["summary"]["folded"] == 1 and printed["norms"][0]["consumers"] == ["y"]
    result = cli("fold", src, "-o", tmp_path / "f.onnx")
    assert result.exit_code == 0 and "1 of 1 norms folded" in result.stdout
