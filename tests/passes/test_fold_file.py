"""fold_onnx_file and `taperfold fold`: files, external data, bad input, the report, --verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx_ir as ir
import pytest
import torch
from _graphs import D, mul_matmul, rand, run
from conftest import HANG_S, one_line
from test_torch_exports import Block, TaperNorm, export

from taperfold.errors import TaperfoldError
from taperfold.passes import fold_onnx_file

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


def outside_model(tmp_path):
    """A model whose external data location climbs out of its directory, to a file that exists."""
    import onnx
    from onnx import external_data_helper, helper, numpy_helper

    (tmp_path / "secret").write_bytes(b"\0" * 64)
    model_dir = tmp_path / "a" / "b"
    model_dir.mkdir(parents=True)
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    external_data_helper.set_external_data(weight, location="../../secret", offset=0, length=64)
    weight.ClearField("raw_data")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", 1, [1, 4])],
        [helper.make_tensor_value_info("y", 1, [1, 4])],
        [weight],
    )
    onnx.save(helper.make_model(graph, ir_version=10), model_dir / "m.onnx")
    return model_dir / "m.onnx"


def bad_inputs(tmp_path):
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07garbage" * 50)
    no_data = small_model_file(tmp_path / "nodata.onnx")
    (tmp_path / "nodata.onnx.data").unlink()
    good = small_model_file(tmp_path / "good.onnx")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    two_bytes = tmp_path / "two.onnx"
    two_bytes.write_bytes(b"\x08\x07")  # parses as a ModelProto with ir_version 7 and nothing else
    return {
        "two bytes": (two_bytes, tmp_path / "o5.onnx", "not an ONNX model (no graph"),
        "outside": (
            outside_model(tmp_path),
            tmp_path / "o6.onnx",
            "'../../secret' (initializer 'W') points outside the model's directory",
        ),
        "missing": (tmp_path / "missing.onnx", tmp_path / "o1.onnx", "no such file"),
        "corrupt": (corrupt, tmp_path / "o2.onnx", "not a readable ONNX model"),
        "missing data": (no_data, tmp_path / "o3.onnx", "'nodata.onnx.data' (initializer 'W') is missing"),
        "unwritable": (good, blocker / "o4.onnx", "cannot create output directory"),
    }


@pytest.mark.parametrize("case", ["missing", "corrupt", "missing data", "unwritable", "two bytes", "outside"])
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
    assert result.exit_code == 0 and "1 of 1 constant-scale norms folded" in " ".join(result.stdout.split())


def test_nothing_to_fold_says_so_in_one_line_and_writes_the_input_unchanged(tmp_path, cli):
    path = tmp_path / "plain.onnx"
    model = mul_matmul(np.array(0.5, np.float32))  # a scalar scale only: no norm
    ir.save(model, path)
    result = cli("fold", path, "-o", tmp_path / "out.onnx")
    assert result.exit_code == 0 and result.stdout.count("\n") == 1
    assert "nothing to fold" in result.stdout and "unchanged" in result.stdout
    x = {"x": rand(2, 3, D)}
    np.testing.assert_array_equal(run(str(path), x)[0], run(str(tmp_path / "out.onnx"), x)[0])


def test_verify_passes_on_a_fold_and_fails_on_a_broken_one(tmp_path, cli, monkeypatch):
    src = small_model_file(tmp_path / "m.onnx")
    result = cli("fold", src, "-o", tmp_path / "f.onnx", "--verify", "--shapes", "x:2x3x8", "--json")
    printed = json.loads(result.stdout)
    assert result.exit_code == 0 and printed["verify"]["passed"] and printed["verify"]["inputs"] == {"x": [2, 3, 8]}
    assert printed["verify"]["outputs"][0]["metrics"]["max_rel"] <= 1e-5

    import taperfold.passes.readers as readers

    def wrong_scale(graph, match, readers_):  # a fold that forgets the norm's scale
        match.scale = match.scale * 1.01
        return original(graph, match, readers_)

    original = readers.move_into_readers
    monkeypatch.setattr("taperfold.passes.fold_readers.move_into_readers", wrong_scale)
    result = cli("fold", src, "-o", tmp_path / "g.onnx", "--verify")
    assert result.exit_code == 1 and "FAIL" in result.stdout
    assert result.stderr.startswith("taperfold: FAILED: input -> folded, output 'y': max_rel")


def test_verify_bad_shapes_is_one_line(tmp_path, cli):
    src = small_model_file(tmp_path / "m.onnx")
    for shapes, message in (("x:2by3", "is not NAME:DIMxDIM"), ("nope:1x2", "no graph input named 'nope'")):
        result = cli("fold", src, "-o", tmp_path / "f.onnx", "--verify", "--shapes", shapes)
        assert result.exit_code == 2 and message in result.stderr and result.stderr.count("\n") == 1


def test_merge_norm_weights_only_when_asked(tmp_path, cli):
    from _graphs import F32, RMS_CONSTS, N, X, build, n, rms_real

    path = tmp_path / "real.onnx"
    ir.save(
        build(
            [*rms_real(), n("MatMul", ["h", "W"], ["y"])],
            [X],
            [("y", F32, [2, 3, N])],
            {**RMS_CONSTS, "g": rand(D), "W": rand(D, N)},
        ),
        path,
    )
    result = cli("fold", path, "-o", tmp_path / "a.onnx")
    assert result.exit_code == 0 and "nothing to fold" in result.stdout and "1 real norm(s)" in result.stdout
    result = cli("fold", path, "-o", tmp_path / "b.onnx", "--merge-norm-weights", "--verify", "--json")
    summary = json.loads(result.stdout)["summary"]
    assert result.exit_code == 0 and summary["weights_merged"] == 1 and summary["folded"] == 0


# ---- the command line's output ------------------------------------------------------------------------------


def test_fold_output_with_a_trailing_slash_names_a_directory(tiny_export, tmp_path, cli):
    out = str(tmp_path / "new") + os.sep
    one_line(cli("fold", tiny_export / "unfolded.onnx", "-o", out), "is a directory; name a file")
    assert list(tmp_path.iterdir()) == []


def test_fold_report_on_a_narrow_terminal_is_a_list_not_a_squeezed_table(tiny_export, tmp_path):
    env = {**os.environ, "COLUMNS": "80"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "taperfold",
            "fold",
            str(tiny_export / "unfolded.onnx"),
            "-o",
            str(tmp_path / "f.onnx"),
            "--report",
            "-",
        ],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # stdout: the report
    lines = r.stderr.splitlines()
    assert all(len(line) <= 80 for line in lines)
    # one norm a line, whole: q, k and v read it, or their one fused projection (export fuses by default)
    fused = json.loads((tiny_export / "manifest.json").read_text())["export"]["fuse_projections"]
    assert f"  model.layers.0.input_layernorm: rms, folded, {1 if fused else 3} reader(s)" in lines


# ---- a refusal after the fold's work leaves nothing ---------------------------------------------------------


def _scale_over_a_dynamic_last_dim(path):
    """x [2, d] -> Mul(s [8]) -> MatMul(W [8, 4]): the scale broadcasts over x when d is run at 1, which the input
    graph takes and its fold (x · diag(s)W) cannot; at d = 16 (--verify's default) neither runs."""
    from _graphs import F32, build, n

    model = build(
        [n("Mul", ["x", "s"], ["h"]), n("MatMul", ["h", "W"], ["y"])],
        [("x", F32, [2, "d"])],
        [("y", F32, [2, 4])],
        {"s": rand(D), "W": rand(D, 4)},
    )
    ir.save(model, path, external_data=path.name + ".data")
    return path


@pytest.mark.parametrize(
    "shapes, refused",
    [([], "m.onnx: onnxruntime run failed"), (["--shapes", "x:2x1"], "o.onnx: onnxruntime run failed")],
    ids=["the input cannot run", "its fold cannot run"],
)
def test_a_verify_refusal_leaves_no_output_data_or_report_and_keeps_an_earlier_one(tmp_path, cli, shapes, refused):
    src = _scale_over_a_dynamic_last_dim(tmp_path / "m.onnx")
    out = tmp_path / "out"
    out.mkdir()
    (out / "o.onnx").write_bytes(b"an earlier fold")
    (out / "o.onnx.data").write_bytes(b"its weights")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = cli("fold", src, "-o", out / "o.onnx", "--report", out / "report.json", "--verify", *shapes)
    one_line(result, refused)
    assert ".tmp" not in result.stderr  # the folded model is named by its output path, not its temporary
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
