"""`taperfold verify`, its metrics and the ONNX Runtime runner."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_line

from taperfold.compare import Metrics, Tolerance, compare_logits, default_tolerance, violations
from taperfold.errors import TaperfoldError


@pytest.fixture
def export_copy(tiny_export, tmp_path):
    """A private copy of the shared export, free to break."""
    return shutil.copytree(tiny_export, tmp_path / "out")


def verify(cli, *args):
    """`taperfold verify ARGS` on one thread: on a small shared CI machine, thread barriers stall."""
    return cli("verify", *args, "--threads", "1")


def _one_error_line(result, *needles):
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taperfold: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


# ---- metrics -------------------------------------------------------------------------------------------


def _logits(shape=(3, 5, 40), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 4


def test_identical_logits_are_perfect():
    x = _logits()
    m = compare_logits(x, x.copy(), rtol=1e-4)
    assert m.rows == 15 and m.max_abs == 0 and m.max_rel == 0 and m.mean_abs == 0
    assert m.cosine == pytest.approx(1.0) and m.kl == pytest.approx(0.0, abs=1e-15)
    assert m.top1 == m.top1_decisive == m.top5 == 1.0
    assert violations(m, default_tolerance("fp32", "fold")) == []


def test_known_errors():
    ref = np.array([[4.0, 1.0, 0.0, -2.0]])
    m = compare_logits(ref, ref + np.array([[0.0, 0.5, 0.0, 0.0]]), rtol=1e-4)
    assert m.max_abs == 0.5 and m.max_rel == pytest.approx(0.5 / 4) and m.mean_abs == pytest.approx(0.125)
    p = np.exp(ref[0]) / np.exp(ref[0]).sum()
    q = np.exp(ref[0] + [0, 0.5, 0, 0]) / np.exp(ref[0] + [0, 0.5, 0, 0]).sum()
    assert m.kl == pytest.approx(float((p * np.log(p / q)).sum()), rel=1e-9)
    assert m.top1 == 1.0


def test_swapping_the_top_two_tokens_breaks_top1():
    ref = _logits((8, 40))
    cand = ref.copy()
    rows = np.arange(len(ref))
    first, second = np.argsort(-ref, axis=-1)[:, 0], np.argsort(-ref, axis=-1)[:, 1]
    cand[rows[:2], first[:2]], cand[rows[:2], second[:2]] = ref[rows[:2], second[:2]], ref[rows[:2], first[:2]]
    m = compare_logits(ref, cand, rtol=1e-4)
    assert m.top1 == pytest.approx(6 / 8) and m.top5 == 1.0 and m.kl > 0
    assert any(v.startswith("top1") for v in violations(m, Tolerance(rtol=1.0, min_top1=0.99, max_kl=1.0)))


def test_near_ties_are_not_held_to_top1():
    ref = np.array([[5.0, 4.99999, 0.0], [5.0, 1.0, 0.0]])
    cand = np.array([[4.99999, 5.0, 0.0], [5.0, 1.0, 0.0]])
    m = compare_logits(ref, cand, rtol=1e-3)
    assert m.top1 == 0.5 and m.decisive_rows == 1 and m.top1_decisive == 1.0


def test_nan_fails_every_bound_and_survives_pooling():
    ref = _logits((4, 40))
    cand = ref.copy()
    cand[1, 3] = np.nan
    m = compare_logits(ref, cand, rtol=1e-4)
    assert len(violations(m, Tolerance(rtol=1e9, min_top1=0.0, max_kl=1e9))) == 2  # max_rel and kl
    pooled = Metrics.merge([compare_logits(ref, ref, 1e-4), m])
    assert np.isnan(pooled.max_rel) and pooled.rows == 8


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shape"):
        compare_logits(np.zeros((2, 10)), np.zeros((2, 11)), rtol=1e-4)


def test_merge_weights_means_by_rows():
    a = compare_logits(np.eye(4), np.eye(4), 1e-4)
    b = compare_logits(np.eye(4)[:2], np.eye(4)[:2][:, ::-1].copy(), 1e-4)
    pooled = Metrics.merge([a, b])
    assert pooled.rows == 6 and pooled.top1 == pytest.approx(4 / 6) and pooled.max_abs == b.max_abs


def test_perplexity_scores_only_the_rows_whose_next_token_is_known():
    ref, cand = _logits((2, 3, 40), seed=1), _logits((2, 3, 40), seed=2)
    next_ids = np.array([[5, 7, -1], [0, 39, -1]])
    m = compare_logits(ref, cand, 1e-4, next_ids)

    def nll(x):
        rows, targets = x.reshape(-1, 40)[[0, 1, 3, 4]], [5, 7, 0, 39]
        log_p = rows - np.log(np.exp(rows).sum(axis=-1, keepdims=True))
        return -log_p[np.arange(4), targets].mean()

    assert m.scored == 4
    assert m.nll_reference == pytest.approx(nll(ref)) and m.nll_candidate == pytest.approx(nll(cand))
    assert m.ppl_ratio == pytest.approx(np.exp(nll(cand) - nll(ref)))
    unscored = compare_logits(ref, cand, 1e-4)
    assert unscored.scored == 0 and np.isnan(unscored.ppl_ratio)
    first_row = compare_logits(ref[:1], ref[:1], 1e-4, next_ids[:1])
    pooled = Metrics.merge([m, unscored, first_row])
    assert pooled.scored == 6  # weighted by scored rows; an unscored batch adds nothing (not NaN)
    assert pooled.nll_reference == pytest.approx((4 * m.nll_reference + 2 * first_row.nll_reference) / 6)


def test_perplexity_bound_holds_quantized_pairs_scored_on_enough_tokens():
    from taperfold.compare import MIN_SCORED_TOKENS

    int4 = default_tolerance("int4", "export")
    worse = Metrics(rows=1, max_abs=0, max_rel=0, mean_abs=0, cosine=1, top1=1, decisive_rows=1, top1_decisive=1,
                    top5=1, kl=0, scored=MIN_SCORED_TOKENS, nll_reference=2.0,
                    nll_candidate=2.0 + np.log(1.2))  # fmt: skip
    assert violations(worse, int4) == [f"perplexity x1.2 > x{int4.max_ppl_ratio:g}"]
    assert violations(worse, int4.override(max_ppl_ratio=1.25)) == []
    few = Metrics(**{**worse.to_dict(), "scored": MIN_SCORED_TOKENS - 1})
    assert violations(few, int4) == []  # too few tokens to judge: reported only
    assert violations(worse, default_tolerance("fp32", "export")) == []  # float pairs: KL and top-1 judge them


def test_next_token_ids_align_each_call_with_the_token_it_predicts():
    from taperfold.verify.inputs import next_token_ids
    from taperfold.verify.run import Case

    ids = np.arange(10, 20)[None]  # ten tokens; the last predicts nothing known
    prefill = Case("p", ids)
    assert next_token_ids(ids, prefill.ends(1)[0], (1, 10, 99)).tolist() == [*range(11, 20), -1]  # --logits all
    assert next_token_ids(ids, prefill.ends(1)[0], (1, 99)).tolist() == [-1]  # --logits last
    decode = Case("d", ids, decode=True, steps=3)  # prompt of 7, then tokens 17, 18, 19 fed
    ends = decode.ends(4)
    assert ends == [7, 8, 9, 10]
    assert [next_token_ids(ids, end, (1, 1, 99)).tolist() for end in ends] == [[17], [18], [19], [-1]]
    assert next_token_ids(ids, ends[0], (1, 7, 99)).tolist() == list(range(11, 18))  # a prompt's every position


def test_tolerances_override_and_help_lists_defaults(cli):
    assert Tolerance(1e-4, 0.99, 1e-6).override(rtol=0.5, max_kl=None) == Tolerance(0.5, 0.99, 1e-6)
    help_text = cli("verify", "--help").stdout

    def sci(x: float) -> str:  # 1e-4, as the help text writes it
        return f"{x:.0e}".replace("e-0", "e-")

    for dtype in ("fp32", "fp16", "bf16"):
        for kind in ("export", "fold"):
            tol = default_tolerance(dtype, kind)
            assert f"rtol {sci(tol.rtol)}" in help_text and f"max-kl {sci(tol.max_kl)}" in help_text
            assert f"min-top1 {tol.min_top1:g}" in help_text


# ---- the ONNX Runtime runner -----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["missing", "corrupt", "data missing", "data truncated"])
def test_ort_runner_names_the_broken_file(export_copy, damage):
    from taperfold.runners.ort import OrtRunner

    model, data = export_copy / "model.onnx", export_copy / "model.onnx.data"
    if damage == "missing":
        model.unlink()
    elif damage == "corrupt":
        model.write_bytes(b"\x08\x07garbage" * 10)
    elif damage == "data missing":
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(TaperfoldError) as info:
        OrtRunner(model).load()
    message = str(info.value)
    assert message.startswith(f"{model}: ") and "\n" not in message
    if damage.startswith("data"):  # the data file is named too, and what is wrong with it
        assert f"external data file '{data.name}'" in message
        assert ("is missing" if damage == "data missing" else "is too short") in message


# ---- verify: passing -------------------------------------------------------------------------------------


def test_correct_export_passes(cli, export_copy):
    result = cli("verify", export_copy)  # default threads
    assert result.exit_code == 0, result.stderr
    assert "PASS" in result.stdout and "checkpoint -> folded" in result.stdout
    report = json.loads((export_copy / "verify.json").read_text())
    assert report["passed"] and report["dtype"] == "fp32"
    names = [p["name"] for p in report["pairs"]]
    assert names[:3] == ["checkpoint -> unfolded", "checkpoint -> folded", "unfolded -> folded"]
    assert {
        "baseline (torch) -> baseline",
        "baseline-decomposed -> baseline",  # the export has decoders:
        "checkpoint -> folded.decoder",
        "baseline (torch) -> baseline.decoder",
    } <= set(names)  # all verified
    shapes = {tuple(i["shape"]) for i in report["inputs"]}
    assert {(1, 1), (4, 1), (1, 128), (4, 128)} <= shapes  # batch 1 and 4, sequence 1 up to max_seq_len
    fold = report["pairs"][2]
    assert fold["tolerance"]["rtol"] == 1e-5 and fold["metrics"]["max_rel"] <= 1e-5
    assert len(fold["per_input"]) == len(report["inputs"])


def test_json_output_is_the_report_only(cli, export_copy):
    result = verify(cli, export_copy, "--json", "--seed", "3")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == json.loads((export_copy / "verify.json").read_text())


def test_token_files(cli, export_copy, tmp_path):
    npy = tmp_path / "ids.npy"
    np.save(npy, np.arange(60, dtype=np.int32).reshape(3, 20))
    text_ids = tmp_path / "ids.txt"
    text_ids.write_text("1 2 3 4 5\n250 251 252 253 254\n")
    for path, shape in ((npy, [3, 20]), (text_ids, [2, 5])):
        result = verify(cli, export_copy, "--tokens", path, "--json")
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["inputs"] == [{"label": str(path), "shape": shape}]


def test_text_file(cli, export_copy, tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text("def verify(export_dir):\n    return 'ünïcode'\n")
    result = verify(cli, export_copy, "--text", text, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["inputs"] == [{"label": str(text), "shape": [1, len(text.read_bytes())]}]


def test_a_long_text_is_scored_in_windows_and_decoded(cli, export_copy, tiny_checkpoint, tmp_path):
    """600 bytes in the tiny model's 128-token context: four windows in one batch, the rest in another. Every pair
    scores the text, the decoders decode it, and the checkpoint's perplexity is the torch model's own on the tokens
    each call predicts (the decoders' steps: the last half of each window, at most 64 tokens)."""
    from taperfold.sources import open_source

    text = tmp_path / "held-out.txt"
    data = (Path(__file__).read_bytes() * 2)[:600]
    text.write_bytes(data)
    result = verify(cli, export_copy, "--text", text, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["inputs"] == [
        {"label": f"{text} tokens 0-511", "shape": [4, 128]},
        {"label": f"{text} tokens 512-599", "shape": [1, 88]},
    ]
    pairs = {p["name"]: p for p in report["pairs"]}
    decoder = pairs["checkpoint -> folded.decoder"]
    assert {r["input"].split(" prompt")[0].split(" step")[0] for r in decoder["per_input"]} == {
        f"decode {text} tokens 0-511 4x64+64", f"decode {text} tokens 512-599 1x44+44"}  # fmt: skip
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    with torch.no_grad():
        model = open_source(tiny_checkpoint).build()
        nll = []
        for window, prompt in ((ids[i : i + 128], 64) for i in range(0, 512, 128)):
            log_p = torch.log_softmax(model(torch.from_numpy(window)[None], logits="all")[0].double(), -1)
            nll += [-log_p[t - 1, window[t]].item() for t in range(prompt, 128)]
        window = ids[512:]
        log_p = torch.log_softmax(model(torch.from_numpy(window)[None], logits="all")[0].double(), -1)
        nll += [-log_p[t - 1, window[t]].item() for t in range(44, 88)]
    metrics = decoder["metrics"]
    assert metrics["scored"] == len(nll) == 4 * 64 + 44
    assert metrics["nll_reference"] == pytest.approx(np.mean(nll), rel=1e-6)
    assert metrics["nll_candidate"] == pytest.approx(np.mean(nll), rel=1e-4)
    prefill = pairs["checkpoint -> folded"]["metrics"]  # logits of the last position: no next token known
    assert prefill["scored"] == 0 and prefill["nll_reference"] is None


# ---- verify: numeric failure -----------------------------------------------------------------------------


def test_perturbed_weight_fails_naming_the_pair(cli, tiny_export, tmp_path):
    import onnx_ir as ir

    out = tmp_path / "out"
    out.mkdir()
    for name in ("unfolded.onnx", "unfolded.onnx.data"):
        shutil.copy(tiny_export / name, out / name)
    manifest = json.loads((tiny_export / "manifest.json").read_text())  # only the two graphs copied here
    manifest["artifacts"] = {k: v for k, v in manifest["artifacts"].items() if k in ("unfolded", "folded")}
    (out / "manifest.json").write_text(json.dumps(manifest))
    model = ir.load(tiny_export / "model.onnx")
    weight = next(
        v
        for node in model.graph
        if node.op_type == "MatMul"
        for v in node.inputs
        if v is not None and v.const_value is not None
    )
    array = weight.const_value.numpy().copy()
    array.flat[0] += 1.0
    weight.const_value = ir.tensor(array, name=weight.name)
    ir.save(model, out / "model.onnx", external_data="model.onnx.data")

    result = verify(cli, out)
    assert result.exit_code == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("taperfold: FAILED: ") and "-> folded" in line and "max_rel" in line
    report = json.loads((out / "verify.json").read_text())
    status = {p["name"]: p["status"] for p in report["pairs"]}
    assert status == {"checkpoint -> unfolded": "pass", "checkpoint -> folded": "fail", "unfolded -> folded": "fail"}


def _two_graphs(tiny_export, out):
    """unfolded.onnx and model.onnx of the tiny export in `out`, with a manifest naming only them."""
    out.mkdir()
    for name in ("unfolded.onnx", "unfolded.onnx.data", "model.onnx", "model.onnx.data"):
        shutil.copy(tiny_export / name, out / name)
    manifest = json.loads((tiny_export / "manifest.json").read_text())
    manifest["artifacts"] = {k: v for k, v in manifest["artifacts"].items() if k in ("unfolded", "folded")}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def _scale_weight(source, out, factor, pick):
    """The graph `source` with the constant input that `pick(graph)` returns multiplied by `factor`, written in
    folder `out` under the same name."""
    import onnx_ir as ir

    model = ir.load(source)
    weight = pick(model.graph)
    array = weight.const_value.numpy() * np.float32(factor)
    weight.const_value = ir.tensor(array, name=weight.name)
    ir.save(model, out / source.name, external_data=source.name + ".data")


def _final_norm_gain(graph):
    return next(n.inputs[1] for n in graph if n.op_type == "RMSNormalization")  # the final norm, kept in both


def _first_projection(graph):
    return next(
        v
        for node in graph
        if node.op_type == "MatMul"
        for v in node.inputs
        if v is not None and v.const_value is not None
    )


def test_a_graph_onnx_runtime_cannot_run_fails_its_pairs_and_the_report_is_written(cli, tiny_export, tmp_path):
    # model.onnx traced for one sequence length only (as Qwen3-Next's chunked linear attention traces): ONNX Runtime
    # refuses every other input; verify records that as the pairs' failure, runs the rest and writes its report
    import onnx

    out = shutil.copytree(tiny_export, tmp_path / "out")
    model = onnx.load(out / "model.onnx", load_external_data=False)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 3
    onnx.save(model, out / "model.onnx")
    result = verify(cli, out)
    assert result.exit_code == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("taperfold: FAILED: ") and "-> folded" in line
    report = json.loads((out / "verify.json").read_text())
    status = {p["name"]: (p["status"], p["reason"]) for p in report["pairs"]}
    assert status["checkpoint -> unfolded"][0] == "pass"
    assert status["checkpoint -> folded"][0] == "fail" and status["unfolded -> folded"][0] == "fail"
    assert (
        "did not run: " in status["checkpoint -> folded"][1]
        and "onnxruntime run failed" in status["checkpoint -> folded"][1]
    )


def test_fold_bound_follows_the_exporters_own_distance(tiny_export, tmp_path):
    """At 683 M parameters unfolded.onnx sat 6.3e-5 from the checkpoint, model.onnx 2.2e-5, and the two 4.3e-5 apart:
    over the fixed 1e-5 fold bound though the fold was right. Here the unfolded graph is put 5e-5 from the checkpoint
    (its final norm's gain scaled by 1 + 5e-5: every logit moves by that fraction) and the correct folded graph
    stays where the exporter put it: the fold pair passes on 2x the exporter's distance and says so. A wrong fold
    (the first folded projection's norm gain 1 % off) still fails."""
    from taperfold.verify import verify_export

    out = _two_graphs(tiny_export, tmp_path / "right")
    _scale_weight(tiny_export / "unfolded.onnx", out, 1 + 5e-5, _final_norm_gain)
    report = verify_export(out, threads=1)
    pairs = {p.name: p for p in report.pairs}
    export, fold = pairs["checkpoint -> unfolded"], pairs["unfolded -> folded"]
    assert 3e-5 < export.metrics.max_rel < 1e-4 and fold.metrics.max_rel > 1e-5  # the fixed bound would fail it
    assert report.passed, report.failure_message()
    assert fold.tolerance.rtol == pytest.approx(2 * export.metrics.max_rel)
    assert "checkpoint -> unfolded" in fold.tolerance.basis and fold.to_json()["tolerance"]["basis"]

    wrong = _two_graphs(tiny_export, tmp_path / "wrong")
    _scale_weight(tiny_export / "unfolded.onnx", wrong, 1 + 5e-5, _final_norm_gain)
    _scale_weight(tiny_export / "model.onnx", wrong, 1.01, _first_projection)
    report = verify_export(wrong, threads=1)
    fold = {p.name: p for p in report.pairs}["unfolded -> folded"]
    assert fold.status == "fail" and fold.metrics.max_rel > 10 * fold.tolerance.rtol
    assert "(bound: " in fold.violations[-1]
    # a bound the user sets is the bound
    report = verify_export(out, threads=1, tolerances={"rtol": 1e-5, "max_kl": 1e-8})
    fold = {p.name: p for p in report.pairs}["unfolded -> folded"]
    assert fold.status == "fail" and fold.tolerance == Tolerance(1e-5, 0.999, 1e-8)


def test_a_checkpoint_that_overflows_on_an_input_fails_naming_the_input(tmp_path):
    """A random model at g = 0 (its norms linear) can overflow fp32 on some tokens: examples/vllm_1b.py's first 1.1 B
    model gave Inf/NaN logits on one of verify's inputs, which the report gave as `max_rel nan`. Here token 5's
    embedding is 1e30, past fp32's range once squared in attention: the checkpoint's own logits on an input holding
    it are not finite. verify fails its pairs in one line saying so and naming the input; the other input is still
    compared (and passes)."""
    from hf_models import tapered_tiny_model

    from taperfold.export import ExportOptions, export_checkpoint
    from taperfold.hf import save_hf_directory
    from taperfold.verify import InputBatch, verify_export

    model = tapered_tiny_model("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight[5] = 1e30
    source = save_hf_directory(model, tmp_path / "tapered")
    out = export_checkpoint(source, tmp_path / "out", ExportOptions(baseline=False)).out_dir
    inputs = [InputBatch("fine", np.array([[3, 4, 6, 7]])), InputBatch("token 5", np.array([[3, 5, 6, 7]]))]
    report = verify_export(out, inputs=inputs, threads=1)
    pairs = {p.name: p for p in report.pairs}
    for name, reference in (("checkpoint -> unfolded", "checkpoint"), ("unfolded -> folded", "unfolded")):
        pair = pairs[name]
        assert pair.status == "fail" and pair.worst_input == "token 5"
        assert pair.reason == (
            f"the {reference}'s logits on 'token 5' are not finite (Inf/NaN): the model overflows there, "
            "nothing to compare"
        )
        fine, overflowing = pair.per_input
        assert fine["input"] == "fine" and not fine["violations"] and overflowing["metrics"] is None
        assert np.isfinite(pair.metrics.max_rel) and not pair.violations  # pooled over the input it could compare
    assert set(pairs) == {"checkpoint -> unfolded", "checkpoint -> folded", "unfolded -> folded"}
    assert report.failure_message().startswith(
        "checkpoint -> unfolded: the checkpoint's logits on 'token 5' are not finite (Inf/NaN)"
    )
    assert "(worst input: token 5)" in report.failure_message()


def test_between_graphs_widens_only_past_the_fixed_bound():
    from taperfold.compare import between_graphs

    fixed = default_tolerance("fp32", "fold")

    def export(max_rel, kl):
        return Metrics(
            rows=1,
            max_abs=max_rel,
            max_rel=max_rel,
            mean_abs=0.0,
            cosine=1.0,
            top1=1.0,
            decisive_rows=1,
            top1_decisive=1.0,
            top5=1.0,
            kl=kl,
        )

    assert between_graphs(fixed, export(4e-6, 1e-12), "c -> u") == fixed  # a small model: the fixed bound
    wide = between_graphs(fixed, export(6.3e-5, 1e-9), "c -> u")
    assert (wide.rtol, wide.max_kl, wide.min_top1) == (pytest.approx(1.26e-4), fixed.max_kl, fixed.min_top1)
    assert wide.basis.startswith("rtol 2 x 6.3e-05 (c -> u)")
    assert between_graphs(fixed, export(6.3e-5, 1e-8), "c -> u").max_kl == pytest.approx(4e-8)
    assert between_graphs(fixed, export(float("nan"), float("nan")), "c -> u") == fixed
    assert between_graphs(fixed, export(6.3e-5, 1e-8), "c -> u", rtol_given=True, max_kl_given=True) == fixed


def test_tolerance_flags_apply(cli, export_copy):
    result = verify(cli, export_copy, "--rtol", "0")
    assert result.exit_code == 1 and "max_rel" in result.stderr


# ---- verify: bad input ---------------------------------------------------------------------------------


def test_missing_directory_is_one_line_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "taperfold.cli", "verify", str(tmp_path / "nowhere")], capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        f"taperfold: error: {tmp_path / 'nowhere'}: no such directory (run `taperfold export` first)"
    )


def test_no_manifest(cli, tmp_path):
    _one_error_line(verify(cli, tmp_path), "manifest.json: missing")


def test_corrupt_manifest(cli, export_copy):
    (export_copy / "manifest.json").write_text('{"format": "taperfold-export", ')
    _one_error_line(verify(cli, export_copy), "manifest.json: not valid JSON")


def test_manifest_missing_key(cli, export_copy):
    manifest = json.loads((export_copy / "manifest.json").read_text())
    del manifest["checkpoint"]["sha256"]
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    _one_error_line(verify(cli, export_copy), "missing key 'checkpoint.sha256'")


def test_missing_model_file(cli, export_copy):
    (export_copy / "model.onnx").unlink()
    _one_error_line(verify(cli, export_copy), str(export_copy / "model.onnx"), "missing")


def test_checkpoint_changed_since_export(cli, export_copy, tiny_checkpoint, tmp_path):
    changed = tmp_path / "changed.pt"
    shutil.copy(tiny_checkpoint, changed)
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["checkpoint"]["path"] = str(changed)
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    with open(changed, "ab") as f:
        f.write(b"\0")
    _one_error_line(verify(cli, export_copy), str(changed), "checkpoint changed since export")


@pytest.mark.parametrize(
    "content, message",
    [
        ("1 2 300", "token id 300 is out of range"),
        ("1 2 x", "line 1: 'x' is not an integer token id"),
        ("1 2 3\n4 5", "lines hold different numbers of ids"),
        (" ".join(["7"] * 129), "sequence of 129 tokens is longer than the model allows (128)"),
    ],
)
def test_bad_token_file(cli, tiny_export, tmp_path, content, message):
    path = tmp_path / "ids.txt"
    path.write_text(content)
    _one_error_line(verify(cli, tiny_export, "--tokens", path), str(path), message)


def test_bad_npy_and_text(cli, tiny_export, tmp_path):
    floats = tmp_path / "ids.npy"
    np.save(floats, np.ones((2, 3)))
    _one_error_line(verify(cli, tiny_export, "--tokens", floats), str(floats), "must be integers")
    text = tmp_path / "text.txt"
    text.write_text("a" * 200)
    result = verify(cli, tiny_export, "--tokens", floats, "--text", text)
    assert result.exit_code == 2 and "not both" in result.stderr
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    _one_error_line(verify(cli, tiny_export, "--text", empty), str(empty), "is empty")


def test_forced_gate0_export_reports_the_cost(cli, export_copy, tiny_checkpoint, tmp_path):
    """--force-gate0 of a g = 0.5 checkpoint writes the same ONNX files as the g = 0 export of the same
    weights, so only the checkpoint and the manifest differ. The export is held to the checkpoint at
    g = 0; the real gate's pair is reported, not judged."""
    from taperfold.checkpoint import load_checkpoint, save_checkpoint
    from taperfold.sources import checkpoint_digest

    ckpt = load_checkpoint(tiny_checkpoint)
    ckpt.gate = 0.5
    half = save_checkpoint(ckpt, tmp_path / "half.pt")
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["checkpoint"].update(path=str(half), sha256=checkpoint_digest(half))
    manifest.update(gate=0.5, forced_gate0=True)
    (export_copy / "manifest.json").write_text(json.dumps(manifest))

    result = verify(cli, export_copy, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    pairs = {p["name"]: p for p in report["pairs"]}
    assert report["forced_gate0"] and report["checkpoint"]["reference_gate"] == 0.0
    assert pairs["checkpoint@g=0 -> folded"]["status"] == "pass"
    cost = pairs["checkpoint@g=0.5 -> folded"]
    assert cost["status"] == "info" and cost["tolerance"] is None and cost["metrics"]["max_rel"] > 1e-3


def test_report_says_which_of_unfolded_and_folded_is_closer_to_the_checkpoint():
    from taperfold.verify import PairResult, VerifyReport

    def metrics(max_rel):
        return Metrics(
            rows=1,
            max_abs=max_rel,
            max_rel=max_rel,
            mean_abs=0.0,
            cosine=1.0,
            top1=1.0,
            decisive_rows=1,
            top1_decisive=1.0,
            top5=1.0,
            kl=0.0,
        )

    def report(unfolded, folded):
        pairs = [
            PairResult("checkpoint", "unfolded", "export", None, metrics=metrics(unfolded)),
            PairResult("checkpoint", "folded", "export", None, metrics=metrics(folded)),
            PairResult("unfolded", "folded", "fold", None, metrics=metrics(1e-9)),
        ]
        return VerifyReport("d", {}, "fp16", "last", "cpu", False, [], pairs)

    assert report(2e-3, 1e-3).closer().startswith("closer to the checkpoint: folded (")
    assert "unfolded (max rel folded 0.0023, unfolded 0.002, ratio 1.15)" in report(2e-3, 2.3e-3).closer()
    assert report(2e-3, 1e-3).to_json()["closer"].endswith("ratio 0.50)")


# ---- bounds and devices refused -----------------------------------------------------------------------------


def test_a_kl_of_two_near_equal_rows_is_never_negative():
    from taperfold.compare import compare_logits

    rng = np.random.default_rng(0)
    reference = (rng.standard_normal((1, 256)) * 5).astype(np.float32)
    candidate = (reference.astype(np.float64) + rng.standard_normal(reference.shape) * 1e-8).astype(np.float32)
    assert compare_logits(reference, candidate, 1e-5).kl >= 0.0  # rounding made it -9e-17
    assert compare_logits(reference, reference, 1e-5).kl == 0.0


def test_verify_refuses_a_nan_bound_and_writes_nothing(tiny_export, tmp_path, cli):
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    (export / "verify.json").unlink(missing_ok=True)
    for flag, value in (("--rtol", "nan"), ("--max-kl", "inf"), ("--min-top1", "nan"), ("--seed", "-1")):
        r = cli("verify", export, flag, value)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and f"'{flag}'" in r.stderr, r.stderr
    assert not (export / "verify.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_verify_on_cuda_without_a_gpu_is_one_line(tiny_export, cli):
    one_line(cli("verify", tiny_export, "--device", "cuda"), "--device cuda")


@pytest.mark.parametrize(
    "command, report",
    [
        (("verify",), "verify.json"),
        (("bench", "--seq", "8", "--iters", "1", "--warmup", "0"), "bench.json"),
        (
            ("bench", "--mode", "decode", "--prompt", "4", "--new-tokens", "2", "--iters", "1", "--warmup", "0"),
            "bench-decode.json",
        ),
    ],
)
@pytest.mark.parametrize("target", ["model.onnx.data", "checkpoint"])
def test_a_report_planted_as_a_symlink_onto_an_input_is_refused(
    cli, tiny_export, tiny_checkpoint, tmp_path, command, report, target
):
    out = shutil.copytree(tiny_export, tmp_path / "out")
    victim = out / "model.onnx.data" if target == "model.onnx.data" else Path(tiny_checkpoint)
    before = victim.read_bytes()
    (out / report).unlink(missing_ok=True)
    (out / report).symlink_to(victim)
    result = cli(command[0], out, *command[1:])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    # refused as a link inside the export (round 5), before the question of which file it points to
    assert f"{report}: is a symlink" in result.stderr and victim.read_bytes() == before
