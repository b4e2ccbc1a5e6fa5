"""Bad Hugging Face directories: a save_pretrained directory is input and is held to the rules of
taperfold's own checkpoints (docs/guarantees.md). Every numeric config key the model construction reads is
checked before anything is built, even on the meta device; a config far larger than its weights is refused
before building; NaN or Inf in any floating-point weight, a tapered norm's c outside (0, 1e6] and a malformed
shard index are one line naming the file and the key; save_hf_directory writes no NaN.

Each case goes through `taperfold inspect DIR` and `taperfold export DIR -o OUT`: exit 2, exactly one stderr
line naming the file and the key, nothing on stdout, no OUT, the directory unchanged, within seconds.
Tiny random models built from configs (tests/hf_models.py): nothing is downloaded.
"""

import contextlib
import json
import shutil
import signal
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import HANG_S  # noqa: E402
from hf_models import tapered_tiny_model, tiny_config  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from taperfold.errors import TaperfoldError  # noqa: E402
from taperfold.hf import save_hf_directory  # noqa: E402

# Every refusal here reads a config or a few KB of weights: well under a second of CPU time when nothing hangs. The
# limit is on this process's CPU time (all threads), which a loaded machine does not stretch as it does the wall
# clock; a process blocked without computing is caught by conftest.HANG_S of the wall clock.
LIMIT_S = 30


class Hung(BaseException):
    """A command used LIMIT_S of CPU time, or HANG_S of the wall clock (a BaseException: nothing on the way catches
    it)."""


class Built(BaseException):
    """A model was built from a config that must be refused before any model is built."""


@contextlib.contextmanager
def _time_limit(cpu_seconds):
    """Hung once this process has used `cpu_seconds` of CPU time (ITIMER_PROF: every thread's), or after HANG_S of
    the wall clock."""

    def expire(signum, frame):
        if signum == signal.SIGPROF:
            raise Hung(f"still running after {cpu_seconds} s of CPU time")
        raise Hung(f"timed out: still running after {HANG_S} s (a hang guard, not a speed check)")

    previous = {s: signal.signal(s, expire) for s in (signal.SIGPROF, signal.SIGALRM)}
    signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
    signal.alarm(HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.setitimer(signal.ITIMER_PROF, 0)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _config(folder):
    return json.loads((folder / "config.json").read_text())


def _write_config(folder, config):
    (folder / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them


def _set(config, key, value):
    """config[key] = value, where key may be dotted ('rope_parameters.rope_theta')."""
    *parents, last = key.split(".")
    for parent in parents:
        config = config[parent]
    config[last] = value


def _poison(shard, key, value):
    tensors = load_file(str(shard))
    assert key in tensors, sorted(tensors)
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """Tiny directories, built once; tests break copies (`copy_of`)."""
    root = tmp_path_factory.mktemp("hostile")
    for family in ("llama", "gpt2", "opt", "gpt_neox", "mixtral", "gemma3", "gemma4_text"):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(tiny_config(family)).save_pretrained(root / f"{family}-plain")
    save_hf_directory(tapered_tiny_model("llama"), root / "llama-tapered", step=3)
    save_hf_directory(tapered_tiny_model("llama"), root / "llama-sharded", max_shard_size="40KB")
    assert len(list((root / "llama-sharded").glob("model-*.safetensors"))) > 1
    return root


@pytest.fixture
def copy_of(originals, tmp_path):
    """copy_of("llama-plain"): a private copy of a directory, free to break."""
    return lambda name: shutil.copytree(originals / name, tmp_path / name)


def _refused(cli, tmp_path, folder, file, key, *needles, monkeypatch=None):
    """inspect and export of `folder`: exit 2, one line naming `file` and `key`, nothing written, quickly.
    With `monkeypatch`, building a model at all fails the test (the config must be refused before)."""
    if monkeypatch is not None:

        def build(*args, **kwargs):
            raise Built("a model was built from a config that must be refused first")

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", build)
    before = _snapshot(folder)
    out = tmp_path / "out"
    lines = []
    for args in (["inspect", folder], ["export", folder, "-o", out]):
        start = time.process_time()
        with _time_limit(LIMIT_S):
            result = cli(*args)
        assert time.process_time() - start < LIMIT_S
        assert result.exit_code == 2, (args[0], result.stdout, result.stderr)
        err = result.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("taperfold: error: "), (args[0], result.stderr)
        assert str(file) in err[0] and (key is None or f"'{key}'" in err[0]), (args[0], err[0])
        for needle in needles:
            assert needle in err[0], (args[0], err[0])
        assert result.stdout == "", (args[0], result.stdout)
        assert not out.exists(), args[0]  # nothing written
        lines.append(err[0])
    assert _snapshot(folder) == before  # the input untouched
    assert lines[0] == lines[1]  # one check, whichever command
    return lines[0]


# Each numeric key at 0, negative, fractional, integral float, a string, a bool, huge (far past the bound, and
# just past it).
INT_VALUES = [0, -3, 2.5, 2.0, "8", True, 10**9, 10**30]
INT_KEYS = {  # the key as config.json spells it -> the first out-of-range value
    "num_hidden_layers": 1025,
    "num_attention_heads": 1025,
    "num_key_value_heads": 1025,
    "hidden_size": 65537,
    "intermediate_size": 2**18 + 1,
    "vocab_size": 2**24 + 1,
    "max_position_embeddings": 2**20 + 1,
    "head_dim": 65537,
}
# Floats: 0, negative, a string, a bool, huge, NaN, Infinity (JSON as Python writes it)
FLOAT_VALUES = [0, 0.0, -1e-6, "1e-6", True, 1e300, float("nan"), float("inf"), float("-inf")]
FLOAT_KEYS = {"rms_norm_eps": 1.5, "rope_parameters.rope_theta": 1e13, "rope_theta": 1e13}
# Other families spell their keys their own way (transformers' attribute_map): GPT-2, OPT, GPT-NeoX.
ALIASES = [
    ("gpt2", "n_layer", 0),
    ("gpt2", "n_layer", 10**9),
    ("gpt2", "n_embd", "32"),
    ("gpt2", "n_embd", -32),
    ("gpt2", "n_head", 0),
    ("gpt2", "n_head", 1.5),
    ("gpt2", "n_positions", 0),
    ("gpt2", "n_positions", 2**40),
    ("gpt2", "n_inner", 0),
    ("gpt2", "n_inner", 2**40),
    ("gpt2", "vocab_size", -1),
    ("gpt2", "layer_norm_epsilon", 0.0),
    ("gpt2", "layer_norm_epsilon", -1.0),
    ("gpt2", "layer_norm_epsilon", 1e300),
    ("opt", "ffn_dim", 0),
    ("opt", "ffn_dim", 3.5),
    ("opt", "ffn_dim", 10**12),
    ("opt", "hidden_size", False),
    ("gpt_neox", "layer_norm_eps", 0.0),
    ("gpt_neox", "layer_norm_eps", "small"),
    ("gpt_neox", "layer_norm_eps", 2.0),
    ("gpt_neox", "rope_parameters.partial_rotary_factor", 0.0),
    ("gpt_neox", "rope_parameters.partial_rotary_factor", 1.5),
    ("gpt_neox", "rope_parameters.rope_theta", -10000.0),
    ("gpt_neox", "rotary_pct", 0.0),
    ("gpt_neox", "rotary_emb_base", 0),
    ("gpt_neox", "intermediate_size", -64),
]


class TestHuggingFaceDirectories:
    # ---- the config: types and ranges, before anything is built -----------------------------------------

    @pytest.mark.parametrize("value", [*INT_VALUES, "past the bound"], ids=repr)
    @pytest.mark.parametrize("key", INT_KEYS)
    def test_integer_config_key(self, cli, tmp_path, copy_of, monkeypatch, key, value):
        folder = copy_of("llama-plain")
        config = _config(folder)
        assert key in config  # the directory as save_pretrained wrote it has every key tested here
        _set(config, key, INT_KEYS[key] if value == "past the bound" else value)
        _write_config(folder, config)
        _refused(cli, tmp_path, folder, folder / "config.json", key, "must be", monkeypatch=monkeypatch)

    @pytest.mark.parametrize("value", [*FLOAT_VALUES, "past the bound"], ids=repr)
    @pytest.mark.parametrize("key", FLOAT_KEYS)
    def test_float_config_key(self, cli, tmp_path, copy_of, monkeypatch, key, value):
        folder = copy_of("llama-plain")
        config = _config(folder)
        _set(config, key, FLOAT_KEYS[key] if value == "past the bound" else value)
        _write_config(folder, config)
        _refused(cli, tmp_path, folder, folder / "config.json", key, "must be a number", monkeypatch=monkeypatch)

    @pytest.mark.parametrize("family, key, value", ALIASES, ids=lambda x: repr(x) if not isinstance(x, str) else x)
    def test_config_key_as_the_family_spells_it(self, cli, tmp_path, copy_of, monkeypatch, family, key, value):
        folder = copy_of(f"{family}-plain")
        config = _config(folder)
        _set(config, key, value)
        _write_config(folder, config)
        _refused(cli, tmp_path, folder, folder / "config.json", key, "must be", monkeypatch=monkeypatch)

    def test_a_billion_layers_fail_before_building(self, cli, tmp_path, copy_of, monkeypatch):
        """It made `inspect` run for minutes: it must be refused from config.json alone."""
        folder = copy_of("llama-tapered")
        _write_config(folder, {**_config(folder), "num_hidden_layers": 10**9})
        start = time.process_time()  # CPU time: the work done, whatever else the machine runs
        _refused(cli, tmp_path, folder, folder / "config.json", "num_hidden_layers", monkeypatch=monkeypatch)
        assert time.process_time() - start < 10

    @pytest.mark.parametrize(
        "change, key, needle",
        [
            ({"hidden_size": 30}, "hidden_size", "not a multiple of 'num_attention_heads' (4)"),  # head_dim given
            ({"hidden_size": 30, "head_dim": None}, "hidden_size", "not a multiple of 'num_attention_heads' (4)"),
            (
                {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
                "hidden_size",
                "not a multiple of 'num_attention_heads' (3)",
            ),
            ({"num_key_value_heads": 3}, "num_key_value_heads", "does not divide 'num_attention_heads' (4)"),
            ({"pad_token_id": 256}, "pad_token_id", "token id"),
            ({"pad_token_id": "0"}, "pad_token_id", "token id"),
            ({"rope_parameters": [10000.0]}, "rope_parameters", "must be null or an object"),
        ],
    )
    def test_inconsistent_config(self, cli, tmp_path, copy_of, monkeypatch, change, key, needle):
        folder = copy_of("llama-plain")
        _write_config(folder, {**_config(folder), **change})
        _refused(cli, tmp_path, folder, folder / "config.json", key, needle, monkeypatch=monkeypatch)

    @pytest.mark.parametrize(
        "family, change, key, needle",
        [
            (
                "mixtral",
                {"num_experts_per_tok": 5},
                "num_experts_per_tok",
                "is 5, more than the 4 experts 'num_local_experts' gives",
            ),
            ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok", "must be an integer"),
            ("mixtral", {"num_local_experts": "4"}, "num_local_experts", "must be an integer"),
            ("llama", {"intermediate_size": [64]}, "intermediate_size", "a per-layer list needs one per layer (2)"),
            ("llama", {"intermediate_size": [64, 0]}, "intermediate_size[1]", "must be an integer"),
            ("llama", {"intermediate_size": [64, "64"]}, "intermediate_size[1]", "must be an integer"),
            ("llama", {"intermediate_size": []}, "intermediate_size", "a per-layer list needs one per layer"),
        ],
    )
    def test_moe_and_per_layer_keys(self, cli, tmp_path, copy_of, monkeypatch, family, change, key, needle):
        folder = copy_of(f"{family}-plain")
        _write_config(folder, {**_config(folder), **change})
        _refused(cli, tmp_path, folder, folder / "config.json", key, needle, monkeypatch=monkeypatch)

    @pytest.mark.parametrize(
        "key, value, needle",
        [
            ("text_config.num_hidden_layers", 10**9, "must be"),
            ("text_config.num_key_value_heads", 3, "does not divide 'text_config.num_attention_heads' (4)"),
            ("text_config.rms_norm_eps", -1.0, "must be a number"),
            ("text_config.vocab_size", 2**24, "does not match the weights"),
        ],
    )
    def test_a_multimodal_configs_text_config_is_checked_key_by_key(
        self, cli, tmp_path, copy_of, monkeypatch, key, value, needle
    ):
        # Gemma 3's config.json has its language model's sizes under text_config only
        folder = copy_of("gemma3-plain")
        config = _config(folder)
        _set(config, key, value)
        _write_config(folder, config)
        _refused(cli, tmp_path, folder, folder / "config.json", key, needle, monkeypatch=monkeypatch)

    @pytest.mark.parametrize(
        "key, value, needle",
        [
            ("head_dim", 0, "'head_dim[1]' must be an integer"),
            (
                "num_key_value_heads",
                3,
                "'num_key_value_heads' is 3 in layer 1, which does not divide 'num_attention_heads' (4)",
            ),
        ],
    )
    def test_a_per_layer_attention_size_is_checked_layer_by_layer(
        self, cli, tmp_path, copy_of, monkeypatch, key, value, needle
    ):
        # Gemma 4's per_layer_config: reading such a key on the whole config raised transformers' own error
        folder = copy_of("gemma4_text-plain")
        config = _config(folder)
        config["per_layer_config"]["1"][key] = value
        _write_config(folder, config)
        _refused(cli, tmp_path, folder, folder / "config.json", None, needle, monkeypatch=monkeypatch)

    def test_a_model_type_without_a_causal_lm_class_is_one_line(self, cli, tmp_path):
        # a vision encoder whose config.json passes every key check: there is no causal LM to build from it
        config = transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=32,
            patch_size=8,
        )
        folder = tmp_path / "vit"
        transformers.ViTModel(config).save_pretrained(folder)
        _write_config(folder, {**_config(folder), "vocab_size": 64, "max_position_embeddings": 64})
        _refused(
            cli,
            tmp_path,
            folder,
            folder / "config.json",
            "model_type",
            "'vit', for which transformers has no causal language model",
        )

    @pytest.mark.parametrize("key", ["n_embd", "n_head"])
    def test_gpt2_heads_must_divide_the_width(self, cli, tmp_path, copy_of, monkeypatch, key):
        folder = copy_of("gpt2-plain")
        _write_config(folder, {**_config(folder), key: 30 if key == "n_embd" else 3})
        _refused(
            cli,
            tmp_path,
            folder,
            folder / "config.json",
            "n_embd",
            "not a multiple of 'n_head'",
            monkeypatch=monkeypatch,
        )

    @pytest.mark.parametrize(
        "key, value",
        [
            ("num_hidden_layers", 1000),
            ("num_hidden_layers", 1024),
            ("vocab_size", 2**24),
            ("hidden_size", 65536),
            ("intermediate_size", 2**18),
            ("head_dim", 4096),
        ],
    )
    def test_config_far_larger_than_the_weights(self, cli, tmp_path, copy_of, monkeypatch, key, value):
        """In range, but the weights cannot hold such a model: refused before it is built, even on meta."""
        folder = copy_of("llama-plain")
        _write_config(folder, {**_config(folder), key: value})
        _refused(
            cli,
            tmp_path,
            folder,
            folder / "config.json",
            key,
            "does not match the weights",
            str(folder / "model.safetensors"),
            monkeypatch=monkeypatch,
        )

    @pytest.mark.parametrize(
        "text",
        [
            '{"weight_map": {"model.norm.weight": ' + "9" * 5000 + "}}",
            '{"weight_map": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}",
        ],
        ids=["5000-digit integer", "nested 100000 deep"],
    )
    def test_index_python_cannot_parse(self, cli, tmp_path, copy_of, text):
        """JSON that Python's parser refuses with a ValueError (the 4300-digit limit) or a RecursionError, not a
        JSONDecodeError: one line all the same (no key to name)."""
        folder = copy_of("llama-sharded")
        index = folder / "model.safetensors.index.json"
        index.write_text(text)
        assert "not valid JSON" in _refused(cli, tmp_path, folder, index, None)

    @pytest.mark.parametrize(
        "text",
        [
            '{"model_type": "llama", "num_hidden_layers": ' + "9" * 5000 + "}",
            '{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
        ],
        ids=["5000-digit integer", "nested 100000 deep"],
    )
    def test_config_python_cannot_parse(self, copy_of, text):
        """The same in config.json, through the API (through the CLI, such a directory is no Hugging Face
        directory; taperfold's own checkpoint reader, taperfold.fsutil.read_json_object, reports it)."""
        from taperfold.hf import load_hf_directory

        folder = copy_of("llama-plain")
        (folder / "config.json").write_text(text)
        with pytest.raises(TaperfoldError) as e:
            load_hf_directory(folder)
        line = str(e.value)
        assert len(line.splitlines()) == 1 and line.startswith(f"{folder / 'config.json'}: not valid JSON"), line

    # ---- the weights: NaN and Inf anywhere, c out of range -----------------------------------------------

    @pytest.mark.parametrize(
        "name, key, value",
        [
            ("llama-plain", "model.layers.0.self_attn.q_proj.weight", float("nan")),
            ("llama-plain", "model.embed_tokens.weight", float("inf")),
            ("llama-plain", "model.norm.weight", float("-inf")),
            ("gpt2-plain", "transformer.h.1.mlp.c_fc.bias", float("nan")),
            ("gpt_neox-plain", "embed_out.weight", float("nan")),  # named as the file has it (the model's lm_head)
            ("llama-tapered", "model.layers.1.mlp.down_proj.weight", float("nan")),
            ("llama-tapered", "model.layers.0.input_layernorm.weight", float("inf")),  # γ of a tapered norm
            ("llama-tapered", "model.layers.0.input_layernorm.ema_num", float("nan")),  # a float64 buffer
            ("llama-tapered", "model.norm.weight", float("nan")),  # the kept final norm
        ],
    )
    def test_nan_or_inf_in_a_weight(self, cli, tmp_path, copy_of, name, key, value):
        folder = copy_of(name)
        _poison(folder / "model.safetensors", key, value)
        _refused(cli, tmp_path, folder, folder / "model.safetensors", key, "NaN or Inf")

    @pytest.mark.parametrize(
        "stacked, one_by_one",
        [
            ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.block_sparse_moe.experts.0.w1.weight"),
            ("model.layers.1.mlp.experts.down_proj", "model.layers.1.block_sparse_moe.experts.0.w2.weight"),
        ],
    )
    def test_experts_stored_stacked_and_one_by_one_are_refused(self, cli, tmp_path, copy_of, stacked, one_by_one):
        # save_pretrained writes the experts one by one; the model's own stacked tensor beside them is a second,
        # different copy of the same weights: which one would be used cannot be told
        folder = copy_of("mixtral-plain")
        shard = folder / "model.safetensors"
        tensors = load_file(str(shard))
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral"))
        tensors[stacked] = model.state_dict()[stacked].contiguous()
        save_file(tensors, str(shard), metadata={"format": "pt"})
        _refused(cli, tmp_path, folder, shard, stacked, one_by_one, "both hold the model's")

    def test_nan_in_a_shard_names_the_shard(self, cli, tmp_path, copy_of):
        folder = copy_of("llama-sharded")
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        key = "model.layers.1.mlp.up_proj.weight"
        shard = folder / weight_map[key]
        assert shard.name != min(weight_map.values())  # not the first shard read
        _poison(shard, key, float("nan"))
        _refused(cli, tmp_path, folder, shard, key, "NaN or Inf")

    @pytest.mark.parametrize("value", [0.0, -1.0, 2e6, 1e38])
    def test_tapered_c_out_of_range(self, cli, tmp_path, copy_of, value):
        folder = copy_of("llama-tapered")
        key = "model.layers.1.input_layernorm.c"
        _poison(folder / "model.safetensors", key, value)
        _refused(cli, tmp_path, folder, folder / "model.safetensors", key, "(0, 1e+06]")

    # ---- the shard index -----------------------------------------------------------------------------------

    @pytest.mark.parametrize("value", [["model-00001-of-00002.safetensors"], {"file": "x.safetensors"}], ids=repr)
    def test_shard_index_names_no_file(self, cli, tmp_path, copy_of, value):
        folder = copy_of("llama-sharded")
        index = folder / "model.safetensors.index.json"
        content = json.loads(index.read_text())
        content["weight_map"]["model.norm.weight"] = value
        index.write_text(json.dumps(content))
        _refused(cli, tmp_path, folder, index, "weight_map.model.norm.weight", "must be the name of a shard file")

    # ---- saving --------------------------------------------------------------------------------------------

    @pytest.mark.parametrize("what", ["parameter", "buffer", "gate"])
    def test_save_refuses_nan(self, tmp_path, what):
        model = tapered_tiny_model("llama")
        with torch.no_grad():
            if what == "parameter":
                name = "model.layers.1.self_attn.v_proj.weight"
                model.get_parameter(name)[3, 4] = float("nan")
            elif what == "buffer":
                name = "model.layers.0.post_attention_layernorm.c"
                model.get_buffer(name).fill_(float("inf"))
            else:
                name = "taperfold.gate"
                model.tapering.set_gate(float("nan"))
        out = tmp_path / "out"
        with pytest.raises(TaperfoldError) as e:
            save_hf_directory(model, out)
        line = str(e.value)
        assert len(line.splitlines()) == 1 and str(out) in line and f"'{name}'" in line, line
        if what != "gate":
            assert f"{what} '{name}' contains NaN or Inf" in line
        assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written, no temporary left
        assert "taperfold" not in model.config.to_dict()  # the model untouched


def test_a_conversion_joining_named_tensors_is_no_expert_stack():
    # Bailing-hybrid joins each layer's q/k/v conv1d into one tensor with a pattern that numbers nothing: one key a
    # pattern is right there; two keys for one pattern are one line naming both (was: IndexError).
    from taperfold.hf.weights import _check_expert_indices

    origin = {f"model.layers.0.self_attn.{n}_conv1d.weight": "model.safetensors" for n in "qkv"}
    _check_expert_indices(
        {f"{n}_conv1d.weight": [f"model.layers.0.self_attn.{n}_conv1d.weight"] for n in "qkv"}, origin
    )
    origin["model.layers.0.attention.q_conv1d.weight"] = "model.safetensors"
    twice = ["model.layers.0.attention.q_conv1d.weight", "model.layers.0.self_attn.q_conv1d.weight"]
    with pytest.raises(TaperfoldError, match=r"both hold 'q_conv1d\.weight'") as e:
        _check_expert_indices({"q_conv1d.weight": twice}, origin)
    assert str(e.value).startswith("model.safetensors: keys 'model.layers.0.attention.q_conv1d.weight' and")


def test_a_float_transformers_tags_in_config_json_reads_as_that_float(copy_of):
    # transformers writes inf / nan as {"__float__": "Infinity"} (Bamba's time_step_limit: [0.0, inf]) and decodes
    # them when it reads; taperfold reads config.json itself (was: "not a valid bamba config")
    import math

    from taperfold.hf import load_hf_directory

    folder = copy_of("llama-plain")
    config = _config(folder)
    config["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    config["scales"] = {"low": {"__float__": "-Infinity"}, "odd": {"__float__": "NaN"}, "kept": {"__float__": "x"}}
    _write_config(folder, config)
    read = load_hf_directory(folder).hf_config_dict  # the config the model is built from
    assert read["time_step_limit"] == [0.0, math.inf]
    assert read["scales"]["low"] == -math.inf and math.isnan(read["scales"]["odd"])
    assert read["scales"]["kept"] == {"__float__": "x"}  # no tag transformers writes: left as it is
