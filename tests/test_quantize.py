"""Weight quantization after the fold (`export --quantize`): int4 and int8 MatMulNBits graphs of every variant and
graph, made by ONNX Runtime's quantizer with onnxruntime-genai's builder's settings; verify holds each to the fp32
checkpoint by top-1 agreement and KL with bounds per precision; bench times them (--precision); --genai writes
quantized folders. Refusals come before the export's work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import one_line, run_cli

from taperfold.compare import QUANTIZED_TOLERANCES, Metrics, default_tolerance, tolerance_help, violations
from taperfold.errors import TaperfoldError
from taperfold.exportdir import GROWING, PREFILL
from taperfold.manifest import read_manifest
from taperfold.quantize import Quantization, parse_precisions

pytestmark = pytest.mark.slow

PRECISIONS = {"int4": 4, "int8": 8}


@pytest.fixture(scope="module")
def quantized_export(tmp_path_factory, tiny_checkpoint):
    """tiny_checkpoint exported as a user does it: `--genai --quantize int4,int8` (the growing decoders come with
    --genai). Read-only: copy it before changing a file."""
    pytest.importorskip(
        "onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'taperfold[genai]')"
    )
    out = tmp_path_factory.mktemp("quantized") / "out"
    result = run_cli("export", tiny_checkpoint, "-o", out, "--genai", "--quantize", "int4,int8")
    assert result.exit_code == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def quantized_verify(quantized_export):
    from taperfold.verify import verify_export

    return verify_export(quantized_export, threads=1)


def _nodes(path) -> list:
    return list(onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_export_quantizes_every_graph_of_baseline_unfolded_and_folded(quantized_export, precision):
    manifest = read_manifest(quantized_export)
    for variant in ("baseline", "unfolded", "folded"):
        for graph in (PREFILL, GROWING):
            source = manifest.find(variant, graph)
            record = manifest.find(variant, graph, precision=precision)
            assert record is not None and record.built_from == source.key and record.kind == "onnx"
            report = record.reports["quantize"]
            nodes = _nodes(manifest.file(record))
            quantized = [n for n in nodes if n.op_type == "MatMulNBits"]
            attrs = [{a.name: a.i for a in n.attribute} for n in quantized]
            assert len(quantized) == report["matmuls_quantized"] > 0
            assert {(a["bits"], a["block_size"], a["accuracy_level"]) for a in attrs} == {
                (PRECISIONS[precision], 32, 4)
            }
            # every MatMul or Gemm of the fp32 graph with a constant weight became one; the head reads the tied
            # embedding through a Transpose, so it stays float
            source_proto = onnx.load(str(manifest.file(source)), load_external_data=False)
            weights = {t.name for t in source_proto.graph.initializer}
            constant = [n for n in source_proto.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
            assert len(constant) == len(quantized)
            assert report["matmuls_kept"] == sum(n.op_type == "MatMul" for n in nodes)
            # int4 packs two weights a byte; both are far smaller than the float32 weights they replace
            assert record.external_data_bytes < source.external_data_bytes * (0.5 if precision == "int4" else 0.6)


def test_verify_judges_every_quantized_artifact_against_the_checkpoint(quantized_verify):
    report = quantized_verify
    quantized = [p for p in report.pairs if any(f".{precision}" in p.candidate for precision in PRECISIONS)]
    # 3 variants x 2 graphs x 2 precisions of ONNX graphs, and the genai folders of folded and baseline
    assert len(quantized) == 3 * 2 * 2 + 2 * 2
    for pair in quantized:
        precision = "int4" if "int4" in pair.candidate else "int8"
        assert pair.tolerance == QUANTIZED_TOLERANCES[precision] and pair.tolerance.rtol is None
        assert pair.status == "pass", (pair.candidate, pair.violations)
        assert pair.metrics is not None and pair.metrics.kl > 0  # quantization did move the logits
    assert report.passed


def test_fewer_bits_cost_more_and_the_fold_costs_nothing_measurable(quantized_verify):
    """int8 sits closer to the checkpoint than int4 for every variant; quantizing the folded weights (c·γ̃ in their
    rows) stays within a factor of 2 in KL of quantizing the unfolded ones, on this model."""
    kl = {p.candidate: p.metrics.kl for p in quantized_verify.pairs if p.metrics is not None}
    for variant in ("baseline", "unfolded", "folded"):
        for graph in ("", ".decoder"):
            assert kl[f"{variant}{graph}.int8"] < kl[f"{variant}{graph}.int4"]
    for graph in ("", ".decoder"):
        ratio = kl[f"folded{graph}.int4"] / kl[f"unfolded{graph}.int4"]
        assert 0.5 < ratio < 2, ratio


def test_on_a_text_verify_holds_the_quantized_decoders_to_the_checkpoints_perplexity(quantized_export, tmp_path):
    """600 bytes of text: each decoder (traced and genai's) decodes the last half of every window, so its pair scores
    300 tokens (above the bound's minimum) and is held to its precision's perplexity bound; a bound just under what
    the quantization cost fails that pair for its perplexity."""
    from taperfold.compare import MIN_SCORED_TOKENS
    from taperfold.verify import verify_export

    text = tmp_path / "held-out.txt"
    text.write_bytes((Path(__file__).read_bytes() * 2)[:600])
    report = verify_export(quantized_export, threads=1, text=text)
    decoders = [
        p for p in report.pairs if ".decoder" in p.candidate and p.tolerance is not None and p.tolerance.rtol is None
    ]
    assert {p.candidate for p in decoders} >= {"folded.decoder.int4", "folded.decoder.int4.genai"}
    for pair in decoders:
        assert pair.metrics.scored == 4 * 64 + 44 >= MIN_SCORED_TOKENS, pair.candidate
        assert pair.status == "pass", (pair.candidate, pair.violations)
        precision = "int4" if "int4" in pair.candidate else "int8"
        assert pair.tolerance.max_ppl_ratio == QUANTIZED_TOLERANCES[precision].max_ppl_ratio
        tighter = pair.tolerance.override(max_ppl_ratio=pair.metrics.ppl_ratio * 0.999)
        assert [v for v in violations(pair.metrics, tighter) if v.startswith("perplexity")], pair.candidate


def test_verify_fails_a_quantized_graph_whose_scales_are_off(quantized_export, tmp_path):
    """The folded int4 graph with every block's scale 40 % too large: the bounds catch it."""
    from taperfold.verify import verify_export

    copy = tmp_path / "out"
    shutil.copytree(quantized_export, copy)
    path = copy / "model.int4.onnx"
    model = onnx.load(str(path))
    for tensor in model.graph.initializer:
        if tensor.name.endswith("_scales"):
            tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor) * 1.4, tensor.name))
    onnx.save(model, str(path), save_as_external_data=True, location="model.int4.onnx.data")
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = manifest["artifacts"]["folded.int4"]
    entry["bytes"], entry["external_data_bytes"] = path.stat().st_size, (copy / "model.int4.onnx.data").stat().st_size
    (copy / "manifest.json").write_text(json.dumps(manifest))
    report = verify_export(copy, threads=1)
    pair = next(p for p in report.pairs if p.candidate == "folded.int4")
    assert pair.status == "fail" and pair.violations and not report.passed


@pytest.mark.parametrize("precision", PRECISIONS)
def test_genai_quantized_folders_generate_from_the_quantized_decoders(quantized_export, precision):
    import onnxruntime_genai as og

    manifest = read_manifest(quantized_export)
    for variant in ("folded", "baseline"):
        record = manifest.find(variant, GROWING, "genai", precision)
        assert record is not None and record.path == f"genai/{variant}-{precision}/genai_config.json"
        assert record.built_from == manifest.find(variant, GROWING, precision=precision).key
        folder = manifest.file(record).parent
        assert "MatMulNBits" in {n.op_type for n in _nodes(folder / record.details.decoder)}
        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, batch_size=1, max_length=12)
        generator = og.Generator(model, params)
        generator.append_tokens(np.arange(1, 9, dtype=np.int32)[None])
        while not generator.is_done():
            generator.generate_next_token()
        assert len(generator.get_sequence(0)) == 12


def test_bench_times_the_quantized_graphs_with_precision(quantized_export, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(quantized_export, copy)
    result = run_cli(
        "bench", copy, "--mode", "decode", "--precision", "int4", "--batch", "1", "--prompt", "8", "--new-tokens",
        "3", "--warmup", "1", "--iters", "2", "--rounds", "1", "--threads", "1", "--json", "-",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["settings"]["precision"] == "int4"
    assert {row["variant"] for row in report["results"]} == {"baseline", "unfolded", "folded"}


def test_bench_precision_names_the_missing_quantized_graph(tiny_export):
    result = run_cli("bench", tiny_export, "--precision", "int8", "--seq", "8", "--iters", "1")
    one_line(result, "missing key 'artifacts.baseline.int8'", "re-export with --quantize int8")


def test_bench_precision_refuses_the_torch_engine(quantized_export):
    result = run_cli("bench", quantized_export, "--engine", "torch", "--precision", "int4", "--iters", "1")
    one_line(result, "--precision int4", "--engine ort or genai or openvino")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--quantize", "int3"], ["--quantize takes int4 or int8", "int3"]),
        (["--quantize", "int4", "--block-size", "48"], ["--block-size must be one of", "48"]),
        (["--block-size", "64"], ["--block-size", "add --quantize"]),
        (["--quantize", "int4", "--dtype", "fp16"], ["fp32 export", "fp16"]),
        (["--quantize", "int8", "--genai", "--dtype", "bf16"], ["bf16"]),
    ],
)
def test_export_refuses_a_bad_quantize_request_before_any_work(tiny_checkpoint, tmp_path, args, needles):
    result = run_cli("export", tiny_checkpoint, "-o", tmp_path / "out", *args)
    one_line(result, *needles)
    assert not (tmp_path / "out").exists()


def test_quantization_settings_are_the_builders():
    q = Quantization("int4")
    assert (q.bits, q.block_size, q.symmetric, q.accuracy_level) == (4, 32, True, 4)
    assert q.builder_options() == ["block_size=32", "accuracy_level=4", "is_symmetric=true"]
    assert parse_precisions("int8, int4,int8") == ("int8", "int4")
    with pytest.raises(TaperfoldError, match="--quantize takes"):
        parse_precisions(",")


def test_a_quantized_pair_is_judged_by_top1_and_kl_not_by_max_rel():
    tolerance = default_tolerance("int4", "export")
    metrics = Metrics(rows=8, max_abs=3.0, max_rel=0.4, mean_abs=0.1, cosine=0.99, top1=0.95, decisive_rows=6,
                      top1_decisive=1.0, top5=0.9, kl=0.01)  # fmt: skip
    assert violations(metrics, tolerance) == []
    assert violations(Metrics(**{**metrics.to_dict(), "kl": 0.5}), tolerance) == [f"kl 0.5 > {tolerance.max_kl:.3g}"]
    worse = Metrics(**{**metrics.to_dict(), "top1_decisive": 0.5})
    (line,) = violations(worse, tolerance)
    assert line.startswith(f"top1 0.5 < {tolerance.min_top1:g} (3 of 6 decisive rows: p 0.047 < 0.05")
    assert all(p in tolerance_help() for p in PRECISIONS)


def _top1(agreed: int, decisive: int, kl: float = 0.0025) -> Metrics:
    return Metrics(rows=2 * decisive, max_abs=1.0, max_rel=0.1, mean_abs=0.01, cosine=0.99, top1=0.5,
                   decisive_rows=decisive, top1_decisive=agreed / decisive, top5=0.9, kl=kl)  # fmt: skip


def test_a_quantized_top1_is_a_rate_judged_on_the_sample_it_has():
    """Tiny Gemma 2 at int4: 5 of its 7 decisive rows agreed (0.71, one flip costs 0.14) at a KL of 0.0025, which
    failed a bound of 0.85 read as the sample's own rate. A quantized candidate's flips are draws: the sample fails
    when it is evidence of a rate below the bound, so that one passes, while a wrong graph's few rows, a large
    sample clearly below the bound, or a KL past its bound still fail; float pairs keep the rate itself."""
    from taperfold.compare import binomial_cdf

    assert binomial_cdf(5, 7, 0.85) == pytest.approx(0.28342, abs=1e-5)
    assert binomial_cdf(7, 7, 0.85) == 1.0 and binomial_cdf(-1, 7, 0.85) == 0.0 and binomial_cdf(3, 7, 1.0) == 0.0
    assert binomial_cdf(830, 1000, 0.85) == pytest.approx(0.04383, abs=1e-5)  # no underflow at thousands of rows
    int4, int8 = default_tolerance("int4", "export"), default_tolerance("int8", "export")
    assert violations(_top1(5, 7), int4) == []
    assert violations(_top1(5, 7, kl=0.2), int4) == [f"kl 0.2 > {int4.max_kl:.3g}"]  # the KL binds on any sample
    (wrong,) = violations(_top1(2, 7), int4)  # a wrong graph: its tokens mostly differ
    assert wrong.startswith("top1 0.2857 < 0.85 (2 of 7 decisive rows: p 0.0012 < 0.05")
    assert violations(_top1(820, 1000), int4) and not violations(_top1(840, 1000), int4)
    assert violations(_top1(5, 19), int4)  # Gemma 3's decode before its fix: 0.26
    assert violations(_top1(13, 15), int8) == [] and violations(_top1(10, 15), int8)
    fp32 = default_tolerance("fp32", "export")  # a decisive flip of a float pair is no draw: a bug
    assert fp32.top1_significance is None and "top1 0.9333 < 0.999" in violations(_top1(14, 15, kl=0.0), fp32)
    assert violations(_top1(5, 7), int4.override(min_top1=1.0))  # a bound the user sets is judged so too


@pytest.mark.parametrize(
    ("trans_b", "alpha", "beta", "bias"), [(0, 1.0, 1.0, True), (1, 0.5, 2.0, True), (0, 1.0, 1.0, False)]
)
def test_a_gemm_with_a_constant_weight_is_quantized_as_the_matmul_and_add_it_computes(
    tmp_path, trans_b, alpha, beta, bias
):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from taperfold.quantize import quantize_graph

    rng = np.random.default_rng(0)
    k, n = 64, 48
    weight = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "W")] + (
        [numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "C")] if bias else []
    )
    gemm = helper.make_node("Gemm", ["x", "W", *(["C"] if bias else [])], ["y"], transB=trans_b, alpha=alpha, beta=beta)
    graph = helper.make_graph(
        [gemm],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "g.onnx")
    report = quantize_graph(tmp_path / "g.onnx", tmp_path / "q.onnx", Quantization("int8"))
    assert report["matmuls_quantized"] == 1
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    assert [node.op_type for node in quantized.graph.node] == ["MatMulNBits", *(["Add"] if bias else [])]
    assert {i.name for i in quantized.graph.initializer}.isdisjoint({"W"})  # the float weight is not kept beside
    x = rng.standard_normal((5, k)).astype(np.float32)
    want = ort.InferenceSession(tmp_path / "g.onnx").run(None, {"x": x})[0]
    got = ort.InferenceSession(tmp_path / "q.onnx").run(None, {"x": x})[0]
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-2  # int8 blocks: about 1 %


def test_gpt2s_conv1d_layers_are_quantized_and_verify(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    source = save_hf_directory(tapered_tiny_model("gpt2"), tmp_path / "tapered")
    result = run_cli("export", source, "-o", tmp_path / "out", "--no-baseline", "--quantize", "int8")
    assert result.exit_code == 0, result.stderr
    fold = read_manifest(tmp_path / "out").report("folded.int8", "quantize")
    assert fold["matmuls_quantized"] == 2 * 4 + 1  # per layer c_attn, c_proj, c_fc, mlp c_proj; the head
    assert run_cli("verify", tmp_path / "out").exit_code == 0
