"""Every config a folder carries, and every file a user hands verify, read as manifest.json is: types, ranges, names
against the graph, paths inside the folder, special files refused before they are opened; one line naming the file
and the key, exit 2. Classes: a genai_config.json that is wrong (names, sizes, layer counts, search bounds, its
decoder's file), a manifest whose paths climb out of the export or whose `source` has the wrong type, verify's
`--text` and `--tokens` files, an OpenVINO IR that is a FIFO or no XML."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading

import numpy as np
import pytest
from conftest import one_line, run_cli

from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
from taperfold.errors import TaperfoldError
from taperfold.models import random_gate0_model

pytestmark = pytest.mark.slow

DECODE = ("--mode", "decode", "--batch", "1", "--prompt", "4", "--new-tokens", "2", "--warmup", "1", "--iters", "1",
          "--rounds", "1", "--threads", "1")  # fmt: skip


@pytest.fixture(scope="module")
def genai_export(tmp_path_factory):
    """A tiny llama (4 layers) at g = 0 exported with --genai. Read-only."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    root = tmp_path_factory.mktemp("configs")
    ckpt = save_checkpoint(checkpoint_from_model(random_gate0_model("tiny", arch="llama"), step=0), root / "tiny.pt")
    result = run_cli("export", ckpt, "-o", root / "out", "--genai")
    assert result.exit_code == 0, result.stderr
    return root / "out"


def _copy(genai_export, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(genai_export, copy)
    return copy


def _set(*keys_and_value):
    """An edit of a JSON object: the dotted key set to the value (None: removed)."""
    *keys, value = keys_and_value

    def edit(config):
        node = config
        for key in keys[:-1]:
            node = node[key]
        if value is None:
            node.pop(keys[-1])
        else:
            node[keys[-1]] = value

    return edit


DEC = ("model", "decoder")

# (edit of genai_config.json, the key the line names)
BAD_GENAI_CONFIGS = {
    "wrong logits name": (_set(*DEC, "outputs", "logits", "logitz"), "model.decoder.outputs.logits"),
    "wrong input name": (_set(*DEC, "inputs", "input_ids", "ids"), "model.decoder.inputs.input_ids"),
    "wrong past name": (_set(*DEC, "inputs", "past_key_names", "past.%d.k"), "model.decoder.inputs.past_key_names"),
    "a printf past name": (_set(*DEC, "inputs", "past_key_names", "past.%s.%d"), "model.decoder.inputs.past_key_names"),
    "missing vocab_size": (_set("model", "vocab_size", None), "model.vocab_size"),
    "zero vocab_size": (_set("model", "vocab_size", 0), "model.vocab_size"),
    "vocab_size not the logits'": (_set("model", "vocab_size", 255), "model.vocab_size"),
    "vocab_size a string": (_set("model", "vocab_size", "256"), "model.vocab_size"),
    "negative head size": (_set(*DEC, "head_size", -16), "model.decoder.head_size"),
    "head size not the graph's": (_set(*DEC, "head_size", 8), "model.decoder.head_size"),
    "kv heads not dividing": (_set(*DEC, "num_key_value_heads", 3), "model.decoder.num_key_value_heads"),
    "1e9 beams": (_set("search", "num_beams", 10**9), "search.num_beams"),
    "NaN temperature": (_set("search", "temperature", float("nan")), "search.temperature"),
    "max_length past the context": (_set("search", "max_length", 10**6), "search.max_length"),
    "1e9 layers": (_set(*DEC, "num_hidden_layers", 10**9), "model.decoder.num_hidden_layers"),
    "-1 layers": (_set(*DEC, "num_hidden_layers", -1), "model.decoder.num_hidden_layers"),
    "fewer layers than the graph": (_set(*DEC, "num_hidden_layers", 2), "model.decoder.num_hidden_layers"),
    "more layers than the graph": (_set(*DEC, "num_hidden_layers", 5), "model.decoder.num_hidden_layers"),
    "layers a float": (_set(*DEC, "num_hidden_layers", 4.0), "model.decoder.num_hidden_layers"),
    "zero context": (_set("model", "context_length", 0), "model.context_length"),
    "eos past the vocabulary": (_set("model", "eos_token_id", [1, 10**6]), "model.eos_token_id"),
    "decoder climbs out": (_set(*DEC, "filename", "../../model.decoder.onnx"), "model.decoder.filename"),
    "decoder absolute": (_set(*DEC, "filename", "/etc/passwd"), "model.decoder.filename"),
    "decoder missing": (_set(*DEC, "filename", "gone.onnx"), "gone.onnx"),
    "a decoder object": (_set("model", "decoder", []), "model.decoder"),
    "an unknown top-level key": (_set("speculative", {}), "'speculative'"),
}


@pytest.mark.parametrize("case", list(BAD_GENAI_CONFIGS))
def test_a_wrong_genai_config_is_one_line_naming_the_key_before_onnxruntime_genai_reads_it(
    genai_export, tmp_path, case
):
    from taperfold.runners.genai import GenaiRunner

    edit, key = BAD_GENAI_CONFIGS[case]
    folder = _copy(genai_export, tmp_path) / "genai" / "folded"
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    with pytest.raises(TaperfoldError) as refused:
        GenaiRunner(folder).load()
    line = str(refused.value)
    assert "\n" not in line and key in line and (str(path) in line or str(folder) in line), line


def test_a_wrong_genai_config_is_one_line_from_bench_and_verify(genai_export, tmp_path):
    copy = _copy(genai_export, tmp_path)
    path = copy / "genai" / "folded" / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"]["num_hidden_layers"] = 2
    path.write_text(json.dumps(config))
    bench = run_cli("bench", copy, "--engine", "genai", "--variants", "folded", *DECODE)
    one_line(bench, str(path), "model.decoder.num_hidden_layers", "is 2")
    one_line(run_cli("verify", copy, "--threads", "1"), str(path), "model.decoder.num_hidden_layers")


def test_a_decoder_symlinked_from_outside_the_folder_is_refused(genai_export, tmp_path):
    from taperfold.runners.genai import GenaiRunner

    folder = _copy(genai_export, tmp_path) / "genai" / "folded"
    outside = tmp_path / "elsewhere.onnx"
    shutil.move(folder / "model.decoder.onnx", outside)
    (folder / "model.decoder.onnx").symlink_to(outside)
    with pytest.raises(TaperfoldError, match="not a file of the folder itself"):
        GenaiRunner(folder).load()


@pytest.mark.parametrize(
    "make",
    [
        lambda p: os.mkfifo(p),
        lambda p: p.write_text("{not json"),
        lambda p: p.write_text("[1, 2]"),
        lambda p: p.write_bytes(b" " * (2 << 20)),
    ],
    ids=["fifo", "not json", "a list", "2 MB"],
)
def test_a_genai_config_that_is_no_json_object_is_one_line(genai_export, tmp_path, make):
    from taperfold.runners.genai import GenaiRunner

    folder = _copy(genai_export, tmp_path) / "genai" / "folded"
    (folder / "genai_config.json").unlink()
    make(folder / "genai_config.json")
    with pytest.raises(TaperfoldError, match=r"genai_config\.json") as refused:
        GenaiRunner(folder).load()
    assert "\n" not in str(refused.value)


# ---- manifest.json ------------------------------------------------------------------------------------------


def _edit_manifest(copy, edit) -> None:
    path = copy / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


GENAI_KEY = "folded.decoder.genai"


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (_set("artifacts", GENAI_KEY, "decoder", "../../../etc/passwd"), f"artifacts.{GENAI_KEY}.decoder"),
        (_set("artifacts", GENAI_KEY, "decoder", "/etc/passwd"), f"artifacts.{GENAI_KEY}.decoder"),
        (_set("artifacts", GENAI_KEY, "tokenizer", ["../../x.json"]), f"artifacts.{GENAI_KEY}.tokenizer"),
        (_set("artifacts", GENAI_KEY, "path", "/etc/passwd"), f"artifacts.{GENAI_KEY}.path"),
        (_set("source", "huggingface"), "'source'"),
        (_set("source", 3), "'source'"),
        (_set("source", []), "'source'"),
        (_set("source", {"format": ["huggingface"]}), "source.format"),
        (_set("source", {"tokenizer_files": ["../../etc/passwd"]}), "source.tokenizer_files"),
        (_set("source", {"tokenizer_files": "tokenizer.json"}), "source.tokenizer_files"),
        (_set("source", {"special_tokens": {"eos_token_id": "2"}}), "source.special_tokens"),
    ],
)
def test_a_manifest_path_out_of_the_export_or_a_source_of_the_wrong_type_is_one_line(genai_export, tmp_path, edit, key):
    copy = _copy(genai_export, tmp_path)
    _edit_manifest(copy, edit)
    for command in (("verify", copy), ("bench", copy, "--engine", "genai", *DECODE)):
        one_line(run_cli(*command), "manifest.json", key)


# ---- verify's --text and --tokens ---------------------------------------------------------------------------


def test_verify_text_refuses_devices_fifos_and_files_too_big_before_reading(genai_export, tmp_path):
    from taperfold.verify.inputs import MAX_INPUT_BYTES

    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as f:
        f.truncate(1 << 30)  # 1 GB, no block of it written
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    for path, needle in (("/dev/zero", "character device"), (fifo, "FIFO"), (sparse, str(MAX_INPUT_BYTES))):
        for option in ("--text", "--tokens"):
            one_line(run_cli("verify", genai_export, option, path), str(path), needle)
    assert not (genai_export / "verify.json").exists()


@pytest.mark.parametrize("word", ["--5", "+-1", "²", "٣", "1_0", "+5", "1" * 30, "0x10"])
def test_verify_tokens_take_plain_ascii_decimal_ids_only(genai_export, tmp_path, word):
    path = tmp_path / "ids.txt"
    path.write_text(f"1 2 {word}\n")
    one_line(run_cli("verify", genai_export, "--tokens", path), str(path), "is not an integer token id")


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        ({"descr": "<i8", "fortran_order": False, "shape": (10**18,)}, "claims 1000000000000000000 token ids"),
        ({"descr": "<i8", "fortran_order": False, "shape": (10**9, 10**9)}, "token ids"),
        ({"descr": "<i8", "fortran_order": False, "shape": (1000,)}, "file holds 16 bytes"),
        ({"descr": "|O", "fortran_order": False, "shape": (2,)}, "token ids must be integers"),
    ],
)
def test_verify_tokens_npy_header_is_checked_before_its_array_is_allocated(genai_export, tmp_path, header, needle):
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    path = tmp_path / "ids.npy"
    path.write_bytes(buffer.getvalue() + b"\1" * 16)
    one_line(run_cli("verify", genai_export, "--tokens", path), str(path), needle)


# ---- OpenVINO IR ----------------------------------------------------------------------------------------------


def _unblock_later(fifo):
    """A guard for a test that would otherwise hang: a writer opens `fifo` after a while (if a reader blocks on it,
    the reader gets end of file and the test fails instead of hanging)."""

    def open_writer():
        with contextlib.suppress(OSError):  # no reader: nothing blocked
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(20, open_writer)
    timer.daemon = True
    timer.start()
    return timer


@pytest.mark.parametrize("case", ["bin fifo", "xml fifo", "not xml", "xml of no IR"])
def test_an_openvino_ir_that_is_a_fifo_or_no_xml_is_one_line_before_openvino_opens_it(tmp_path, case):
    pytest.importorskip("openvino", reason="openvino is not installed")
    from taperfold.runners.openvino_ir import StatefulOpenVinoRunner

    folder = tmp_path / "ir"
    folder.mkdir()
    xml, weights = folder / "openvino_model.xml", folder / "openvino_model.bin"
    ir = '<?xml version="1.0"?>\n<net name="m" version="11"><layers></layers><edges></edges></net>\n'
    weights.write_bytes(b"\0" * 16)
    timer = None
    if case == "bin fifo":
        xml.write_text(ir)
        weights.unlink()
        os.mkfifo(weights)
        timer, needle = _unblock_later(weights), "FIFO"
    elif case == "xml fifo":
        os.mkfifo(xml)
        timer, needle = _unblock_later(xml), "FIFO"
    elif case == "not xml":
        xml.write_text("hello, not xml")
        needle = "not XML"
    else:
        xml.write_text('<?xml version="1.0"?>\n<html></html>\n')
        needle = "no <net>"
    try:
        with pytest.raises(TaperfoldError, match=needle) as refused:
            StatefulOpenVinoRunner(folder).load()
    finally:
        if timer is not None:
            timer.cancel()
    assert "\n" not in str(refused.value)
