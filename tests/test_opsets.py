"""Opsets per graph and target, the fused baseline and its decomposed variant, and verify of decoders and of
shapes far from the traced one: opset 20 and 23 exports of both families, end to end on the CPU."""

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from conftest import run_cli

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.export import ExportOptions, export_checkpoint
from taperfold.exportdir import ALL_VARIANTS, GROWING, PREFILL, STATIC
from taperfold.manifest import read_manifest
from taperfold.models import random_gate0_model
from taperfold.norms.rms import HandWrittenRMSNorm
from taperfold.opsets import TABLE, TRT_MIN_VERSION, choose_opset
from taperfold.passes.fuse_norm import match_rms_norm
from taperfold.tracing import TRACE_PAST, TRACE_SHAPE
from taperfold.variants import build_variants
from taperfold.verify import decode_cases, random_inputs, verify_export

DOCS = Path(__file__).resolve().parents[1] / "docs" / "opsets.md"
# small enough that one torch.onnx export takes seconds; random c, γ̃ (never ones)
SMALL = dict(n_layers=1, d_model=32, n_heads=2, d_ff=64, vocab_size=64, max_seq_len=32)


def small_checkpoint(folder: Path, arch: str) -> Path:
    model = random_gate0_model("tiny", arch, **SMALL)
    with torch.no_grad():  # random γ in the plain norms too (the baseline's), so a dropped weight would show
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "ln_f.weight")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return save_checkpoint(checkpoint_from_model(model, step=0), folder / f"{arch}.pt")


def export(tmp_path_factory, arch: str, **options) -> Path:
    folder = tmp_path_factory.mktemp(f"{arch}-export")
    return export_checkpoint(small_checkpoint(folder, arch), folder / "out", ExportOptions(**options)).out_dir


@pytest.fixture(scope="module")
def llama_table(tmp_path_factory):
    """The default: ONNX Runtime target, opsets from the table (23 for prefill and decoders)."""
    return export(tmp_path_factory, "llama", decoders=(GROWING,))


@pytest.fixture(scope="module")
def llama_20(tmp_path_factory):
    """`taperfold export --opset 20` through the CLI: the override."""
    folder = tmp_path_factory.mktemp("llama-20")
    ckpt = small_checkpoint(folder, "llama")
    result = run_cli("export", ckpt, "-o", folder / "out", "--opset", "20", "--kv-cache", "--json")
    assert result.exit_code == 0, result.stderr
    return folder / "out"


@pytest.fixture(scope="module")
def gpt2_23(tmp_path_factory):
    return export(tmp_path_factory, "gpt2", opset=23, decoders=(GROWING,))


@pytest.fixture(scope="module")
def gpt2_20(tmp_path_factory):
    return export(tmp_path_factory, "gpt2", opset=20)


@pytest.fixture(scope="module")
def llama_trt(tmp_path_factory):
    return export(tmp_path_factory, "llama", target="trt", decoders=(GROWING,))


def graph_opset(path: Path) -> int:
    return next(o.version for o in onnx.load(str(path), load_external_data=False).opset_import if o.domain == "")


def op_types(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


# ---- the table --------------------------------------------------------------------------------------


def test_every_table_value_cites_a_section_of_docs_opsets():
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in DOCS.read_text().splitlines()
        if line.startswith("#")
    }
    for (target, graph), (opset, reason) in TABLE.items():
        cited = re.match(r"docs/opsets\.md#([a-z0-9-]+)", reason)
        assert cited and cited.group(1) in anchors, (target, graph, reason)
        assert 18 <= opset <= 23


def test_choose_opset_table_override_and_bad_values():
    assert choose_opset("ort", "prefill").to_dict() == {
        "opset": TABLE[("ort", "prefill")][0],
        "opset_source": "table",
        "opset_reason": TABLE[("ort", "prefill")][1],
    }
    assert choose_opset("trt", "decoder", 21).to_dict() == {
        "opset": 21,
        "opset_source": "override",
        "opset_reason": "--opset 21",
    }
    with pytest.raises(TaperfoldError, match="--target must be one of ort, trt"):
        choose_opset("tflite", "prefill")
    with pytest.raises(TaperfoldError, match="--opset must be between 18 and 23, got 24"):
        choose_opset("ort", "prefill", 24)


def test_ort_fusions_take_the_opset_their_rules_match_unless_overridden():
    from taperfold.opsets import ORT_FUSIONS_OPSET, ORT_FUSIONS_REASON

    for graph in ("prefill", "decoder"):
        assert choose_opset("ort", graph, ort_fusions=True).to_dict() == {
            "opset": ORT_FUSIONS_OPSET,
            "opset_source": "table",
            "opset_reason": ORT_FUSIONS_REASON,
        }
        assert choose_opset("ort", graph, 23, ort_fusions=True).opset == 23
        assert choose_opset("ort", graph).opset == TABLE[("ort", graph)][0] != ORT_FUSIONS_OPSET


def test_manifest_records_the_table_choice_per_artifact(llama_table):
    manifest = read_manifest(llama_table)
    assert manifest.to_json()["export"]["target"] == "ort" and manifest.to_json()["export"]["opset"] is None
    assert set(manifest.to_json()["artifacts"]) == {f"{v}{d}" for v in ALL_VARIANTS for d in ("", ".decoder")}
    assert not [p.name for p in llama_table.iterdir() if p.name.startswith(".")]  # the staged graphs are gone
    for key, entry in manifest.to_json()["artifacts"].items():
        graph = "decoder" if key.endswith(".decoder") else "prefill"
        opset, reason = TABLE[("ort", graph)]
        assert (entry["opset"], entry["opset_source"], entry["opset_reason"]) == (opset, "table", reason), key
        assert graph_opset(llama_table / entry["path"]) == opset, key


def test_a_hugging_face_rope_stays_plain_ops_at_the_tables_opset_traced_once_per_graph(tmp_path):
    """transformers' RoPE, which onnxscript's opset-23 fusion would make a RotaryEmbedding that ONNX Runtime runs on
    the traced shape alone, stays as traced: every graph at the table's opset, one trace each, and verify passes on
    shapes far from the traced one."""
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    source = save_hf_directory(tapered_tiny_model("llama"), tmp_path / "llama")
    stages: list[str] = []
    options = ExportOptions(decoders=(GROWING, STATIC))
    out = export_checkpoint(source, tmp_path / "out", options, on_stage=stages.append).out_dir
    traces = [stage for stage in stages if stage.startswith("exporting ") and "(opset" in stage]
    assert len(traces) == 3, stages  # the unfolded prefill, growing and static graphs: the baseline is made from them
    artifacts = read_manifest(out).to_json()["artifacts"]
    assert {key.partition(".")[2] for key in artifacts} == {"", "decoder", "static"}
    for key, entry in artifacts.items():
        opset, reason = TABLE[("ort", "prefill" if entry["graph"] == PREFILL else "decoder")]
        assert (entry["opset"], entry["opset_reason"]) == (opset, reason), key
        ops = {node.op_type for node in onnx.load(out / entry["path"]).graph.node}
        assert "RotaryEmbedding" not in ops and "Attention" in ops, key
    assert verify_export(out).passed


def test_manifest_records_the_override(llama_20):
    manifest = read_manifest(llama_20)
    assert manifest.to_json()["export"]["opset"] == 20
    for key, entry in manifest.to_json()["artifacts"].items():
        assert (entry["opset"], entry["opset_source"], entry["opset_reason"]) == (20, "override", "--opset 20"), key
        assert graph_opset(llama_20 / entry["path"]) == 20


# ---- the strongest baseline ----------------------------------------------------------------------------


def rms_patterns(path: Path) -> int:
    model = ir.load(path)
    return sum(1 for node in model.graph if match_rms_norm(node) is not None)


@pytest.mark.parametrize("which", ["opset 20 prefill", "opset 20 decoder", "opset 23 prefill"])
def test_fused_baseline_has_no_decomposed_rms_norm_left(which, llama_20, llama_table):
    directory, graph = {
        "opset 20 prefill": (llama_20, PREFILL),
        "opset 20 decoder": (llama_20, GROWING),
        "opset 23 prefill": (llama_table, PREFILL),
    }[which]
    manifest = read_manifest(directory)
    norms = 2 * SMALL["n_layers"] + 1
    fused, plain = manifest.artifact("baseline", graph), manifest.artifact("baseline-decomposed", graph)
    assert rms_patterns(fused) == 0
    assert rms_patterns(plain) == norms  # the decomposed variant keeps every norm as plain ops
    op = "RMSNormalization" if graph_opset(fused) >= 23 else "SimplifiedLayerNormalization"
    assert op_types(fused)[op] == norms
    assert manifest.find("baseline", graph).details.norm_ops == {op: norms}
    # the tapered graphs' plain final norm gets the same fused form (folding is all that differs)
    assert op_types(manifest.artifact("folded", graph))[op] == 1


def test_layernorm_family_has_no_decomposed_variant(gpt2_20):
    manifest = read_manifest(gpt2_20)
    assert not manifest.has_artifact("baseline-decomposed")
    assert op_types(manifest.artifact("baseline"))["LayerNormalization"] == 2 * SMALL["n_layers"] + 1


def test_torch_variants_baseline_is_fused_and_decomposed_is_hand_written():
    model = random_gate0_model("tiny", "llama", **SMALL)
    variants = build_variants(checkpoint_from_model(model, step=0), ["baseline", "baseline-decomposed"], torch.float32)
    kinds = {name: {type(m).__name__ for m in v.modules()} for name, v in variants.items()}
    assert "RMSNorm" in kinds["baseline"] and "HandWrittenRMSNorm" not in kinds["baseline"]
    assert "HandWrittenRMSNorm" in kinds["baseline-decomposed"] and "RMSNorm" not in kinds["baseline-decomposed"]
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            variants["baseline-decomposed"](ids), variants["baseline"](ids), rtol=1e-5, atol=1e-6
        )
    assert isinstance(variants["baseline-decomposed"].model.norm, HandWrittenRMSNorm)


# ---- verify: other shapes, decoders, every variant -----------------------------------------------------


def test_verify_runs_shapes_far_from_the_traced_one():
    for batch in random_inputs(SMALL["vocab_size"], SMALL["max_seq_len"]):
        assert batch.ids.shape != TRACE_SHAPE
    shapes = {b.ids.shape for b in random_inputs(SMALL["vocab_size"], SMALL["max_seq_len"])}
    assert {1, SMALL["max_seq_len"]} <= {s for _, s in shapes} and {1, 4} <= {b for b, _ in shapes}
    cases = decode_cases(SMALL["vocab_size"], SMALL["max_seq_len"])
    assert len(cases) == 2 and all(c.ids.shape[0] != TRACE_SHAPE[0] for c in cases)
    assert max(c.ids.shape[1] for c in cases) == SMALL["max_seq_len"] > TRACE_SHAPE[1] + TRACE_PAST


def judged(report) -> dict:
    return {p.name: p for p in report.pairs}


@pytest.mark.parametrize("name", ["llama_table", "llama_20", "gpt2_23", "gpt2_20"])
def test_verify_passes_every_variant_and_decoder(name, request):
    directory = request.getfixturevalue(name)
    manifest = read_manifest(directory)
    report = verify_export(directory, threads=1)
    pairs = judged(report)
    assert report.passed, report.failure_message()
    expected = {"checkpoint -> unfolded", "checkpoint -> folded", "unfolded -> folded", "baseline (torch) -> baseline"}
    if manifest.has_artifact("baseline-decomposed"):
        expected |= {"baseline (torch) -> baseline-decomposed", "baseline-decomposed -> baseline"}
    if manifest.to_json()["export"]["kv_cache"]:
        expected |= {
            f"{'baseline (torch)' if v.startswith('baseline') else 'checkpoint'} -> {v}.decoder"
            for v in ALL_VARIANTS
            if manifest.has_artifact(v, GROWING)
        }
    assert set(pairs) == expected
    assert all(p.status == "pass" for p in pairs.values())
    decoded = [p for p in pairs.values() if p.candidate.endswith(".decoder")]
    for pair in decoded:  # the prompt (empty past) and every KV-cached step of both cases were compared
        assert len(pair.per_input) == 2 * 5 and pair.metrics.rows > 0
    fuse = pairs.get("baseline-decomposed -> baseline")
    if fuse is not None:  # the fused norm matches the plain ops within the fp32 fold bound
        assert fuse.tolerance.rtol == 1e-5 and fuse.metrics.max_rel <= 1e-5


def test_verify_fails_a_decoder_that_computes_something_else(llama_table, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_table, broken)
    shutil.copy(broken / "baseline.decoder.onnx", broken / "model.decoder.onnx")  # plain norms, not the fold
    report = verify_export(broken, threads=1)
    pairs = judged(report)
    assert pairs["checkpoint -> folded.decoder"].status == "fail"
    assert pairs["checkpoint -> unfolded.decoder"].status == "pass"
    assert "folded.decoder" in report.failure_message()


# ---- TensorRT target -----------------------------------------------------------------------------------


def test_trt_target_uses_only_ops_the_parser_takes(llama_trt):
    manifest = read_manifest(llama_trt)
    assert manifest.to_json()["export"]["target"] == "trt"
    assert TRT_MIN_VERSION == (10, 15)  # what the table's trt rows assume (RMSNormalization)
    for key, entry in manifest.to_json()["artifacts"].items():
        graph = onnx.load(str(llama_trt / entry["path"]), load_external_data=False)
        opset = graph_opset(llama_trt / entry["path"])
        for node in graph.graph.node:
            assert node.domain in ("", "ai.onnx"), (key, node.op_type, node.domain)  # no ONNX Runtime ops
            assert onnx.defs.has(node.op_type, node.domain), (key, node.op_type)  # standard ONNX at that opset
            assert onnx.defs.get_schema(node.op_type, opset, node.domain).since_version <= opset
            if node.op_type == "Attention":  # the parser takes no past_key / past_value, no present outputs
                assert len([i for i in node.input[4:] if i]) == 0 and len(node.output) == 1, key
        ops = op_types(llama_trt / entry["path"])
        assert ops["SimplifiedLayerNormalization"] == 0
        if key.endswith(".decoder"):
            assert opset == TABLE[("trt", "decoder")][0] and ops["Attention"] == 0


# ---- bench reports the decomposed baseline apart ------------------------------------------------------


def test_bench_reports_the_decomposed_baseline_against_baseline(llama_table, tmp_path):
    out = tmp_path / "bench.json"
    result = run_cli(
        "bench",
        llama_table,
        "--engine",
        "ort",
        "--variants",
        "baseline,baseline-decomposed,folded",
        "--batch",
        "1",
        "--seq",
        "8",
        "--warmup",
        "0",
        "--iters",
        "2",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--json",
        out,
    )
    assert result.exit_code == 0, result.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"baseline", "baseline-decomposed", "folded"}
    base = rows["baseline"]["tokens_per_s"]
    assert rows["baseline-decomposed"]["speedup_vs_baseline"] == pytest.approx(
        rows["baseline-decomposed"]["tokens_per_s"] / base
    )
    assert rows["baseline"]["speedup_vs_baseline"] == 1.0
    assert np.isfinite(rows["folded"]["speedup_vs_baseline"])
