"""No code a folder names ever runs. A shared library whose constructor writes a marker file is planted beside a genai
folder's model (or named by its absolute path) in the folder's genai_config.json: `bench --engine genai`, `verify` and
a planted `bench --against` contender refuse the folder in one line naming the file and the key, and the marker is
never written. The same for the other runtime options a config can carry (execution providers, session entries,
other models) and for an ONNX graph with an op of a custom domain. Skipped where onnxruntime-genai is not installed;
the library tests where no C compiler is."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import HANG_S, one_line, run_cli

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.models import random_gate0_model

og = pytest.importorskip(
    "onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install 'taperfold[genai]')"
)

pytestmark = pytest.mark.slow

DECODE = ("--mode", "decode", "--batch", "1", "--prompt", "4", "--new-tokens", "2", "--warmup", "1", "--iters", "1",
          "--rounds", "1", "--threads", "1")  # fmt: skip
LIBRARY_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) fclose(f);
}
"""


@pytest.fixture(scope="module")
def genai_export(tmp_path_factory):
    """A tiny llama at g = 0 exported with --genai (folders of the folded model and the baseline). Read-only."""
    root = tmp_path_factory.mktemp("foreign")
    ckpt = save_checkpoint(checkpoint_from_model(random_gate0_model("tiny", arch="llama"), step=0), root / "tiny.pt")
    result = run_cli("export", ckpt, "-o", root / "out", "--genai")
    assert result.exit_code == 0, result.stderr
    return root / "out"


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory):
    """(a shared library whose constructor creates a marker file, that marker's path)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the planted library")
    root = tmp_path_factory.mktemp("planted")
    marker = root / "marker"
    (root / "planted.c").write_text(LIBRARY_SOURCE)
    library = root / "libplanted.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(root / "planted.c"), "-o", str(library)],
        check=True,
        timeout=HANG_S,
    )
    return library, marker


def _copy(genai_export, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(genai_export, copy)
    return copy


def _edit_config(folder, edit) -> None:
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _name_library(folder, library, where: str) -> None:
    """The folder's config names `library`: a copy planted beside its model, or the library by its absolute path."""
    if where == "beside":
        shutil.copyfile(library, folder / library.name)
        named = library.name
    else:
        named = str(library)
    _edit_config(folder, lambda c: c["model"]["decoder"]["session_options"].update(custom_ops_library=named))


def test_the_planted_library_writes_its_marker_when_onnxruntime_genai_loads_the_folder(
    genai_export, planted_library, tmp_path
):
    """The threat is real: onnxruntime-genai itself loads a custom-op library planted beside the model (the marker
    appears), so the tests below prove taperfold never lets it get that far."""
    library, marker = planted_library
    folder = _copy(genai_export, tmp_path) / "genai" / "folded"
    _name_library(folder, library, "beside")
    load = "import onnxruntime_genai as og, sys; og.Model(og.Config(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", load, str(folder)], capture_output=True, timeout=HANG_S)
    assert marker.exists()
    marker.unlink()


@pytest.mark.parametrize("where", ["beside", "absolute"])
def test_bench_genai_never_loads_a_library_the_folders_config_names(genai_export, planted_library, tmp_path, where):
    library, marker = planted_library
    copy = _copy(genai_export, tmp_path)
    _name_library(copy / "genai" / "folded", library, where)
    result = run_cli("bench", copy, "--engine", "genai", "--variants", "folded", *DECODE)
    one_line(result, "genai/folded/genai_config.json", "model.decoder.session_options.custom_ops_library")
    assert not marker.exists()


@pytest.mark.parametrize("where", ["beside", "absolute"])
def test_verify_never_loads_a_library_the_folders_config_names(genai_export, planted_library, tmp_path, where):
    library, marker = planted_library
    copy = _copy(genai_export, tmp_path)
    _name_library(copy / "genai" / "baseline", library, where)
    result = run_cli("verify", copy, "--threads", "1")
    one_line(result, "genai/baseline/genai_config.json", "model.decoder.session_options.custom_ops_library")
    assert not marker.exists() and not (copy / "verify.json").exists()


def test_a_planted_against_contender_never_loads_its_library(genai_export, planted_library, tmp_path):
    """DIR/against/genai-builder-fp32/ planted with a contender.json that matches what bench would build, so bench
    reuses it: its config's library is refused like any folder's."""
    from taperfold.manifest import read_manifest

    library, marker = planted_library
    copy = _copy(genai_export, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["source"] = {"format": "huggingface"}  # what --against genai-builder builds from
    (copy / "manifest.json").write_text(json.dumps(manifest))
    contender = copy / "against" / "genai-builder-fp32"
    shutil.copytree(copy / "genai" / "baseline", contender)
    _name_library(contender, library, "beside")
    made = {
        "tool": "onnxruntime-genai model builder",
        "version": og.__version__,
        "precision": "fp32",
        "source": str(read_manifest(copy).checkpoint),
    }
    (contender / "contender.json").write_text(json.dumps(made))
    result = run_cli("bench", copy, "--engine", "genai", "--variants", "folded", "--against", "genai-builder", *DECODE)
    one_line(result, "against/genai-builder-fp32/genai_config.json", "custom_ops_library")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda c, lib: c["model"]["decoder"]["session_options"].update(provider_options=[{"cuda": {}}]),
         "model.decoder.session_options.provider_options"),
        (lambda c, lib: c["model"]["decoder"]["session_options"].update(
            provider_options=[{"QNN": {"backend_path": str(lib)}}]),
         "model.decoder.session_options.provider_options"),
        (lambda c, lib: c["model"]["decoder"]["session_options"].update(enable_profiling=str(lib)),
         "model.decoder.session_options.enable_profiling"),
        (lambda c, lib: c["model"]["decoder"]["session_options"].update({"session.load_model_format": "ORT"}),
         "model.decoder.session_options.session.load_model_format"),
        (lambda c, lib: c["model"]["decoder"].update(run_options={"gpu_graph_id": "1"}), "model.decoder.run_options"),
        (lambda c, lib: c["model"].update(vision={"filename": "vision.onnx"}), "model.vision"),
        (lambda c, lib: c["model"].update(type="phi3v"), "model.type"),
        (lambda c, lib: c.update(engine={"dynamic_batching": {}}), "engine"),
        (lambda c, lib: c["model"]["decoder"].update(pipeline=[{"filename": str(lib)}]), "model.decoder.pipeline"),
    ],
)  # fmt: skip
def test_runtime_options_taperfold_did_not_write_are_refused_before_onnxruntime_genai_reads_them(
    genai_export, planted_library, tmp_path, edit, key
):
    """Providers (and their library paths), session entries, profiling paths, other models: an allow-list of the
    keys taperfold and the builder write, so a key nobody listed is refused too."""
    from taperfold.runners.genai import GenaiRunner

    library, marker = planted_library
    folder = _copy(genai_export, tmp_path) / "genai" / "folded"
    _edit_config(folder, lambda c: edit(c, library))
    with pytest.raises(TaperfoldError, match=re.escape(f"genai_config.json: key '{key}'")) as refused:
        GenaiRunner(folder).load()
    assert "\n" not in str(refused.value) and not marker.exists()


def _custom_domain_decoder(source, dest) -> None:
    """`source`'s graph with one node turned into an op of a custom domain (its external data left beside it)."""
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "Add")
    node.domain, node.name = "ai.planted", "planted_op"
    model.opset_import.append(onnx.helper.make_opsetid("ai.planted", 1))
    dest.write_bytes(model.SerializeToString())


def test_an_onnx_graph_with_a_custom_domain_op_is_one_line_before_onnxruntime_loads_it(genai_export, tmp_path):
    from taperfold.runners.ort import open_session

    copy = _copy(genai_export, tmp_path)
    _custom_domain_decoder(copy / "model.decoder.onnx", copy / "model.decoder.onnx")
    with pytest.raises(TaperfoldError, match=r"node 'planted_op' \(Add\) is an op of domain 'ai\.planted'") as e:
        open_session(copy / "model.decoder.onnx")
    assert "\n" not in str(e.value)
    one_line(run_cli("verify", copy, "--threads", "1"), "model.decoder.onnx", "domain 'ai.planted'")


def test_a_genai_decoder_with_a_custom_domain_op_is_refused_before_onnxruntime_genai_loads_it(genai_export, tmp_path):
    copy = _copy(genai_export, tmp_path)
    decoder = copy / "genai" / "folded" / "model.decoder.onnx"
    _custom_domain_decoder(decoder, decoder)
    result = run_cli("bench", copy, "--engine", "genai", "--variants", "folded", *DECODE)
    one_line(result, "genai/folded/model.decoder.onnx", "domain 'ai.planted'", "custom-op library")
