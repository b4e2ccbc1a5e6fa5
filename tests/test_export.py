"""`taperfold export` end to end: folded ONNX equals unfolded, has exactly a norm-free graph, refuses what it must."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from conftest import one_line

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.exportdir import GROWING
from taperfold.fsutil import sha256_file
from taperfold.models import build_model, preset_config
from taperfold.nn import TaperLN
from taperfold.passes import FuseProjectionsPass
from taperfold.tracing import export_to_ir, trace_lengths
from taperfold.train import TrainOptions, train
from taperfold.variants import fold_in_torch

# a plain norm's op: fused at opset 23 by the exporter, below by taperfold (passes/fuse_norm.py), or decomposed
NORM_OPS = {"rms": ("RMSNormalization", "SimplifiedLayerNormalization", "Pow"), "ln": ("LayerNormalization",)}


def random_checkpoint(tmp_path, arch, taper, gate=0.0, seed=0):
    """Random weights, with random calibrated c, γ̃ and β so that no tool could skip a multiply by one."""
    torch.manual_seed(seed)
    cfg = preset_config("tiny", arch=arch, taper=taper, n_layers=2, max_seq_len=32)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for norm in model.tapered_norms().values():
            norm.weight.uniform_(0.5, 1.5)
            norm.weight_tilde.uniform_(0.5, 1.5)
            norm.c.uniform_(0.05, 0.5)
            norm.calibrated.fill_(True)
            if isinstance(norm, TaperLN):
                norm.bias.uniform_(-0.3, 0.3)
    model.set_gate(gate)
    return save_checkpoint(checkpoint_from_model(model, 0), tmp_path / f"{arch}-{taper}.safetensors")


@pytest.fixture(scope="module")
def trained_gpt2_all(tmp_path_factory):
    cfg = preset_config("tiny", arch="gpt2", taper="all", n_layers=2, max_seq_len=32)
    result = train(cfg, TrainOptions(steps=30, batch_size=4, eval_batches=2))
    return save_checkpoint(result.checkpoint, tmp_path_factory.mktemp("gpt2") / "gpt2-all.pt")


def ort_logits(path, ids):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input_ids": ids})[0]


def op_counts(path):
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def check_export(out, ckpt_path, arch, taper, tol=1e-5):
    ids = np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int64)
    folded, unfolded = ort_logits(out / "model.onnx", ids), ort_logits(out / "unfolded.onnx", ids)
    rel = np.abs(folded - unfolded).max() / np.abs(unfolded).max()
    assert rel <= tol, rel
    assert (folded.argmax(-1) == unfolded.argmax(-1)).all()
    # the folded graph is exactly the norm-free architecture's graph
    from taperfold.checkpoint import load_checkpoint

    model = load_checkpoint(ckpt_path).build(gate=0.0)
    export = json.loads((out / "manifest.json").read_text())["export"]
    norm_free = export_to_ir(fold_in_torch(model), ExportOptions(logits=export["logits"]))
    if export["fuse_projections"]:  # q/k/v and gate/up fused in both
        FuseProjectionsPass()(norm_free)
    expected = Counter(n.op_type for n in norm_free.graph)
    assert op_counts(out / "model.onnx") == expected
    # Internal-Taper keeps exactly its final norm; All-Taper keeps none
    report = json.loads((out / "manifest.json").read_text())["artifacts"]["folded"]["reports"]["fold"]
    kept = [n["name"] for n in report["norms"] if n["status"] not in ("folded", "real_norm")]
    real = [n["name"] for n in report["norms"] if n["status"] == "real_norm"]
    tapered = [n for n in report["norms"] if n["status"] == "folded"]
    assert len(tapered) == 2 * model.cfg.n_layers + (taper == "all")
    final = "model.norm" if arch == "llama" else "transformer.ln_f"
    assert kept == []  # plain norms (the kept final RMSNorm / LayerNorm) are not fold candidates
    assert real == ([] if taper == "all" else [final])  # they are named as real norms, left as they are
    kind = "rms" if arch == "llama" else "ln"
    final_ops = sum(op_counts(out / "model.onnx")[op] for op in NORM_OPS[kind])
    assert final_ops == (0 if taper == "all" else 1), final
    return folded


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("taper", ["internal", "all"])
def test_random_weights_fold_exactly(tmp_path, arch, taper):
    ckpt = random_checkpoint(tmp_path, arch, taper)
    out = export_checkpoint(ckpt, tmp_path / "out", ExportOptions(baseline=False)).out_dir
    check_export(out, ckpt, arch, taper)


def test_trained_checkpoint_folds_exactly(tiny_export, tiny_checkpoint):
    check_export(Path(tiny_export), tiny_checkpoint, "llama", "internal")


def test_trained_all_taper_gpt2_folds_into_untied_head(tmp_path, trained_gpt2_all):
    out = export_checkpoint(trained_gpt2_all, tmp_path / "out", ExportOptions(logits="all", baseline=False)).out_dir
    check_export(out, trained_gpt2_all, "gpt2", "all")
    graph = onnx.load(str(out / "model.onnx")).graph
    tables = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    wte = torch.load(trained_gpt2_all, weights_only=True)["state_dict"]["transformer.wte.weight"].numpy()
    gathers = [
        n.input[0]
        for n in graph.node
        if n.op_type == "Gather" and n.input[0] in tables and tables[n.input[0]].shape == wte.shape
    ]
    assert gathers and np.array_equal(tables[gathers[0]], wte)  # the token table is untouched


def test_manifest(tiny_export, tiny_checkpoint):
    manifest = json.loads((Path(tiny_export) / "manifest.json").read_text())
    assert manifest["checkpoint"]["sha256"] == sha256_file(tiny_checkpoint)
    assert manifest["gate"] == 0.0 and manifest["forced_gate0"] is False
    assert {"taperfold", "torch", "onnx"} <= set(manifest["versions"])
    assert set(manifest["artifacts"]) == {
        "baseline",
        "unfolded",
        "folded",
        "baseline.decoder",
        "unfolded.decoder",
        "folded.decoder",
        "baseline-decomposed",
        "baseline-decomposed.decoder",
    }
    for art in manifest["artifacts"].values():
        assert (Path(tiny_export) / art["path"]).stat().st_size == art["bytes"]
    assert (
        manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"] == 2 * manifest["config"]["n_layers"]
    )  # Internal-Taper
    assert set(manifest["timings"]) == {"torch_export_s", "passes_s", "write_s", "total_s"}


def test_the_baseline_graphs_are_made_from_the_unfolded_trace_with_real_norms(tiny_export):
    # one trace per graph kind: the baseline differs from the unfolded model in its norms only (verify holds it to the
    # torch baseline: tests/test_verify.py); every tapered norm is a real norm again, named as the unfolded graph's
    from taperfold.passes.detect import detect_norms

    artifacts = json.loads((Path(tiny_export) / "manifest.json").read_text())["artifacts"]
    for graph, wrapper in (("", ""), (".decoder", "model.")):  # the decoder's graph names modules inside its wrapper
        assert artifacts[f"baseline{graph}"]["built_from"] == f"unfolded{graph}"
        assert artifacts[f"baseline-decomposed{graph}"]["built_from"] == f"unfolded{graph}"
        folded = {n["name"] for n in artifacts[f"folded{graph}"]["reports"]["fold"]["norms"]}
        analysis = detect_norms(ir.load(Path(tiny_export) / artifacts[f"baseline{graph}"]["path"]))
        assert not analysis.candidates and not analysis.gate_not_zero
        assert {norm.name.removeprefix(wrapper) for norm in analysis.real_norms} == folded  # the final norm too


def test_gate_not_zero_is_refused_without_writing(cli, tmp_path):
    ckpt = random_checkpoint(tmp_path, "llama", "internal", gate=0.25)
    out = tmp_path / "out"
    result = cli("export", ckpt, "-o", out)
    assert result.exit_code == 2 and "gate is 0.25" in result.stderr and "--force-gate0" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


def test_force_gate0(cli, tmp_path):
    ckpt = random_checkpoint(tmp_path, "llama", "internal", gate=0.25)
    result = cli("export", ckpt, "-o", tmp_path / "out", "--force-gate0", "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["forced_gate0"] is True and manifest["gate"] == 0.25


def test_failed_export_leaves_nothing(monkeypatch, tmp_path):
    import taperfold.passes

    ckpt = random_checkpoint(tmp_path, "llama", "internal")

    def broken(self, model):  # fails after unfolded.onnx was staged in the export's folder
        raise RuntimeError("simulated crash in a pass")

    monkeypatch.setattr(taperfold.passes.FoldConstantsPass, "call", broken)
    with pytest.raises(RuntimeError):
        export_checkpoint(ckpt, tmp_path / "out", ExportOptions(baseline=False))
    assert not (tmp_path / "out").exists()  # the directory appears only whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_fp16_and_kv_cache(tmp_path):
    ckpt = random_checkpoint(tmp_path, "llama", "internal")
    out = export_checkpoint(ckpt, tmp_path / "out", ExportOptions(dtype="fp16", decoders=(GROWING,))).out_dir
    ids = np.random.default_rng(1).integers(0, 256, (1, 9)).astype(np.int64)
    folded, unfolded = ort_logits(out / "model.onnx", ids), ort_logits(out / "unfolded.onnx", ids)
    assert folded.dtype == np.float16
    assert np.abs(folded.astype(np.float32) - unfolded).max() / np.abs(unfolded).max() < 1e-2
    init = {i.name: i for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer}
    weights = [i for i in init.values() if len(i.dims) == 2 and min(i.dims) >= 64]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"baseline.decoder", "unfolded.decoder", "folded.decoder"} <= set(manifest["artifacts"])
    assert (
        manifest["artifacts"]["folded.decoder"]["reports"]["fold"]["summary"]["folded"]
        == 2 * manifest["config"]["n_layers"]
    )
    assert manifest["artifacts"]["baseline"]["built_from"] is None  # traced: a float16 graph's norms are not rewritten
    session = ort.InferenceSession(str(out / "model.decoder.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names[:3] == ["input_ids", "past_key_values.0.key", "past_key_values.0.value"]


def test_bad_inputs(cli, tmp_path):
    result = cli("export", tmp_path / "missing.pt")
    assert result.exit_code == 2 and "no such file" in result.stderr
    ckpt = random_checkpoint(tmp_path, "llama", "internal")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    result = cli("export", ckpt, "-o", blocked)
    assert result.exit_code == 2 and "is a file" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_norm_epsilon_of_1e_8_survives_the_exporters_optimizer(tmp_path):
    # onnxscript's no-op rules take x + 1e-8 for x. Helium's RMSNorm has epsilon 1e-8: without it, a padding token's
    # all-zero embedding row becomes NaN in the baseline graph.
    transformers = pytest.importorskip("transformers")
    from hf_models import RMS

    torch.manual_seed(0)
    config = transformers.HeliumConfig(num_key_value_heads=2, head_dim=8, **RMS)  # pad_token_id 0: a zero row
    assert config.rms_norm_eps == 1e-8
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "plain")
    out = export_checkpoint(tmp_path / "plain", tmp_path / "out", ExportOptions(fuse_projections=False)).out_dir
    ids = torch.tensor([[0, 5, 9, 0, 17, 3, 0, 8]])
    with torch.no_grad():
        expected = model(ids).logits[:, -1].numpy()
    graph = onnx.load(out / "baseline.onnx")
    epsilons = [
        a.f for n in graph.graph.node if n.op_type == "RMSNormalization" for a in n.attribute if a.name == "epsilon"
    ]
    assert epsilons and all(e == pytest.approx(1e-8, rel=1e-6) for e in epsilons)
    got = ort.InferenceSession(str(out / "baseline.onnx")).run(None, {"input_ids": ids.numpy()})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# ---- context ------------------------------------------------------------------------------------------------


def test_export_needs_a_context_it_can_trace_and_a_short_one_exports(tmp_path, cli):
    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
    from taperfold.models import random_gate0_model

    for context in (1, 4):
        model = random_gate0_model("tiny", "gpt2", n_layers=1, d_model=32, n_heads=2, d_ff=64, max_seq_len=context)
        save_checkpoint(checkpoint_from_model(model, step=0), tmp_path / f"c{context}.pt")
    one_line(cli("export", tmp_path / "c1.pt", "-o", tmp_path / "e1"), "context is 1 token", "needs a context of 4")
    assert not (tmp_path / "e1").exists()
    assert cli("export", tmp_path / "c4.pt", "-o", tmp_path / "e4", "--kv-cache").exit_code == 0
    r = cli("verify", tmp_path / "e4", "--json")
    assert r.exit_code == 0, r.stderr
    decoders = [p for p in json.loads(r.stdout)["pairs"] if p["candidate"].endswith(".decoder")]
    # a 4-token context holds a 2-token prompt and 2 KV-cached steps (verify.inputs.decode_steps)
    assert decoders and all(p["status"] == "pass" for p in decoders)
    assert {i["input"] for i in decoders[0]["per_input"]} == {
        "decode 1x2+2 prompt",
        "decode 1x2+2 step 1",
        "decode 1x2+2 step 2",
    }


class _BranchesOnLength(torch.nn.Module):
    """A model whose forward branches on the traced sequence length, as chunked linear attention's padding does:
    torch.export fixes the length to the traced one instead of keeping it dynamic."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg = model, model.cfg

    def forward(self, input_ids, logits="last"):
        out = self.model(input_ids, logits=logits)
        return out * 2 if input_ids.shape[1] == trace_lengths(self.cfg.max_seq_len)[0] else out


def test_a_graph_traced_for_one_sequence_length_is_refused_in_one_line():
    model = build_model(preset_config("tiny", n_layers=1)).eval()
    with pytest.raises(TaperfoldError) as refused:
        export_to_ir(_BranchesOnLength(model), ExportOptions())
    message = str(refused.value)
    assert "\n" not in message and "fixed the sequence length of 'input_ids' to" in message
    assert "the graph would take that length only" in message
