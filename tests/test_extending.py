"""Extension from outside the package (docs/extending.md): a family, a norm kind, an engine and an artifact kind are
each data (or one class) plus one registration, and the core never names them."""

import dataclasses
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import HANG_S

from taperfold import artifacts, engines, families, norms
from taperfold.errors import TaperfoldError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plugin_family.py"
ARTIFACT_EXAMPLE = ROOT / "examples" / "plugin_artifact.py"


def _example_module(path=EXAMPLE):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # where dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[path.stem]
    return module


@pytest.fixture
def registries():
    """Every registry as it was before the test: registrations by a test do not outlive it. The shipped artifact kinds
    are registered first (each by its module's import, once a process): a test that imports one leaves it registered."""
    for name in list(artifacts._SHIPPED):
        artifacts.artifact_kind(name)
    tables = (families._REGISTRY, norms._KINDS, engines.ENGINES, artifacts._KINDS)
    saved = [dict(table) for table in tables]
    yield
    for registry, before in zip(tables, saved):
        registry.clear()
        registry.update(before)


def test_the_example_family_is_named_nowhere_in_the_package():
    sources = list((ROOT / "taperfold").rglob("*.py"))
    assert sources and not [p for p in sources if "gptj" in p.read_text().lower()]


@pytest.mark.slow
def test_plugin_family_example_runs_the_whole_chain():
    pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, str(EXAMPLE)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS: every tapered norm folded and verify passed" in result.stdout
    assert "export: 2 folded, 0 kept" in result.stdout and "fold unfolded.onnx: 2 folded, 0 kept" in result.stdout


@pytest.mark.slow
def test_plugin_family_example_fails_on_a_wrong_declaration(registries, capsys):
    pytest.importorskip("transformers")
    example = _example_module()
    # the MLP's fc_in left out: the torch fold then rewrites attention's projections only, and the example must say so
    wrong = dataclasses.replace(example.GPTJ, internal={"ln_1": ("attn.q_proj", "attn.k_proj", "attn.v_proj")})
    families.register(wrong)
    assert example.main() == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL")


def test_an_unknown_model_type_is_refused_naming_the_guide():
    with pytest.raises(TaperfoldError, match=r"model_type' is 'mamba2'.*docs/extending.md") as info:
        families.family_for("mamba2", "config.json")
    assert "\n" not in str(info.value)


def test_a_registered_family_is_found_by_each_of_its_model_types(registries):
    family = families.Family(
        name="twin",
        model_types=("twin-a", "twin-b"),
        norm="rms",
        layers="model.layers",
        internal={"input_layernorm": ("self_attn.q_proj",)},
        final="model.norm",
    )
    families.register(family)
    assert families.family_for("twin-a") is family and families.family_for("twin-b") is family
    assert {"twin-a", "twin-b", "llama"} <= set(families.supported_model_types())
    assert family.norm_readers(2, "all") == {
        "model.layers.0.input_layernorm": ["model.layers.0.self_attn.q_proj"],
        "model.layers.1.input_layernorm": ["model.layers.1.self_attn.q_proj"],
        "model.norm": ["lm_head"],
    }


def test_a_registered_norm_kind_is_asked_where_it_is_registered(registries):
    rms = norms.norm_kind("rms")
    custom = dataclasses.replace(
        rms, name="scaled-rms", title="ScaledRMSNorm", class_names=lambda name: name.endswith("ScaledRMSNorm")
    )
    norms.register(custom)
    assert [k.name for k in norms.norm_kinds()] == ["dyt", "ln", "rms", "scaled-rms"]
    assert norms.kind_of_class("MyScaledRMSNorm") is not None
    norms.register(custom, before="rms")  # a special case of rms's pattern is tried first
    assert [k.name for k in norms.norm_kinds()] == ["dyt", "ln", "scaled-rms", "rms"]
    with pytest.raises(ValueError, match="norm kind must be one of dyt, ln, scaled-rms, rms"):
        norms.norm_kind("tanh")


def test_a_registered_engine_gets_its_runner_from_its_module(registries):
    opened = []
    module = SimpleNamespace(
        open_runner=lambda target, **kw: opened.append((target, kw)) or "runner",
        unavailable=lambda device: None if device == "cpu" else "needs the CPU",
    )
    engines.register(
        engines.Engine(
            "echo",
            "Echo",
            engines.MODELS,
            default_device="cpu",
            devices=("cpu",),
            decodes=False,
            options=(),
            module=module,
        )
    )
    echo = engines.engine("echo")
    assert echo.runner("model", threads=2) == "runner" and opened[0][0] == "model"
    assert opened[0][1]["device"] == "cpu" and opened[0][1]["threads"] == 2
    with pytest.raises(TaperfoldError, match="needs the CPU"):
        echo.require("cuda")


def test_a_family_with_post_norms_folds_them_backwards_into_their_producers(registries):
    """Gemma 2's post-norms read a projection's output before the residual Add: at g = 0 each is a diagonal map
    of that projection's output, so it folds into the projection's rows (the torch fold)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from taperfold.hf import taper_model
    from taperfold.hf.model import HFCausalLM, HFModelInfo
    from taperfold.nn import TaperNorm
    from taperfold.variants import fold_in_torch

    gemma2 = families.family_for("gemma2")
    assert gemma2.post == {
        "post_attention_layernorm": "self_attn.o_proj",
        "post_feedforward_layernorm": "mlp.down_proj",
    }
    config = transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    tapering = taper_model(hf, "all")
    assert set(tapering.producers) == {
        f"model.layers.{i}.post_{n}" for i in range(2) for n in ("attention_layernorm", "feedforward_layernorm")
    }
    with torch.no_grad():
        for norm in tapering.norms.values():
            norm.weight_tilde.uniform_(-0.5, 0.5)  # Gemma's gain is 1 + w
            norm.c.uniform_(0.5, 2.0)
    tapering.set_gate(0.0)
    info = HFModelInfo.from_config(config, gemma2, "all", aux=True, tokenizer="bytes")
    model = HFCausalLM(hf, info, gemma2)
    folded = fold_in_torch(model)
    assert not any(isinstance(m, TaperNorm) for m in folded.modules())
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = model(ids, logits="all"), folded(ids, logits="all")
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5
    with torch.no_grad():  # and a wrong producer shows: the same fold into the wrong layer is far off
        wrong = dataclasses.replace(
            gemma2,
            post={
                "post_attention_layernorm": "mlp.down_proj",  # swapped
                "post_feedforward_layernorm": "self_attn.o_proj",
            },
        )
        model.tapering.producers = wrong.norm_producers(2)
        off = fold_in_torch(model)(ids, logits="all")
    assert float((off - expected).abs().max() / expected.abs().max()) > 1e-3  # 100 times the bound above


@pytest.mark.parametrize(
    "internal, message",
    [
        ({"input_layernorm": ("self_attn.q_prj",)}, "has no module 'model.layers.0.self_attn.q_prj'"),
        ({"input_layernorm": ("self_attn",)}, "model.layers.0.self_attn is a LlamaAttention, not a linear layer"),
        (
            {"input_layernorm": ("mlp.down_proj",)},
            "model.layers.0.mlp.down_proj takes 512 features, but model.layers.0.input_layernorm gives 128",
        ),
    ],
)
def test_a_wrong_family_is_refused_in_one_line_before_anything_is_tapered(internal, message):
    from taperfold.models import MODEL_CLASSES, preset_config
    from taperfold.taper import taper_model

    model = MODEL_CLASSES["llama"](preset_config("tiny", arch="llama", taper="none"))
    wrong = dataclasses.replace(families.family_for("llama"), internal=internal)
    with pytest.raises(TaperfoldError, match=re.escape(message)) as info:
        taper_model(model, wrong, "internal", where="m")
    assert "\n" not in str(info.value) and getattr(model, "tapering", None) is None
    assert not model.tapered_norms()  # nothing was swapped


# ---- an artifact kind ----------------------------------------------------------------------------------------


def test_the_example_artifact_kind_is_named_nowhere_in_the_package():
    sources = list((ROOT / "taperfold").rglob("*.py"))
    assert sources and not [p for p in sources if "model-card" in p.read_text() or "ModelCard" in p.read_text()]


@pytest.mark.slow
def test_plugin_artifact_example_exports_reads_back_and_verifies_its_kind():
    result = subprocess.run(
        [sys.executable, str(ARTIFACT_EXAMPLE)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model-card: model-card.json" in result.stdout
    assert "verify: manifest -> model-card: pass; all pairs pass" in result.stdout


@pytest.mark.parametrize(
    "attribute, value, message",
    [
        ("built_from", "nowhere", "built_from 'nowhere' is neither 'torch', 'export' nor a registered kind"),
        ("name", "Model Card", "name 'Model Card' is not lowercase letters"),
        ("verified", "eyeballed", "verified 'eyeballed' is neither 'logits' nor 'checked'"),
        ("details_type", dict, "details_type dict is not a dataclass"),
        (
            "details_type",
            dataclasses.make_dataclass("Clash", [("path", str)], frozen=True),
            "details_type Clash: field 'path' is a key every artifact has",
        ),
        ("details_type", dataclasses.make_dataclass("Open", [("words", int)]), "details_type Open is not frozen"),
    ],
)
def test_plugin_artifact_example_fails_on_a_wrong_declaration(registries, capsys, attribute, value, message):
    example = _example_module(ARTIFACT_EXAMPLE)
    wrong = type("WrongCard", (example.ModelCard,), {attribute: value})()
    assert example.main(wrong) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "plugin_artifact: artifact kind" in err


def test_a_kind_that_builds_nothing_is_refused(registries):
    from taperfold.artifacts.base import EXPORT, ArtifactKind

    class Empty(ArtifactKind):
        name, title, built_from = "empty", "nothing", EXPORT

    with pytest.raises(TaperfoldError, match=r"^artifact kind 'empty': build\(\) is not implemented"):
        artifacts.register_kind(Empty())


@pytest.fixture
def model_card_plugin(registries, monkeypatch):
    """examples/plugin_artifact.py as an installed package would offer it: an entry point of the group
    taperfold.artifact_kinds naming its `register` (entry points faked, nothing installed)."""
    from importlib.metadata import EntryPoint

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    entry = EntryPoint("model-card", "plugin_artifact:register", artifacts.PLUGIN_GROUP)
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group=None: [entry] if group == artifacts.PLUGIN_GROUP else []
    )
    monkeypatch.setattr(artifacts, "_plugins_loaded", False)
    yield
    sys.modules.pop("plugin_artifact", None)


def test_a_plugin_kind_is_asked_for_from_the_command_line(model_card_plugin, tmp_path):
    import json

    from conftest import one_line, run_cli

    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
    from taperfold.models import random_gate0_model

    help_text = run_cli("export", "--help").stdout
    assert "--model-card " in help_text and "--model-card-note TEXT" in help_text and "--quantize" in help_text
    ckpt = save_checkpoint(checkpoint_from_model(random_gate0_model("tiny"), step=0), tmp_path / "tiny.pt")
    one_line(run_cli("export", ckpt, "-o", tmp_path / "out", "--model-card-note", "x"), "add --model-card")
    assert not (tmp_path / "out").exists()
    result = run_cli(
        "export", ckpt, "-o", tmp_path / "out", "--no-baseline", "--model-card", "--model-card-note", "for the docs"
    )
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    card = json.loads((tmp_path / "out" / manifest["artifacts"]["model-card"]["path"]).read_text())
    assert card["note"] == "for the docs" and {g["key"] for g in card["graphs"]} == {"unfolded", "folded"}


def test_a_plugin_option_that_clashes_is_refused_in_one_line(registries, tmp_path):
    from conftest import one_line, run_cli

    example = _example_module(ARTIFACT_EXAMPLE)
    from taperfold.artifacts.base import Option

    clashing = type("Clashing", (example.ModelCard,), {"options": (Option("--dtype", help="mine"),)})()
    artifacts.register_kind(clashing)
    one_line(run_cli("export", tmp_path / "x.pt", "--help"), "'model-card'", "--dtype", "taperfold export's own")


def test_a_plugin_that_fails_to_load_is_named_in_one_line(registries, monkeypatch):
    from importlib.metadata import EntryPoint

    entry = EntryPoint("broken", "no_such_module_here:register", artifacts.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [entry])
    monkeypatch.setattr(artifacts, "_plugins_loaded", False)
    with pytest.raises(TaperfoldError, match=r"^artifact kind plug-in 'broken' \(no_such_module_here:register\): "):
        artifacts.load_plugins()


def test_kinds_are_built_in_registry_order_whatever_the_request_order():
    assert artifacts.in_build_order(["vllm", "genai", "onnx", "tensorrt-plan"]) == [
        "onnx",
        "tensorrt-plan",
        "genai",
        "vllm",
    ]
