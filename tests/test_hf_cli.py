"""Hugging Face directories through the command line: bad input (one line, exit 2, nothing written),
a plain directory (baseline only), inspect, and `taperfold train --from` with the directory's tokenizer."""

import json
import shutil
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import one_line  # noqa: E402
from hf_models import tapered_tiny_model, tiny_config  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from taperfold.hf import save_hf_directory  # noqa: E402


@pytest.fixture(scope="module")
def tapered_dir(tmp_path_factory):
    return save_hf_directory(tapered_tiny_model("llama"), tmp_path_factory.mktemp("hf") / "tapered", step=3)


@pytest.fixture
def broken(tapered_dir, tmp_path):
    """A private copy of the tapered directory, free to break."""
    return shutil.copytree(tapered_dir, tmp_path / "in")


def _config(folder):
    return json.loads((folder / "config.json").read_text())


def _write_config(folder, config):
    (folder / "config.json").write_text(json.dumps(config))


def _refused(cli, tmp_path, folder, *needles, command="export"):
    out = tmp_path / "out"
    args = {
        "export": ["export", folder, "-o", out],
        "inspect": ["inspect", folder],
        "train-from": ["train", "--from", folder, "--steps", "30", "--out", out],
    }[command]
    result = cli(*args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taperfold: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists()  # nothing written
    return lines[0]


def test_directory_without_config(cli, tmp_path, broken):
    (broken / "config.json").unlink()
    _refused(cli, tmp_path, broken, "config.json", "missing")


def test_directory_without_weights(cli, tmp_path, broken):
    (broken / "model.safetensors").unlink()
    _refused(cli, tmp_path, broken, str(broken), "no weights", "model.safetensors")


def test_unknown_model_type(cli, tmp_path, broken):
    # BERT is no family taperfold ships, and tracing finds none (its LayerNorms read the residual Add's output)
    _write_config(broken, {**_config(broken), "model_type": "bert"})
    line = _refused(
        cli,
        tmp_path,
        broken,
        "config.json",
        "'model_type'",
        "'bert'",
        "tracing its model found none",
        "docs/hf.md, section 'Adding a family'",
    )
    for family in ("llama", "gpt2", "gpt_neox", "opt", "gemma", "qwen3", "phi3"):
        assert family in line


def test_model_type_transformers_does_not_know(cli, tmp_path, broken):
    _write_config(broken, {**_config(broken), "model_type": "no_such_arch"})
    _refused(
        cli,
        tmp_path,
        broken,
        "config.json",
        "'model_type'",
        "'no_such_arch'",
        "no config class",
        "docs/hf.md, section 'Adding a family'",
    )


def test_auto_map_is_refused(cli, tmp_path, broken):
    _write_config(broken, {**_config(broken), "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}})
    _refused(cli, tmp_path, broken, "config.json", "'auto_map'", "never runs code")


@pytest.mark.parametrize("change", ["missing", "misshaped"])
def test_missing_or_misshaped_tapered_key(cli, tmp_path, broken, change):
    tensors = load_file(str(broken / "model.safetensors"))
    key = "model.layers.1.post_attention_layernorm.weight_tilde"
    if change == "missing":
        del tensors[key]
    else:
        tensors[key] = torch.ones(31)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    _refused(cli, tmp_path, broken, "model.safetensors", key, "missing" if change == "missing" else "shape [31]")


def test_gate_not_zero_needs_force_gate0(cli, tmp_path, broken):
    config = _config(broken)
    config["taperfold"]["gate"] = 0.25
    _write_config(broken, config)
    _refused(cli, tmp_path, broken, str(broken), "gate is 0.25, not 0", "--force-gate0")


@pytest.mark.parametrize(
    "block, key",
    [
        ("not an object", "'taperfold'"),
        ({"gate": "zero"}, "'taperfold.gate'"),
        ({"gate": 1.5}, "'taperfold.gate'"),
        ({"gate": 10**400}, "'taperfold.gate'"),  # past the largest float: an OverflowError traceback before
        ({"taper": "final"}, "'taperfold.taper'"),
        ({"format_version": 2}, "'taperfold.format_version'"),
        ({"step": -1}, "'taperfold.step'"),
        ({"schedule": {"taper_start": 9, "taper_end": 3}}, "'taperfold.schedule'"),
        ({"aux": {"weight": "big"}}, "'taperfold.aux'"),
        ({"aux": {"weight": 10**400}}, "'taperfold.aux'"),
        ({"calibration": {"momentum": 0.1, "delta": 10**400}}, "'taperfold.calibration.delta'"),
        ({"calibration": {"momentum": 2, "delta": 0}}, "'taperfold.calibration.momentum'"),
        ({"norm": "rms"}, "'taperfold.norm'"),  # a gated kind is the family's own: never named
        ({"norm": "dyt"}, "'taperfold.calibration'"),  # a DyT has no calibration
        ({"surprise": 1}, "'taperfold.surprise'"),
    ],
)
def test_malformed_taperfold_block(cli, tmp_path, broken, block, key):
    config = _config(broken)
    config["taperfold"] = block if isinstance(block, str) else {**config["taperfold"], **block}
    _write_config(broken, config)
    _refused(cli, tmp_path, broken, "config.json", key)


def test_tapered_keys_without_block(cli, tmp_path, broken):
    config = _config(broken)
    del config["taperfold"]
    _write_config(broken, config)
    _refused(cli, tmp_path, broken, "model.safetensors", "holds tapered key", "no 'taperfold' block")


def test_sharded_checkpoint_with_a_missing_shard(cli, tmp_path):
    folder = save_hf_directory(tapered_tiny_model("llama"), tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    _refused(cli, tmp_path, folder, "model.safetensors.index.json", "'weight_map.", shards[-1].name, "missing")


def test_sharded_checkpoint_loads(tmp_path, tapered_dir):
    from taperfold.hf import load_hf_directory

    folder = save_hf_directory(tapered_tiny_model("llama"), tmp_path / "sharded", max_shard_size="40KB")
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = load_hf_directory(folder).build()(ids)
        b = load_hf_directory(tapered_dir).build()(ids)
    # two models, the weights at other (unaligned: safetensors views) addresses: MKL may sum in another order
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_without_transformers_one_line_names_the_extra(cli, tmp_path, tapered_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    for command in ("export", "inspect"):
        _refused(cli, tmp_path, tapered_dir, "needs transformers", "pip install 'taperfold[hf]'", command=command)


def test_inspect_lists_tapered_and_kept_norms(cli, tapered_dir):
    result = cli("inspect", tapered_dir, "--json")
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    tapered = [n for n in info["norms"] if n["tapered"]]
    assert len(tapered) == 4 and all(n["foldable"] and n["c"] == pytest.approx(0.7) for n in tapered)
    assert tapered[0]["folds_into"] == [f"model.layers.0.self_attn.{x}_proj" for x in "qkv"]
    kept = [n for n in info["norms"] if not n["tapered"]]
    assert [n["name"] for n in kept] == ["model.norm"]


def test_plain_directory_exports_verifies_and_benches_the_baseline_only(cli, tmp_path):
    folder, out = tmp_path / "plain", tmp_path / "out"
    transformers.AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(folder)
    result = cli("export", folder, "-o", out, "--kv-cache")
    assert result.exit_code == 0, result.stderr
    assert "nothing to fold" in result.stdout
    assert sorted(p.name for p in out.glob("*.onnx")) == ["baseline.decoder.onnx", "baseline.onnx"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert "folded" not in manifest["artifacts"] and manifest["config"]["taper"] == "none"

    # verify: the transformers forward (the reference) against the baseline graph and its decoder
    result = cli("verify", out, "--threads", "1")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert "nothing folded to verify" in " ".join(result.stdout.split())
    report = json.loads((out / "verify.json").read_text())
    assert report["passed"] and "nothing folded to verify" in report["note"]
    pairs = {p["name"]: p for p in report["pairs"]}
    assert sorted(pairs) == ["checkpoint -> baseline", "checkpoint -> baseline.decoder"]
    assert all(p["status"] == "pass" and p["metrics"]["max_rel"] <= 1e-4 for p in pairs.values())

    # bench: one line saying only the baseline exists and what it can time; the baseline alone when asked
    fast = ["--batch", "1", "--seq", "8", "--warmup", "1", "--iters", "2", "--threads", "1"]
    result = cli("bench", out, *fast)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "only the baseline was exported" in lines[0] and "--variants baseline" in lines[0]
    assert not (out / "bench.json").exists()
    result = cli("bench", out, "--variants", "baseline", *fast)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    bench = json.loads((out / "bench.json").read_text())
    assert {row["variant"] for row in bench["results"]} == {"baseline"}


def _word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_train_from_directory_with_its_tokenizer(cli, tmp_path):
    words = [f"w{i}" for i in range(100)]
    folder = tmp_path / "plain"
    transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2")).save_pretrained(folder)
    _word_tokenizer(words).save_pretrained(folder)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(words[(i * 7) % 97] for i in range(4000)))
    out = tmp_path / "tapered"
    result = cli(
        "train", "--from", folder, "--data", data, "--steps", "30", "--batch-size", "2", "--out", out, "--json"
    )
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["tokenizer"] == "hf" and summary["gate"] == 0.0
    assert (out / "tokenizer.json").is_file()
    block = json.loads((out / "config.json").read_text())["taperfold"]
    assert block["gate"] == 0.0 and block["step"] == 30 and block["schedule"] == {"taper_start": 3, "taper_end": 24}
    # a tapered directory is not trained again, and --out never replaces the source
    _refused(cli, tmp_path, out, "already tapered", command="train-from")


def test_train_from_with_taper_none_fine_tunes_the_plain_model(cli, tmp_path):
    """The baseline of a tapered run: the same loop on the same data, nothing tapered, written as a plain directory
    that exports as a plain model (its baseline only)."""
    folder = tmp_path / "plain"
    transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(folder)
    out = tmp_path / "trained"
    result = cli("train", "--from", folder, "--taper", "none", "--steps", "30", "--batch-size", "2", "-o", out,
                 "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["taper"] == "none" and summary["gate"] == 1.0 and not summary["aux"]
    assert "taperfold" not in _config(out)
    before, after = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and not torch.equal(
        before["model.embed_tokens.weight"], after["model.embed_tokens.weight"]
    )
    inspect = json.loads(cli("inspect", out, "--json").stdout)
    assert inspect["taper"] == "none"


def test_verify_text_is_encoded_with_the_directorys_own_tokenizer(cli, tmp_path):
    """A directory with a word-level tokenizer: --text is its words, not its bytes (40 words, a 32-token context: a
    window of 32 and one of 8), and text that is not UTF-8 is one line naming the file."""
    words = [f"w{i}" for i in range(100)]
    _word_tokenizer(words).save_pretrained(tmp_path / "tokenizer")
    folder = save_hf_directory(tapered_tiny_model("llama"), tmp_path / "tapered", tokenizer_from=tmp_path / "tokenizer")
    out = tmp_path / "out"
    assert cli("export", folder, "-o", out, "--no-baseline").exit_code == 0
    text = tmp_path / "words.txt"
    text.write_text(" ".join(words[(i * 7) % 97] for i in range(40)))
    result = cli("verify", out, "--text", text, "--json", "--threads", "1")
    assert result.exit_code == 0, result.stderr
    assert [b["shape"] for b in json.loads(result.stdout)["inputs"]] == [[1, 32], [1, 8]]
    text.write_bytes(b"w1 \xff w2")
    one_line(cli("verify", out, "--text", text), str(text), "not UTF-8")


def test_train_from_refuses_bytes_that_do_not_fit(cli, tmp_path):
    folder = tmp_path / "plain"
    config = tiny_config("llama")
    config.vocab_size = 128
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    _refused(cli, tmp_path, folder, "'vocab_size'", "byte tokens", command="train-from")


def test_moe_directory_with_an_expert_missing(cli, tmp_path):
    # save_pretrained writes Mixtral's experts one by one; loading stacks them, and a gap would put the next expert
    # in the missing one's place with the right shape: refused, naming the key after the gap
    folder = tmp_path / "mixtral"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral")).save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.0.block_sparse_moe.experts"
    del tensors[f"{prefix}.1.w1.weight"]
    tensors[f"{prefix}.4.w1.weight"] = tensors[f"{prefix}.0.w1.weight"].clone()  # the count still matches
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _refused(
        cli, tmp_path, folder, "model.safetensors", f"'{prefix}.2.w1.weight'", "experts 0 ... 3", command="inspect"
    )


# ---- a plain directory described; Hub ids -------------------------------------------------------------------


def test_inspect_describes_a_plain_hugging_face_directory_and_how_to_taper_it(tmp_path, cli):
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_config

    transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "plain")
    r = cli("inspect", tmp_path / "plain", "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert (
        info["taper"] == "none"
        and info["foldable"] == 0
        and info["how_to_taper"].startswith(f"`taperfold train --from {tmp_path / 'plain'}")
    )
    layers = {n["name"]: n for n in info["norms"] if n["name"].startswith("model.layers.0.")}
    assert layers["model.layers.0.input_layernorm"]["folds_into"] == [
        f"model.layers.0.self_attn.{x}_proj" for x in "qkv"
    ]
    assert info["would_fold"] == 2 * len(
        {n.split(".")[2] for n in (m["name"] for m in info["norms"]) if n.startswith("model.layers.")}
    )
    r = cli("inspect", tmp_path / "plain")
    assert r.exit_code == 0 and "train --from" in r.stdout


def test_a_hub_model_id_resolves_through_the_local_cache_offline(tmp_path, monkeypatch, cli):
    transformers = pytest.importorskip("transformers")
    from hf_models import tiny_config

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants  # read once at import: what the environment says now

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)

    r = cli("inspect", "acme/tiny-llama", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["path"] == str(repo / "snapshots" / commit)
    r = cli(
        "train", "--from", "acme/tiny-llama", "--steps", "30", "--batch-size", "2", "-o", tmp_path / "tapered", "--json"
    )
    assert r.exit_code == 0, r.stderr
    assert json.loads((tmp_path / "tapered" / "config.json").read_text())["taperfold"]["gate"] == 0.0
    one_line(cli("inspect", "acme/not-cached"), "acme/not-cached: no such file or directory", "Hugging Face Hub cache")
