"""Extension from outside the package (docs/extending.md): a family, a norm kind and an engine are each
data plus one registration, and the core never names them."""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from taperfold import engines, families, norms
from taperfold.errors import TaperfoldError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plugin_family.py"


def _example_module():
    spec = importlib.util.spec_from_file_location("plugin_family", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def registries():
    """Every registry as it was before the test: registrations by a test do not outlive it."""
    saved = dict(families._REGISTRY), dict(norms._KINDS), dict(engines.ENGINES)
    yield
    for registry, before in zip((families._REGISTRY, norms._KINDS, engines.ENGINES), saved):
        registry.clear()
        registry.update(before)


def test_the_example_family_is_named_nowhere_in_the_package():
    sources = [p for p in (ROOT / "taperfold").rglob("*.py")]
    assert sources and not [p for p in sources if "stablelm" in p.read_text().lower()]


@pytest.mark.slow
def test_plugin_family_example_runs_the_whole_chain():
    pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, str(EXAMPLE)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS: every tapered norm folded and verify passed" in result.stdout
    assert "export: 4 folded, 0 kept" in result.stdout and "fold unfolded.onnx: 4 folded, 0 kept" in result.stdout


@pytest.mark.slow
def test_plugin_family_example_fails_on_a_wrong_declaration(registries, capsys):
    pytest.importorskip("transformers")
    example = _example_module()
    # the MLP's up_proj left out: the torch fold then rewrites gate_proj only, and the example must say so
    wrong = dataclasses.replace(example.STABLELM, internal={**example.STABLELM.internal,
                                                            "post_attention_layernorm": ("mlp.gate_proj",)})
    families.register(wrong)
    assert example.main() == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL")


def test_an_unknown_model_type_is_refused_naming_the_guide():
    with pytest.raises(TaperfoldError, match=r"model_type' is 'mamba2'.*docs/extending.md") as info:
        families.family_for("mamba2", "config.json")
    assert "\n" not in str(info.value)


def test_a_registered_family_is_found_by_each_of_its_model_types(registries):
    family = families.Family(name="twin", model_types=("twin-a", "twin-b"), norm="rms", layers="model.layers",
                             internal={"input_layernorm": ("self_attn.q_proj",)}, final="model.norm")
    families.register(family)
    assert families.family_for("twin-a") is family and families.family_for("twin-b") is family
    assert {"twin-a", "twin-b", "llama"} <= set(families.supported_model_types())
    assert family.norm_readers(2, "all") == {"model.layers.0.input_layernorm": ["model.layers.0.self_attn.q_proj"],
                                             "model.layers.1.input_layernorm": ["model.layers.1.self_attn.q_proj"],
                                             "model.norm": ["lm_head"]}


def test_a_registered_norm_kind_is_asked_after_the_shipped_ones(registries):
    rms = norms.norm_kind("rms")
    custom = dataclasses.replace(rms, name="scaled-rms", title="ScaledRMSNorm",
                                 class_names=lambda name: name.endswith("ScaledRMSNorm"))
    norms.register(custom)
    assert [k.name for k in norms.norm_kinds()] == ["ln", "rms", "scaled-rms"]
    assert norms.kind_of_class("MyScaledRMSNorm") is not None
    with pytest.raises(ValueError, match="norm kind must be one of ln, rms, scaled-rms"):
        norms.norm_kind("dyt")


def test_a_registered_engine_gets_its_runner_from_its_module(registries):
    opened = []
    module = SimpleNamespace(open_runner=lambda target, **kw: opened.append((target, kw)) or "runner",
                             unavailable=lambda device: None if device == "cpu" else "needs the CPU")
    engines.register(engines.Engine("echo", "Echo", engines.MODELS, default_device="cpu", devices=("cpu",),
                                    decodes=False, options=(), module=module))
    echo = engines.engine("echo")
    assert echo.runner("model", threads=2) == "runner" and opened[0][0] == "model"
    assert opened[0][1]["device"] == "cpu" and opened[0][1]["threads"] == 2
    with pytest.raises(TaperfoldError, match="needs the CPU"):
        echo.require("cuda")
