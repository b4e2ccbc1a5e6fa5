"""Checkpoint round trips in each layout, and one clear line (exit 2) for each kind of bad file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_S, one_line, run_cli
from safetensors.torch import save_file

from taperfold.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.models import build_model, preset_config


@pytest.fixture(scope="module")
def ckpt():
    torch.manual_seed(0)
    cfg = preset_config("tiny", arch="llama", taper="internal", n_layers=2, max_seq_len=32)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for norm in model.tapered_norms().values():
            norm.weight_tilde.uniform_(0.5, 1.5)
            norm.c.fill_(0.8)
            norm.ema_num.fill_(1.25)
            norm.ema_count.fill_(7)
    model.set_gate(0.0)
    return Checkpoint(cfg, model.state_dict(), 0.0, 123, {"val_loss": 2.5})


@pytest.mark.parametrize("name", ["c.pt", "c.safetensors", "cdir"])
def test_round_trip(tmp_path, ckpt, name):
    path = save_checkpoint(ckpt, tmp_path / name)
    back = load_checkpoint(path)
    assert back.config == ckpt.config and back.gate == 0.0 and back.step == 123
    assert back.meta["val_loss"] == 2.5
    for key, value in ckpt.state_dict.items():
        if key == "lm_head.weight":  # tied: stored once as the embedding
            continue
        assert torch.equal(back.state_dict[key], value), key  # the weights: bit for bit
    assert back.state_dict["model.layers.0.input_layernorm.ema_num"].dtype == torch.float64
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    original = build_model(ckpt.config).eval()
    original.load_state_dict(ckpt.state_dict)
    original.set_gate(0.0)
    # The outputs of two models to fp32's tolerance, not bit for bit: the loaded weights are equal but lie elsewhere
    # (a .safetensors file's tensors are views at offsets not 64-byte aligned), and MKL's sgemm takes another path,
    # summing in another order, on unaligned operands (1e-7 apart on some inputs, whatever the thread count).
    torch.testing.assert_close(back.build()(ids), original(ids), rtol=1e-6, atol=1e-6)


def inspect_cli(path):
    return run_cli("inspect", path)


def assert_one_line_error(result, *needles):
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def pt_with(tmp_path, ckpt, mutate):
    obj = {
        "format": "taperfold-checkpoint",
        "format_version": 1,
        "config": ckpt.config.to_dict(),
        "gate": 0.0,
        "step": 1,
        "meta": {},
        "state_dict": {k: v.clone() for k, v in ckpt.state_dict.items()},
    }
    mutate(obj)
    path = tmp_path / "bad.pt"
    torch.save(obj, path)
    return path


def test_missing_file(tmp_path):
    assert_one_line_error(inspect_cli(tmp_path / "nope.pt"), "nope.pt", "no such file")


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "random.pt"
    path.write_bytes(b"\x00garbage" * 100)
    assert_one_line_error(inspect_cli(path), "random.pt", "not a readable checkpoint")
    other = tmp_path / "list.pt"
    torch.save([1, 2, 3], other)
    assert_one_line_error(inspect_cli(other), "list.pt", "not a taperfold checkpoint")


def test_truncated(tmp_path, ckpt):
    for name in ("t.pt", "t.safetensors"):
        full = save_checkpoint(ckpt, tmp_path / name)
        data = full.read_bytes()
        full.write_bytes(data[: len(data) // 2])
        assert_one_line_error(inspect_cli(full), name, "truncated or corrupt")


class RunsCode:
    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pickle_that_would_run_code_is_refused_and_not_run(tmp_path, ckpt):
    marker = tmp_path / "pwned"
    evil = RunsCode()
    evil.marker = str(marker)
    RunsCode.marker = str(marker)
    path = tmp_path / "evil.pt"
    torch.save({"format": "taperfold-checkpoint", "payload": evil}, path)
    assert_one_line_error(inspect_cli(path), "evil.pt", "refused")
    assert not marker.exists()
    # the installed entry point, in a fresh process, behaves the same
    result = subprocess.run(
        [sys.executable, "-m", "taperfold.cli", "inspect", str(path)], capture_output=True, text=True, timeout=HANG_S
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr and not marker.exists()


def test_missing_extra_and_misshaped_keys(tmp_path, ckpt):
    key = "model.layers.1.mlp.up_proj.weight"
    path = pt_with(tmp_path, ckpt, lambda o: o["state_dict"].pop(key))
    assert_one_line_error(inspect_cli(path), "bad.pt", "missing key", key)
    path = pt_with(tmp_path, ckpt, lambda o: o["state_dict"].__setitem__("model.extra.weight", torch.zeros(2)))
    assert_one_line_error(inspect_cli(path), "unexpected key", "model.extra.weight")
    path = pt_with(tmp_path, ckpt, lambda o: o["state_dict"].__setitem__(key, torch.zeros(3, 3)))
    assert_one_line_error(inspect_cli(path), key, "shape [3, 3]")
    path = pt_with(tmp_path, ckpt, lambda o: o.pop("gate"))
    assert_one_line_error(inspect_cli(path), "missing key 'gate'")
    path = pt_with(tmp_path, ckpt, lambda o: o.__setitem__("gate", 1.5))
    assert_one_line_error(inspect_cli(path), "'gate'", "[0, 1]")
    path = pt_with(tmp_path, ckpt, lambda o: o["config"].__setitem__("arch", "bert"))
    assert_one_line_error(inspect_cli(path), "config", "bert")


HUGE = 10**400  # past the largest float: JSON and pickle read it as an int, math.isfinite overflows on it


@pytest.mark.parametrize("layout", ["bad.pt", "baddir"])
@pytest.mark.parametrize("key", ["gate", "rope_theta", "aux_weight"])
def test_a_number_too_large_for_a_float_is_one_line(tmp_path, ckpt, layout, key):
    """An OverflowError traceback before: each number is checked as one, not converted to a float to be asked."""
    path = save_checkpoint(ckpt, tmp_path / layout)
    header = (
        torch.load(path, weights_only=True) if layout == "bad.pt" else json.loads((path / "config.json").read_text())
    )
    (header if key == "gate" else header["config"])[key] = HUGE
    if layout == "bad.pt":
        torch.save(header, path)
    else:
        (path / "config.json").write_text(json.dumps(header))
    assert_one_line_error(inspect_cli(path), layout, key, "must be a number in")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_norm_parameter(tmp_path, ckpt, bad):
    key = "model.layers.0.post_attention_layernorm.weight_tilde"

    def poison(o):
        o["state_dict"][key][3] = bad

    assert_one_line_error(inspect_cli(pt_with(tmp_path, ckpt, poison)), key, "NaN or Inf")


def test_safetensors_and_directory_problems(tmp_path, ckpt):
    tensors = {k: v.contiguous() for k, v in ckpt.state_dict.items() if k != "lm_head.weight"}
    plain = tmp_path / "plain.safetensors"
    save_file(tensors, str(plain))  # no taperfold metadata
    assert_one_line_error(inspect_cli(plain), "plain.safetensors", "not a taperfold checkpoint")
    folder = save_checkpoint(ckpt, tmp_path / "folder")
    (folder / "config.json").write_text("{not json")
    assert_one_line_error(inspect_cli(folder), "config.json", "not valid JSON")
    (folder / "config.json").unlink()
    assert_one_line_error(inspect_cli(folder), "config.json", "missing")


def test_library_raises_taperfold_error(tmp_path):
    with pytest.raises(TaperfoldError, match="no such file"):
        load_checkpoint(tmp_path / "x.safetensors")


def test_inspect_json(tmp_path, ckpt):
    path = save_checkpoint(ckpt, tmp_path / "ok.pt")
    result = run_cli("inspect", path, "--json")
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["arch"] == "llama" and info["gate"] == 0.0
    by_name = {n["name"]: n for n in info["norms"]}
    assert by_name["model.layers.0.input_layernorm"]["foldable"] is False  # calibrated flag never set here
    assert by_name["model.norm"]["kind"] == "RMSNorm" and not by_name["model.norm"]["foldable"]
    assert by_name["model.layers.1.input_layernorm"]["c"] == pytest.approx(0.8)
    # the same report, typed: what `inspect`'s table reads
    from taperfold.describe import describe
    from taperfold.sources import open_source

    described = describe(open_source(path))
    assert json.loads(json.dumps(described.to_json())) == info
    assert (described.arch, described.gate, described.norm, described.how_to_taper) == ("llama", 0.0, None, None)
    assert described.foldable == info["foldable"] and described.kept == len(described.norms) - described.foldable
    final = next(n for n in described.norms if n.name == "model.norm")
    assert (final.kind, final.tapered, final.foldable, final.alpha) == ("RMSNorm", False, False, None)


def test_a_gate_that_is_a_bool_is_refused(tiny_checkpoint, tmp_path, cli):
    obj = torch.load(tiny_checkpoint, weights_only=True)
    obj["gate"] = True  # a bool is an int in Python, and 0 <= True <= 1
    torch.save(obj, tmp_path / "g.pt")
    one_line(cli("inspect", tmp_path / "g.pt"), "key 'gate' must be a number in [0, 1], got True")
