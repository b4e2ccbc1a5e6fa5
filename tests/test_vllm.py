"""`export --vllm` and the vLLM plugin (taperfold.serving): a tiny tapered Hugging Face Llama exported `--vllm` is a
checkpoint that stock transformers and stock vLLM refuse, that transformers loads through taperfold's registration with
the checkpoint's logits, and that vLLM serves through taperfold's entry point with the checkpoint's greedy tokens; so
is each served family's, and a Llama's with DyT in its norms' places (the tanh kept, γ and β folded); the
engine `vllm`: `verify --engine vllm` (vLLM's generations held to the checkpoint, a broken checkpoint failing) and
`bench --engine vllm --mode decode --against vllm`. vLLM runs in .venv-vllm (scripts/setup-vllm), in a child process;
those tests are skipped where it is absent."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import one_line, run_cli

from taperfold.nn import ServedNorm

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
GENERATE = Path(__file__).with_name("vllm_generate.py")
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.is_file(), reason=f"vLLM's environment {VLLM_PYTHON.parent.parent} is absent (scripts/setup-vllm)"
)
PROMPTS = [[5, 17, 33, 90, 120, 7], [200, 3], list(range(40, 60))]
NEW_TOKENS = 8
FOLDED_NORMS = [
    f"model.layers.{i}.{norm}" for i in range(2) for norm in ("input_layernorm", "post_attention_layernorm")
]
# the tiny models' shape: greedy tokens that vary (untied head, larger weights), a head size vLLM's CPU attention takes
SHAPE = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
             max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2)  # fmt: skip


def tiny_llama(**changes):
    """A tiny tapered Llama at g = 0 of the test shape."""
    from hf_models import tapered_tiny_model

    return tapered_tiny_model("llama", **{**SHAPE, **changes})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the tapered source directory, the export directory) of `taperfold export SOURCE --vllm`."""
    from taperfold.hf import save_hf_directory

    root = tmp_path_factory.mktemp("vllm")
    source = save_hf_directory(tiny_llama(), root / "tapered")
    result = run_cli("export", source, "-o", root / "out", "--vllm")
    assert result.exit_code == 0, result.stderr
    return source, root / "out"


@pytest.fixture(scope="module")
def reference(exported):
    return greedy_reference(exported[0])


def greedy_reference(source: Path) -> list[dict]:
    """The checkpoint's own greedy continuation of each prompt at g = 0 (transformers' forward, taperfold's tapered
    norms), and the log-probability of each token it chose."""
    from taperfold.sources import open_source

    model = open_source(source).build(gate=0.0).network.eval()
    result = []
    for prompt in PROMPTS:
        ids, logprobs = torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                last = torch.log_softmax(model(ids).logits[0, -1].double(), -1)
                logprobs.append(last.max().item())
                ids = torch.cat([ids, last.argmax().view(1, 1)], 1)
        result.append({"tokens": ids[0, len(prompt) :].tolist(), "logprobs": logprobs})
    assert len({tuple(r["tokens"]) for r in result}) == len(PROMPTS), "degenerate reference: every prompt alike"
    return result


def run_vllm(*models: Path, plugins: str | None = None, tensor_parallel: int = 1) -> subprocess.CompletedProcess:
    """tests/vllm_generate.py on each of `models` in turn in one process of .venv-vllm (vLLM imported once, an engine
    per model), `plugins`: VLLM_PLUGINS ("" loading none), each model's weights split over `tensor_parallel` worker
    processes. At 1, vLLM's engine runs in that process: the plugin's path through the processes vLLM spawns, as users
    serve, is held by the tensor-parallel test (a worker per shard), the OpenAI server test (its engine process) and
    the engine `vllm` tests (taperfold's runner: an engine process and a worker)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    if tensor_parallel == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    if tensor_parallel > 1:  # vLLM's CPU backend binds each worker to a NUMA node of its own unless told its cores
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(cpu) for cpu in sorted(os.sched_getaffinity(0))[:tensor_parallel]
        )
    command = [str(VLLM_PYTHON), str(GENERATE), json.dumps(PROMPTS), str(NEW_TOKENS), str(tensor_parallel)]
    return subprocess.run(
        [*command, *map(str, models)], capture_output=True, text=True, env=env, timeout=600 * len(models), cwd=models[0]
    )


def vllm_error(run: subprocess.CompletedProcess, model: Path) -> str | None:
    """What vllm_generate.py's run said when `model` failed to load (None: no such line)."""
    prefix = f"ERROR: {model}: "
    return next((line.removeprefix(prefix) for line in run.stdout.splitlines() if line.startswith(prefix)), None)


def assert_gives_the_reference(run: subprocess.CompletedProcess, model: Path, reference: list[dict]) -> None:
    """vllm_generate.py's run served `model` with the reference's greedy tokens, each step's logprob within 1e-4."""
    lines = run.stdout.splitlines()
    results = [json.loads(line.removeprefix("RESULT ")) for line in lines if line.startswith("RESULT ")]
    served = next((r["outputs"] for r in results if r["model"] == str(model)), None)
    assert served is not None, f"{model}: {vllm_error(run, model)}\n" + run.stdout[-2000:] + run.stderr[-4000:]
    # exit 0, or 1 where another model of the run failed to load: never a crash after this model's result
    assert run.returncode == int(any(line.startswith("ERROR: ") for line in lines)), run.stderr[-4000:]
    assert [s["tokens"] for s in served] == [r["tokens"] for r in reference], model
    for got, want in zip(served, reference):
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


def test_the_folded_checkpoint_names_taperfolds_architecture_and_holds_no_folded_norm(exported):
    from taperfold.hf.weights import read_weights
    from taperfold.manifest import read_manifest

    _, out = exported
    folder = out / "vllm" / "folded"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "taperfold_llama"
    assert config["architectures"] == ["TaperfoldLlamaForCausalLM"]
    assert config["taperfold_folded_norms"] == FOLDED_NORMS
    assert "taperfold" not in config and config["dtype"] == "float32"
    tensors, _ = read_weights(folder)
    assert not [name for name in tensors if name.rpartition(".")[0] in FOLDED_NORMS]
    assert "model.norm.weight" in tensors and "lm_head.weight" in tensors  # the real final norm, the untied head
    assert (folder / "tokenizer.json").is_file()  # a byte-level source: its byte tokenizer, which vLLM needs
    record = read_manifest(out).record("folded.vllm")
    assert (record.kind, record.variant, record.details.architecture) == (
        "vllm",
        "folded",
        config["architectures"][0],
    )
    assert record.details.weights == ("model.safetensors",) and record.details.folded_norms == 4
    assert record.details.tokenizer == ("tokenizer.json", "tokenizer_config.json")


@pytest.mark.parametrize("export", ["exported", "dyt_exported"])
def test_stock_transformers_refuses_the_folded_checkpoint(export, request):
    """In a fresh process: this one may hold taperfold's registration from another test."""
    folder = request.getfixturevalue(export)[1] / "vllm" / "folded"
    code = f"import transformers; transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r})"
    run = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "model type `taperfold_llama` but Transformers does not recognize this architecture" in run.stderr


def test_transformers_with_taperfolds_registration_gives_the_checkpoints_logits(exported):
    from taperfold.serving.transformers_models import register_with_transformers
    from taperfold.sources import open_source

    source, out = exported
    register_with_transformers()
    folded = transformers.AutoModelForCausalLM.from_pretrained(out / "vllm" / "folded").eval()
    assert type(folded).__name__ == "TaperfoldLlamaForCausalLM"
    assert all(type(folded.get_submodule(path)) is ServedNorm for path in FOLDED_NORMS)  # the residual add alone
    checkpoint = open_source(source).build(gate=0.0).network.eval()
    ids = torch.tensor(PROMPTS[2:] * 2)
    with torch.no_grad():
        want, got = checkpoint(ids).logits, folded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    stock = transformers.AutoModelForCausalLM.from_pretrained(source)  # the norms as real norms: far off
    with torch.no_grad():
        assert (stock(ids).logits - want).abs().max() > 1e-2


def test_a_folded_checkpoint_written_before_the_norm_kind_was_recorded_loads_as_the_residual_add(exported, tmp_path):
    """Folders exported before `taperfold_norm_kind` existed folded RMS norms or LayerNorms: read without the key,
    their folded norms are the residual add, with the same logits."""
    from taperfold.serving import KIND_KEY
    from taperfold.serving.transformers_models import register_with_transformers

    _, out = exported
    older = shutil.copytree(out / "vllm" / "folded", tmp_path / "older")
    config = json.loads((older / "config.json").read_text())
    assert config.pop(KIND_KEY) == "rms"
    (older / "config.json").write_text(json.dumps(config))
    register_with_transformers()
    ids = torch.tensor(PROMPTS[2:])
    logits = []
    for folder in (out / "vllm" / "folded", older):
        folded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        assert all(type(folded.get_submodule(path)) is ServedNorm for path in FOLDED_NORMS)
        with torch.no_grad():
            logits.append(folded(ids).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def test_weights_past_the_shard_size_are_sharded_with_an_index_and_read_back_alike(exported, tmp_path):
    from taperfold.artifacts.vllm_weights import FoldedWeights, write_safetensors
    from taperfold.hf.weights import read_weights
    from taperfold.sources import open_source

    source, out = exported
    files = write_safetensors(tmp_path, FoldedWeights(open_source(source).build(gate=0.0), torch.float32), 64 * 1024)
    assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    sharded, _ = read_weights(tmp_path)
    single, _ = read_weights(out / "vllm" / "folded")
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[name], single[name]) for name in single)


@needs_vllm
def test_vllm_serves_the_folded_checkpoint_through_the_entry_point_with_the_checkpoints_greedy_tokens(
    exported, reference, served
):
    folder = exported[1] / "vllm" / "folded"
    assert_gives_the_reference(served, folder, reference)


@needs_vllm
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallel 2 needs 2 CPUs, one per worker")
def test_vllm_serves_the_folded_checkpoint_split_over_two_tensor_parallel_workers(exported, reference):
    """Tensor parallel 2: each worker holds half of every projection (vLLM's own sharded layers, the plugin's class
    unchanged) and the folded checkpoint still gives the checkpoint's greedy tokens."""
    folder = exported[1] / "vllm" / "folded"
    assert_gives_the_reference(run_vllm(folder, tensor_parallel=2), folder, reference)


# each served family but llama (the tests above): the tiny config's model type (tests/hf_models.py) and its changes
FAMILIES = {
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "granite": ("granite", {}),
    "gemma": ("gemma", {}),
    # vLLM's Gemma 2 reads its logits from the embedding. Smaller weights: at 0.2 the random stream, unnormalized at
    # g = 0 with c fixed at 0.7, reaches |q|, |k| of 5,600 in layer 1, where vLLM's CPU attention with Gemma 2's
    # logit softcap returns NaN (transformers in fp32 does not); a taper's calibrated c keeps the stream near unit RMS
    "gemma2": ("gemma2", {"tie_word_embeddings": True, "initializer_range": 0.05}),
    "gemma3": ("gemma3_text", {}),
    "mixtral": ("mixtral", {}),  # the experts stored one by one under the checkpoint's names, as vLLM loads them
    "qwen3_moe": ("qwen3_moe", {"moe_intermediate_size": 32}),
    "smollm3": ("smollm3", {}),  # vLLM serves SmolLM3 and OLMo 2 with its Transformers backend
    "olmo2": ("olmo2", {}),  # post-norms only, folded back into o_proj and down_proj
    # LayerNorms, parallel residual, partial rotary, vLLM's Transformers backend. β folds into dense_h_to_4h's bias and,
    # without attention biases, into one query_key_value is given. GPT-NeoX's config has no key/value head count (each
    # head has its own) and vLLM reads a stray one as the cache's: 2, its head count, not the test shape's 1
    "gpt_neox": ("gpt_neox", {"num_key_value_heads": 2, "attention_bias": False}),
    # LayerNorms read by q/k/v and gate/up, none with a bias (use_qkv_bias false): each given one; partial rotary
    "stablelm": ("stablelm", {}),
}


def tiny_tapered(model_type: str, **changes):
    """A tiny tapered model at g = 0 of Llama's test shape (head size 32, untied head, larger weights); a LayerNorm's
    β away from 0, so that its fold into the readers' biases shows (within ±0.1: at ±0.5 the stream, unnormalized at
    g = 0, makes tiny StableLM's every greedy token alike)."""
    from hf_models import tapered_tiny_model

    model = tapered_tiny_model(model_type, **{**SHAPE, **changes})
    if model.tapering.kind.shift:
        with torch.no_grad():
            for norm in model.tapering.norms.values():
                norm.get_parameter("bias").uniform_(-0.1, 0.1)
    return model


@pytest.fixture(scope="module")
def families_exported(tmp_path_factory):
    """family -> (tapered source, its folded checkpoint folder) of `taperfold export SOURCE --vllm --no-onnx` for a
    tiny tapered model of each served family: the folder alone, no graph traced."""
    from taperfold.hf import save_hf_directory

    exported = {}
    for family, (model_type, changes) in FAMILIES.items():
        root = tmp_path_factory.mktemp(f"vllm-{family}")
        source = save_hf_directory(tiny_tapered(model_type, **changes), root / "tapered")
        result = run_cli("export", source, "-o", root / "out", "--vllm", "--no-onnx")
        assert result.exit_code == 0, f"{family}: {result.stderr}"
        exported[family] = source, root / "out" / "vllm" / "folded"
    return exported


@pytest.fixture(scope="module")
def served(exported, families_exported, dyt_exported):
    """One run of tests/vllm_generate.py over the llama checkpoint, each family's and the DyT Llama's, an engine each in
    turn in that process (vLLM imported once); each test asserts its own model's greedy tokens."""
    folders = [folder for _, folder in families_exported.values()]
    return run_vllm(exported[1] / "vllm" / "folded", *folders, dyt_exported[1] / "vllm" / "folded")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_served_family_loads_in_transformers_with_the_checkpoints_logits(families_exported, family):
    from taperfold.serving import SERVED
    from taperfold.serving.transformers_models import register_with_transformers
    from taperfold.sources import open_source

    source, folder = families_exported[family]
    register_with_transformers()
    folded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(folded).__name__ == SERVED[family].architecture
    folded_norms = json.loads((folder / "config.json").read_text())["taperfold_folded_norms"]
    assert folded_norms and all(type(folded.get_submodule(p)) is ServedNorm for p in folded_norms)
    checkpoint = open_source(source).build(gate=0.0).network.eval()
    ids = torch.tensor(PROMPTS[2:] * 2)
    with torch.no_grad():
        torch.testing.assert_close(folded(ids).logits, checkpoint(ids).logits, rtol=1e-5, atol=1e-5)


@needs_vllm
@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_serves_each_served_family_with_the_checkpoints_greedy_tokens(families_exported, served, family):
    source, folder = families_exported[family]
    assert_gives_the_reference(served, folder, greedy_reference(source))


@pytest.fixture(scope="module")
def dyt_exported(tmp_path_factory):
    """(the source directory, the export directory) of `taperfold export SOURCE --vllm --no-onnx` for a tiny Llama of
    the test shape with DyT in every norm's place, the final one too."""
    from hf_models import dyt_tiny_model

    from taperfold.hf import save_hf_directory

    root = tmp_path_factory.mktemp("vllm-dyt")
    source = save_hf_directory(dyt_tiny_model("llama", "all", **SHAPE), root / "dyt")
    result = run_cli("export", source, "-o", root / "out", "--vllm", "--no-onnx")
    assert result.exit_code == 0, result.stderr
    return source, root / "out"


def test_export_no_onnx_writes_the_vllm_folder_alone_and_the_graph_commands_say_so(dyt_exported, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(dyt_exported[1], out)  # verify writes verify.json beside the export
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "vllm"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["export"]["onnx"] is False
    assert [entry["kind"] for entry in manifest["artifacts"].values()] == ["vllm"]
    assert manifest["timings"]["torch_export_s"] == 0  # nothing traced
    verified = run_cli("verify", out, "--json")
    assert verified.exit_code == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert [pair["status"] for pair in report["pairs"]] == ["pass"] and report.get("note") is None
    one_line(run_cli("bench", out, "--engine", "ort"), "missing key 'artifacts.baseline'", "--no-onnx")


@pytest.mark.parametrize(
    "flags, needle",
    [
        ((), "--no-onnx leaves nothing to write: ask for a folder converted from the model (--openvino, --vllm)"),
        (("--quantize", "int4"), "--no-onnx leaves nothing to write"),
        (("--vllm", "--kv-cache"), "--kv-cache shapes the ONNX graphs, which --no-onnx does not write"),
        (("--vllm", "--opset", "20"), "--opset shapes the ONNX graphs"),
        (("--vllm", "--ort-fusions"), "--ort-fusions shapes the ONNX graphs"),
        (("--genai",), "--genai is made from the ONNX graphs, which --no-onnx does not write"),
        (("--trt",), "--trt is made from the ONNX graphs"),
    ],
)
def test_export_no_onnx_refuses_what_needs_a_graph_in_one_line_before_any_work(exported, tmp_path, flags, needle):
    result = run_cli("export", exported[0], "-o", tmp_path / "out", "--no-onnx", *flags)
    one_line(result, needle)
    assert not (tmp_path / "out").exists()


def test_a_dyt_llamas_checkpoint_holds_each_tanhs_alpha_and_the_final_dyt_whole(dyt_exported):
    """Each layer's DyT folds (γ into the readers' weights, β into biases q/k/v and gate/up are given), its α stored
    under its own path; the final DyT, whose β vLLM's head could not add, is kept whole; the head stays the source's."""
    from taperfold.hf.weights import read_weights
    from taperfold.sources import open_source

    source, out = dyt_exported
    folder = out / "vllm" / "folded"
    config = json.loads((folder / "config.json").read_text())
    assert (config["taperfold_norm_kind"], config["taperfold_folded_norms"]) == ("dyt", FOLDED_NORMS)
    assert config["taperfold_kept_norms"] == ["model.norm"]
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    assert sorted(config["taperfold_added_biases"]) == sorted(
        f"model.layers.{i}.{p}" for i in range(2) for p in projections
    )
    tensors, _ = read_weights(folder)
    assert sorted(n for n in tensors if n.rpartition(".")[0] in FOLDED_NORMS) == [f"{p}.alpha" for p in FOLDED_NORMS]
    tapered = open_source(source).build(gate=0.0).network
    for path in [*FOLDED_NORMS, "model.norm"]:
        assert torch.equal(tensors[f"{path}.alpha"], tapered.get_submodule(path).alpha)
    assert all(torch.equal(tensors[f"model.norm.{k}"], tapered.model.norm.get_parameter(k)) for k in ("weight", "bias"))
    assert torch.equal(tensors["lm_head.weight"], tapered.lm_head.weight)


def test_transformers_with_taperfolds_registration_gives_a_dyt_checkpoints_logits(dyt_exported):
    from taperfold.norms.dyt import ServedDyT, ServedTanh
    from taperfold.serving.transformers_models import register_with_transformers
    from taperfold.sources import open_source

    source, out = dyt_exported
    register_with_transformers()
    folded = transformers.AutoModelForCausalLM.from_pretrained(out / "vllm" / "folded").eval()
    assert all(type(folded.get_submodule(path)) is ServedTanh for path in FOLDED_NORMS)
    assert type(folded.model.norm) is ServedDyT
    checkpoint = open_source(source).build(gate=0.0).network.eval()
    ids = torch.tensor(PROMPTS[2:] * 2)
    with torch.no_grad():
        torch.testing.assert_close(folded(ids).logits, checkpoint(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_dyt_read_by_a_moe_router_is_kept_whole_and_transformers_gives_the_checkpoints_logits(tmp_path):
    """Mixtral with DyT: `post_attention_layernorm` feeds the router and the stacked experts, bare weights that take no
    bias, so it is kept whole (α, γ, β in the checkpoint); `input_layernorm` folds into q/k/v."""
    from hf_models import dyt_tiny_model

    from taperfold.hf import save_hf_directory
    from taperfold.norms.dyt import ServedDyT, ServedTanh
    from taperfold.serving.transformers_models import register_with_transformers
    from taperfold.sources import open_source

    source = save_hf_directory(dyt_tiny_model("mixtral", "internal", **SHAPE), tmp_path / "dyt")
    result = run_cli("export", source, "-o", tmp_path / "out", "--vllm")
    assert result.exit_code == 0, result.stderr
    folder = tmp_path / "out" / "vllm" / "folded"
    config = json.loads((folder / "config.json").read_text())
    assert config["taperfold_folded_norms"] == [f"model.layers.{i}.input_layernorm" for i in range(2)]
    assert config["taperfold_kept_norms"] == [f"model.layers.{i}.post_attention_layernorm" for i in range(2)]
    register_with_transformers()
    folded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(folded.model.layers[0].input_layernorm) is ServedTanh
    assert type(folded.model.layers[0].post_attention_layernorm) is ServedDyT
    checkpoint = open_source(source).build(gate=0.0).network.eval()
    ids = torch.tensor(PROMPTS[2:] * 2)
    with torch.no_grad():
        torch.testing.assert_close(folded(ids).logits, checkpoint(ids).logits, rtol=1e-5, atol=1e-5)


@needs_vllm
def test_vllm_serves_a_dyt_checkpoint_through_the_entry_point_with_the_checkpoints_greedy_tokens(dyt_exported, served):
    source, out = dyt_exported
    assert_gives_the_reference(served, out / "vllm" / "folded", greedy_reference(source))


def test_a_tapered_final_layernorm_vllms_head_cannot_take_is_refused_in_one_line(tmp_path, no_export_work):
    """GPT-NeoX tapered whole: its final LayerNorm's β would be a bias of the head, which vLLM's head does not add,
    and a tapered LayerNorm has no form a serving engine computes but folded."""
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory

    source = save_hf_directory(tapered_tiny_model("gpt_neox", "all"), tmp_path / "gpt_neox")
    result = run_cli("export", source, "-o", tmp_path / "out", "--vllm")
    one_line(result, "--vllm: gpt_neox.final_layer_norm does not fold in the served model", "served folded only")
    assert not (tmp_path / "out").exists()


@needs_vllm
def test_stock_vllm_refuses_the_folded_checkpoint(exported):
    folder = exported[1] / "vllm" / "folded"
    run = run_vllm(folder, plugins="")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    error = vllm_error(run, folder)
    assert error and "taperfold_llama" in error and "does not recognize this architecture" in error, run.stdout


@needs_vllm
def test_vllms_openai_server_answers_with_the_checkpoints_greedy_tokens(exported, reference, tmp_path):
    """`python -m vllm.entrypoints.openai.api_server` (the CPU package's `vllm` command cannot start) on 127.0.0.1,
    one completion request, then the server and its engine process stopped."""
    folder = exported[1] / "vllm" / "folded"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "64"]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_PLUGINS", None)
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_healthy(server, f"http://127.0.0.1:{port}/health", tmp_path / "server.log")
        request = {"model": str(folder), "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0,
                   "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        answer = urllib.request.urlopen(
            urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=json.dumps(request).encode(),
                headers={"Content-Type": "application/json"},
            ),
            timeout=120,
        )
        choice = json.loads(answer.read())["choices"][0]
        assert choice["token_ids"] == reference[0]["tokens"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the engine process it started
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_healthy(server: subprocess.Popen, url: str, log: Path, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}): {log.read_text()[-3000:]}")
        try:
            if urllib.request.urlopen(url, timeout=5).status == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(2)
    pytest.fail(f"the server was not healthy within {timeout_s:g} s: {log.read_text()[-3000:]}")


@pytest.fixture
def no_export_work(monkeypatch):
    """Export's graph work fails the test: a refusal must come before it."""

    def fail(*args, **kwargs):
        raise AssertionError("export started its work before refusing")

    monkeypatch.setattr("taperfold.export.export_graphs", fail)


def test_an_unserved_family_is_refused_in_one_line_before_the_work(tmp_path, no_export_work):
    from hf_models import tapered_tiny_model

    from taperfold.hf import save_hf_directory
    from taperfold.serving import SERVED

    source = save_hf_directory(tapered_tiny_model("phi"), tmp_path / "phi")
    result = run_cli("export", source, "-o", tmp_path / "out", "--vllm")
    one_line(result, "--vllm: the phi family is not served yet", f"served: {', '.join(SERVED)}")
    assert not (tmp_path / "out").exists()


def test_a_layout_vllms_class_does_not_compute_is_refused_in_one_line_before_the_work(tmp_path, no_export_work):
    """StableLM's parallel residual: vLLM's StableLM adds attention and the MLP in sequence, whatever the config."""
    from taperfold.hf import save_hf_directory

    source = save_hf_directory(tiny_tapered("stablelm", use_parallel_residual=True), tmp_path / "stablelm")
    result = run_cli("export", source, "-o", tmp_path / "out", "--vllm")
    one_line(result, "its config sets use_parallel_residual, and vLLM's StableLM adds attention and the MLP one after")
    assert not (tmp_path / "out").exists()


def test_an_untied_gemma2_is_refused_in_one_line_before_the_work(tmp_path, no_export_work):
    """vLLM's Gemma 2 reads its logits from the embedding whatever config.json says: an untied head is refused."""
    from taperfold.hf import save_hf_directory

    source = save_hf_directory(tiny_tapered("gemma2"), tmp_path / "gemma2")
    result = run_cli("export", source, "-o", tmp_path / "out", "--vllm")
    one_line(result, "its head is untied", "Gemma2ForCausalLM reads the logits from the embedding")
    assert not (tmp_path / "out").exists()


def test_an_untapered_directory_is_refused_in_one_line_naming_stock_vllm(tmp_path, no_export_work):
    from hf_models import tiny_config

    plain = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    plain.save_pretrained(tmp_path / "plain")
    result = run_cli("export", tmp_path / "plain", "-o", tmp_path / "out", "--vllm")
    one_line(result, "untapered", "stock vLLM serves the directory itself")


def test_a_taperfold_checkpoint_is_refused_in_one_line(tmp_path, no_export_work):
    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
    from taperfold.models import random_gate0_model

    path = save_checkpoint(checkpoint_from_model(random_gate0_model("tiny"), step=0), tmp_path / "tiny.pt")
    result = run_cli("export", path, "-o", tmp_path / "out", "--vllm")
    one_line(result, "--vllm writes the folded form of a Hugging Face directory")


# ---- the engine `vllm`: verify and bench ----------------------------------------------------------------------------


@pytest.fixture
def vllm_env(monkeypatch):
    """What a user of this CPU sets: the KV cache's size (GB); .venv-vllm is found in the current directory."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.delenv("TAPERFOLD_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.chdir(ROOT)


def _generation_pair(report: dict) -> dict:
    (pair,) = [p for p in report["pairs"] if p["kind"] == "generate"]
    return pair


@needs_vllm
def test_verify_engine_vllm_holds_vllms_generations_to_the_checkpoint(exported, vllm_env, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(exported[1], out)  # verify writes verify.json beside the export
    result = run_cli("verify", out, "--engine", "vllm", "--json")
    assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    pair = _generation_pair(report)
    assert (pair["name"], pair["status"]) == ("checkpoint -> folded.vllm", "pass"), pair
    assert "4 prompts alone and 4 at once, 8 tokens each" in pair["reason"]
    runs = [r for r in pair["per_input"] if "logprob_errors" in r]
    assert len(runs) == 8 and all(len(r["tokens"]) == 8 and max(r["logprob_errors"]) < 1e-3 for r in runs)
    alone, together = runs[:4], runs[4:]
    assert [r["tokens"] for r in alone] == [r["tokens"] for r in together]  # no near-tie in this model
    assert next(p for p in report["pairs"] if p["candidate"] == "folded.vllm" and p["kind"] == "check")["status"] == (
        "pass"
    )


@pytest.fixture(scope="module")
def bf16_exported(exported, tmp_path_factory):
    """`export SOURCE --vllm --dtype bf16 --no-baseline` of the tiny Llama: bf16, what vLLM serves in on a CPU with
    bf16 units."""
    out = tmp_path_factory.mktemp("vllm-bf16") / "out"
    result = run_cli("export", exported[0], "-o", out, "--vllm", "--dtype", "bf16", "--no-baseline")
    assert result.exit_code == 0, result.stderr
    assert json.loads((out / "vllm" / "folded" / "config.json").read_text())["dtype"] == "bfloat16"
    return out


@needs_vllm
def test_verify_engine_vllm_holds_a_bf16_export_skipping_the_graphs_onnx_runtimes_cpu_cannot_run(
    bf16_exported, vllm_env, tmp_path
):
    """vLLM serves the checkpoint in the dtype its config names, held to the checkpoint within bf16's bounds; the bf16
    ONNX graphs, which ONNX Runtime's CPU provider cannot load, are skipped with that reason rather than stopping the
    verify (plain `verify` on them still stops in one line: tests/test_hf_dtypes.py)."""
    out = tmp_path / "out"
    shutil.copytree(bf16_exported, out)
    result = run_cli("verify", out, "--engine", "vllm", "--json")
    assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    pair = _generation_pair(report)
    assert pair["status"] == "pass" and "(bound 0.15)" in pair["reason"] and "(margin 0.3)" in pair["reason"], pair
    runs = [r for r in pair["per_input"] if "logprob_errors" in r]
    assert len(runs) == 8 and max(max(r["logprob_errors"]) for r in runs) > 1e-3  # bf16's rounding, not fp32's
    graphs = [p for p in report["pairs"] if p["kind"] == "export"]
    assert graphs and all(
        p["status"] == "skipped" and "ONNX Runtime has no bf16 kernels on the cpu" in p["reason"] for p in graphs
    ), graphs


@needs_vllm
def test_bench_decode_of_a_bf16_export_runs_on_vllm_and_is_refused_where_the_host_feeds_the_cache(
    bf16_exported, vllm_env, tmp_path
):
    """vLLM keeps its own KV cache, so a bf16 export decodes on it; ONNX Runtime's decoders take the cache from numpy,
    which has no bfloat16: refused in one line before the work."""
    out = tmp_path / "out"
    shutil.copytree(bf16_exported, out)
    lengths = ("--batch", "1", "--prompt", "8", "--new-tokens", "4", "--warmup", "1", "--iters", "1", "--rounds", "1")
    result = run_cli("bench", out, "--engine", "ort", "--mode", "decode", *lengths)
    one_line(result, "numpy has no bfloat16 to feed the KV cache")
    report_path = tmp_path / "bench.json"
    result = run_cli("bench", out, "--engine", "vllm", "--mode", "decode", "--variants", "folded", *lengths,
                     "--report", report_path)  # fmt: skip
    assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert {(r["variant"], r["phase"]) for r in report["results"]} == {("folded", "prefill"), ("folded", "decode")}
    assert all(r["tokens_per_s"] > 0 for r in report["results"])


@needs_vllm
def test_verify_engine_vllm_fails_a_folded_checkpoint_whose_weight_is_off(exported, vllm_env, tmp_path):
    """A fold's gain off by 10 % on the MLP's inputs of one layer (the file's size unchanged: its own check passes)."""
    out = tmp_path / "out"
    shutil.copytree(exported[1], out)
    _scale_in_place(out / "vllm" / "folded" / "model.safetensors", "model.layers.0.mlp.gate_proj.weight", 1.1)
    result = run_cli("verify", out, "--engine", "vllm", "--json")
    assert result.exit_code == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    pair = _generation_pair(report)
    assert pair["status"] == "fail" and any("|logprob error|" in v for v in pair["violations"]), pair
    assert [p["name"] for p in report["pairs"] if p["status"] == "fail"] == ["checkpoint -> folded.vllm"]
    assert "checkpoint -> folded.vllm: " in result.stderr


def _scale_in_place(path: Path, name: str, factor: float) -> None:
    """Multiply one fp32 tensor of a safetensors file by `factor`, its bytes rewritten where they are."""
    import numpy as np

    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(size))[name]
        start, end = entry["data_offsets"]
        assert entry["dtype"] == "F32"
        f.seek(8 + size + start)
        values = np.frombuffer(f.read(end - start), dtype="<f4") * np.float32(factor)
        f.seek(8 + size + start)
        f.write(values.astype("<f4").tobytes())


@needs_vllm
def test_bench_engine_vllm_times_the_folded_checkpoint_against_stock_vllm(exported, vllm_env, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(exported[1], out)
    report_path = tmp_path / "bench.json"
    result = run_cli("bench", out, "--engine", "vllm", "--mode", "decode", "--against", "vllm", "--batch", "1,4",
                     "--prompt", "16", "--new-tokens", "8", "--warmup", "1", "--iters", "2", "--rounds", "2",
                     "--report", report_path)  # fmt: skip
    assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["engine"] == "vllm" and report["mode"] == "decode"
    rows = {(r["variant"], r["phase"], r["batch"]) for r in report["results"]}
    assert rows == {(v, phase, b) for v in ("folded", "vllm") for phase in ("prefill", "decode") for b in (1, 4)}
    assert all(r["tokens_per_s"] > 0 for r in report["results"])
    (against,) = report["against"]
    assert against["tool"] == "stock vLLM" and against["dtype"] == "float32" and "0.32" in against["version"]
    assert (out / "against" / "vllm-fp32" / "plain-hf" / "config.json").is_file()
    assert (out / "bench-decode.json").is_file()


def test_no_vllm_environment_is_one_line(exported, tmp_path, monkeypatch):
    """Where no vLLM environment is found, verify --engine vllm and bench --engine vllm stop in one line (exit 2)
    before any work."""
    missing = tmp_path / "no-such-env" / "bin" / "python"
    monkeypatch.setenv("TAPERFOLD_VLLM_PYTHON", str(missing))
    for args in (
        ["verify", exported[1], "--engine", "vllm"],
        ["bench", exported[1], "--engine", "vllm", "--mode", "decode"],
    ):
        one_line(run_cli(*args), f"TAPERFOLD_VLLM_PYTHON={missing}: no such file", "scripts/setup-vllm")
    monkeypatch.setenv("TAPERFOLD_VLLM_PYTHON", os.sys.executable)  # taperfold's own Python: no vllm module
    one_line(run_cli("verify", exported[1], "--engine", "vllm"), "has no vllm module")
    assert not (exported[1] / "against").exists()


def test_bench_engine_vllm_times_the_folded_checkpoint_by_default_and_refuses_other_variants(
    exported, tmp_path, monkeypatch
):
    """vLLM has a checkpoint of the folded model alone, and an export --no-baseline no baseline: bench --engine vllm
    times folded without --variants (here it gets as far as looking for vLLM's environment, which is absent), and a
    --variants naming another variant is one line naming what it runs, before anything else."""
    from taperfold.bench.request import BenchRequest
    from taperfold.exportdir import VARIANTS

    out = tmp_path / "out"
    result = run_cli("export", exported[0], "-o", out, "--vllm", "--no-baseline")
    assert result.exit_code == 0, result.stderr
    assert BenchRequest(export_dir=str(out), engine="vllm").options().variants == ["folded"]
    assert BenchRequest(export_dir=str(out), engine="ort").options().variants == list(VARIANTS)
    missing = tmp_path / "no-such-env" / "bin" / "python"
    monkeypatch.setenv("TAPERFOLD_VLLM_PYTHON", str(missing))
    decode = ["bench", out, "--engine", "vllm", "--mode", "decode"]
    one_line(run_cli(*decode), f"TAPERFOLD_VLLM_PYTHON={missing}: no such file")
    for variants, refused in (("baseline", "baseline"), ("unfolded,folded", "unfolded")):
        one_line(
            run_cli(*decode, "--variants", variants),
            f"--variants {refused}: --engine vllm runs an export's folded checkpoint for vLLM",
            "exists of folded only",
            "--against vllm",
        )
    assert not (out / "bench-decode.json").exists() and not (out / "against").exists()


@needs_vllm
def test_bench_mode_serve_drives_vllms_server_on_the_folded_and_the_stock_model(exported, vllm_env, tmp_path):
    """One round: the folded checkpoint's server, then stock vLLM's on the plain directory, each driven by
    vllm.benchmarks.serve at concurrency 1 and 4; no server left running."""
    out = tmp_path / "out"
    shutil.copytree(exported[1], out)
    result = run_cli("bench", out, "--engine", "vllm", "--mode", "serve", "--concurrency", "1,4", "--against", "vllm",
                     "--prompt", "16", "--new-tokens", "8", "--requests", "8", "--rounds", "1")  # fmt: skip
    assert result.exit_code == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "bench-serve.json").read_text())
    assert report["mode"] == "serve" and [c["label"] for c in report["contenders"]] == ["folded", "vllm"]
    rows = {(r["contender"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {("folded", 1), ("folded", 4), ("vllm", 1), ("vllm", 4)}
    for row in rows.values():
        assert row["failed"] == 0 and row["requests"] == 8 and len(row["rounds"]) == 1
        assert row["rounds"][0]["completed"] == 8 and row["rounds"][0]["total_output_tokens"] == 64
        assert (
            row["median"]["output_throughput"] > 0 and row["median"]["p99_ttft_ms"] >= row["median"]["median_ttft_ms"]
        )
    logs = sorted(p.name for p in (out / "bench-serve-logs").iterdir())
    assert logs == [f"{c}-round1.{what}.log" for c in ("folded", "vllm") for what in ("bench", "server")]
    assert "Application startup complete" in (out / "bench-serve-logs" / "folded-round1.server.log").read_text()


def test_bench_mode_serve_refusals_are_one_line(exported, tmp_path, monkeypatch):
    monkeypatch.setenv("TAPERFOLD_VLLM_PYTHON", str(tmp_path / "none"))
    out = exported[1]
    one_line(run_cli("bench", out, "--engine", "ort", "--mode", "serve"), "--mode serve", "--engine vllm")
    one_line(run_cli("bench", out, "--engine", "vllm", "--concurrency", "1,8"), "--concurrency", "--mode serve")
    one_line(run_cli("bench", out, "--engine", "vllm", "--mode", "serve", "--concurrency", "0"), "--concurrency: '0'")
    one_line(run_cli("bench", out, "--engine", "vllm", "--mode", "serve"), "no such file", "scripts/setup-vllm")
    assert not (out / "bench-serve-logs").exists()
