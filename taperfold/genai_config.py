"""An onnxruntime-genai folder's `genai_config.json`, checked before onnxruntime-genai reads it: what it may say, to
which bounds, and against the decoder graph it names. Every problem is one line naming the file and the key.

genai's config names more than a shape: session options it hands ONNX Runtime (`custom_ops_library`, a shared
library it loads, from the folder or anywhere; `enable_profiling`, a path it writes to; any other key becomes a
session config entry), execution providers with their own options (library and backend paths among them), other
models to load (vision, speech, a draft decoder) and search defaults the runner would inherit. So the config is held
to an allow-list, not a deny-list: the keys taperfold writes itself (taperfold.artifacts.genai_folder.genai_config)
and those onnxruntime-genai's builder writes for the CPU, each with its type and range; any other key is refused.
A folder runs only with the options taperfold itself chose: no provider options, no library.

The decoder is then read without its weights: a plain file in the folder whose ops are all built into ONNX Runtime,
whose graph has the inputs and outputs the config names, one past and one present per layer for exactly
`num_hidden_layers` layers, and (where the graph's dims are fixed) the head count, head size and vocabulary the
config gives.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taperfold.errors import TaperfoldError, first_line
from taperfold.infiles import check_plain_file, read_plain_file
from taperfold.jsonfields import Fields, is_count, is_number

CONFIG = "genai_config.json"
MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB
MAX_VOCAB, MAX_WIDTH, MAX_HEADS, MAX_LAYERS, MAX_CONTEXT = 2**24, 2**16, 1024, 1024, 2**20  # as ModelConfig's
MAX_BEAMS = 64
_GQA_LAYER = re.compile(r"(?:^|/)layers\.(\d+)/")  # the builder's node names: /model/layers.3/attn/...

# genai's decoder-only model types (src/models/model_type.h, ModelType::IsLLM): the types that load one decoder and
# nothing else
LLM_TYPES = frozenset({
    "chatglm", "decoder", "ernie4_5", "gemma", "gemma2", "gemma3_text", "gemma4_text", "gpt2", "gptoss", "granite",
    "granitemoehybrid", "hunyuandensev1", "internlm2", "lfm2", "llama", "mistral", "nemotron", "olmo", "phi",
    "phimoe", "phi3", "phi3small", "qwen2", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "smollm3",
})  # fmt: skip
# genai's defaults for the names a config leaves out (src/config.h)
DEFAULT_NAMES = {
    "input_ids": "input_ids",
    "past_key_names": "past_key_values.%d.key",
    "past_value_names": "past_key_values.%d.value",
    "logits": "logits",
    "present_key_names": "present.%d.key",
    "present_value_names": "present.%d.value",
}


@dataclass(frozen=True)
class Rule:
    """What one key's value must be."""

    check: Callable[[Any], bool]
    expected: str


def _count(low: int, high: int) -> Rule:
    return Rule(lambda v: is_count(v) and low <= v <= high, f"an integer from {low} to {high}")


def _number(low: float, high: float) -> Rule:
    return Rule(lambda v: is_number(v) and math.isfinite(v) and low <= v <= high, f"a number from {low} to {high}")


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 256 and value.isprintable()


def _is_per_layer_name(value: Any) -> bool:
    """A name genai formats with the layer's index: one %d and no other conversion (it is a printf format)."""
    return _is_name(value) and value.count("%d") == 1 and "%" not in value.replace("%d", "")


NAME = Rule(_is_name, "a tensor name")
PER_LAYER = Rule(_is_per_layer_name, "a tensor name with one %d for the layer's index")
FLAG = Rule(lambda v: isinstance(v, bool), "true or false")
TOKEN = _count(0, MAX_VOCAB - 1)
TOKENS = Rule(
    lambda v: TOKEN.check(v) or (isinstance(v, list) and 0 < len(v) <= 256 and all(TOKEN.check(t) for t in v)),
    "a token id or a list of token ids",
)
PLAIN_NAME = Rule(
    lambda v: _is_name(v) and "/" not in v and "\\" not in v and v not in (".", ".."),
    "a file name in the folder (no directory part)",
)

# The keys a folder's config may hold, nested as the file nests them: a Rule for a value, a dict for an object.
SCHEMA: dict[str, Any] = {
    "model": {
        "type": Rule(lambda v: v in LLM_TYPES, "a decoder-only model type of onnxruntime-genai"),
        "vocab_size": _count(1, MAX_VOCAB),
        "context_length": _count(1, MAX_CONTEXT),
        **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"), TOKENS),
        **dict.fromkeys(("bot_token_id", "eot_token_id", "bor_token_id", "eor_token_id"), TOKEN),
        "decoder": {
            "session_options": {  # what reaches ONNX Runtime: no library, no provider, no path
                "log_id": NAME,
                "provider_options": Rule(
                    lambda v: v == [], "[] (taperfold runs onnxruntime-genai on the CPU, a provider it chooses itself)"
                ),
                "intra_op_num_threads": _count(0, 4096),
                "inter_op_num_threads": _count(0, 4096),
                "log_severity_level": _count(0, 4),
                "log_verbosity_level": _count(0, 4),
                "enable_cpu_mem_arena": FLAG,
                "enable_mem_pattern": FLAG,
                "graph_optimization_level": Rule(
                    lambda v: v in ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"),
                    "one of ORT_DISABLE_ALL, ORT_ENABLE_BASIC, ORT_ENABLE_EXTENDED, ORT_ENABLE_ALL",
                ),
            },
            "filename": PLAIN_NAME,
            "head_size": _count(1, MAX_WIDTH),
            "hidden_size": _count(1, MAX_WIDTH),
            "num_attention_heads": _count(1, MAX_HEADS),
            "num_hidden_layers": _count(1, MAX_LAYERS),
            "num_key_value_heads": _count(1, MAX_HEADS),
            "inputs": {
                "input_ids": NAME,
                "attention_mask": NAME,
                "position_ids": NAME,
                "past_key_names": PER_LAYER,
                "past_value_names": PER_LAYER,
            },
            "outputs": {"logits": NAME, "present_key_names": PER_LAYER, "present_value_names": PER_LAYER},
            "sliding_window": {
                "window_size": _count(1, MAX_CONTEXT),
                "slide_key_value_cache": FLAG,
                "slide_inputs": FLAG,
                "layers": Rule(
                    lambda v: isinstance(v, list) and all(is_count(i) and 0 <= i < MAX_LAYERS for i in v),
                    "a list of layer indices",
                ),
                "cache_slack": _count(0, MAX_CONTEXT),
            },
        },
    },
    "search": {
        "do_sample": FLAG,
        "early_stopping": FLAG,
        "past_present_share_buffer": FLAG,
        "max_length": _count(1, MAX_CONTEXT),
        "min_length": _count(0, MAX_CONTEXT),
        "num_beams": _count(1, MAX_BEAMS),
        "num_return_sequences": _count(1, MAX_BEAMS),
        "no_repeat_ngram_size": _count(0, MAX_CONTEXT),
        "top_k": _count(0, MAX_VOCAB),
        "top_p": _number(0, 1),
        "temperature": _number(0, 1e6),
        "repetition_penalty": _number(0, 1e6),
        "length_penalty": _number(-1e6, 1e6),
        "diversity_penalty": _number(0, 1e6),
        "random_seed": _count(-1, 2**31 - 1),
        "chunk_size": _count(1, MAX_CONTEXT),
    },
}
REQUIRED = {
    "": ("model",),
    "model": ("type", "vocab_size", "context_length", "decoder"),
    "model.decoder": (
        "filename", "head_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
    ),
}  # fmt: skip


def check_genai_folder(folder: str | os.PathLike) -> dict:
    """`folder`'s genai_config.json as it was checked (above), or one line naming the file and the key."""
    folder = Path(folder)
    path = folder / CONFIG
    try:
        config = json.loads(read_plain_file(path, "an onnxruntime-genai config", MAX_CONFIG_BYTES))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a number past Python's digit limit, deep nesting
        raise TaperfoldError(f"{path}: not valid JSON ({first_line(e)})") from None
    _check_keys(Fields(config, str(path)), SCHEMA)
    model = config["model"]
    decoder = model["decoder"]
    _check_consistent(str(path), config)
    _check_decoder_graph(path, folder / decoder["filename"], model)
    return config


def _check_keys(fields: Fields, schema: dict[str, Any]) -> None:
    """Every key of `fields` one `schema` allows, of its type and range, and the required ones there."""
    for name in fields.data:
        rule = schema.get(name)
        if rule is None:
            raise TaperfoldError(
                f"{fields.origin}: key '{fields.key(name)}' is not one taperfold runs a folder with (it writes no "
                "custom-op library, provider, session entry or other model into a config); remove it"
            )
        if isinstance(rule, dict):
            _check_keys(fields.child(name), rule)
        else:
            fields.value(name, rule.check, rule.expected)
    for name in REQUIRED.get(fields.path, ()):
        if name not in fields.data:
            raise TaperfoldError(f"{fields.origin}: missing key '{fields.key(name)}'")


def _check_consistent(origin: str, config: dict) -> None:
    """What the keys must say together."""
    model, search = config["model"], config.get("search", {})
    decoder = model["decoder"]
    if decoder["num_attention_heads"] % decoder["num_key_value_heads"]:
        raise TaperfoldError(
            f"{origin}: key 'model.decoder.num_key_value_heads' ({decoder['num_key_value_heads']}) must divide "
            f"'model.decoder.num_attention_heads' ({decoder['num_attention_heads']})"
        )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "bot_token_id", "eot_token_id", "bor_token_id",
                "eor_token_id"):  # fmt: skip
        ids = model.get(key, [])
        for token in ids if isinstance(ids, list) else [ids]:
            if token >= model["vocab_size"]:
                raise TaperfoldError(
                    f"{origin}: key 'model.{key}' is {token}, no token of the vocabulary ({model['vocab_size']} ids)"
                )
    for key in ("max_length", "min_length"):
        if search.get(key, 0) > model["context_length"]:
            raise TaperfoldError(
                f"{origin}: key 'search.{key}' ({search[key]}) is longer than 'model.context_length' "
                f"({model['context_length']})"
            )
    for layer in decoder.get("sliding_window", {}).get("layers", []):
        if layer >= decoder["num_hidden_layers"]:
            raise TaperfoldError(
                f"{origin}: key 'model.decoder.sliding_window.layers' names layer {layer} of a "
                f"{decoder['num_hidden_layers']}-layer decoder"
            )


def _check_decoder_graph(config_path: Path, decoder_path: Path, model: dict) -> None:
    """The decoder the config names against the config: a plain file in the folder, built-in ops, the names, the
    layer count and the fixed dims."""
    from taperfold.onnx_files import check_onnx_file, check_op_domains

    where = f"{config_path}: key 'model.decoder.filename'"
    if decoder_path.is_symlink() or os.path.realpath(decoder_path.parent) != os.path.realpath(config_path.parent):
        raise TaperfoldError(f"{where} names {decoder_path.name}, which is not a file of the folder itself")
    check_plain_file(decoder_path, "the decoder genai_config.json names")
    graph_model = check_onnx_file(decoder_path)
    check_op_domains(graph_model, decoder_path)
    graph = graph_model.graph
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name: o for o in graph.output}
    decoder = model["decoder"]
    names = {**DEFAULT_NAMES, **decoder.get("inputs", {}), **decoder.get("outputs", {})}
    layers = decoder["num_hidden_layers"]

    def missing(key: str, kind: str) -> TaperfoldError:
        group = "inputs" if kind == "input" else "outputs"
        return TaperfoldError(
            f"{config_path}: key 'model.decoder.{group}.{key}' names {kind} '{names[key]}', which "
            f"{decoder_path.name} does not have"
        )

    optional = [key for key in ("attention_mask", "position_ids") if key in decoder.get("inputs", {})]
    for key, values, kind in [("input_ids", inputs, "input"), ("logits", outputs, "output")] + [
        (key, inputs, "input") for key in optional
    ]:
        if names[key] not in values:
            raise missing(key, kind)
    for key, values, kind in (
        ("past_key_names", inputs, "input"),
        ("past_value_names", inputs, "input"),
        ("present_key_names", outputs, "output"),
        ("present_value_names", outputs, "output"),
    ):
        pattern = re.compile(re.escape(names[key]).replace("%d", r"(0|[1-9][0-9]*)"))
        found = {int(m[1]) for name in values if (m := pattern.fullmatch(name))}
        if not found:
            raise missing(key, kind)
        if found != set(range(layers)):
            raise TaperfoldError(
                f"{config_path}: key 'model.decoder.num_hidden_layers' is {layers}, and {decoder_path.name} has "
                f"{len(found)} {kind}(s) named '{names[key]}' (layers {_ranges(found)})"
            )
        if kind == "input":
            _check_fixed_dims(config_path, values[names[key] % 0], decoder)
    vocab = _fixed_dim(outputs[names["logits"]], -1)
    if vocab is not None and vocab != model["vocab_size"]:
        raise TaperfoldError(
            f"{config_path}: key 'model.vocab_size' is {model['vocab_size']}, and {decoder_path.name}'s logits have "
            f"{vocab}"
        )
    _check_window(config_path, decoder_path, decoder, attention_windows(graph))


def attention_windows(graph) -> dict[int, int]:
    """{layer: local_window_size} of each GroupQueryAttention node of `graph` (an onnx GraphProto) that names its
    layer as onnxruntime-genai's builder does (`/model/layers.3/attn/GroupQueryAttention`); -1 (its default): none."""
    windows = {}
    for node in graph.node:
        match = _GQA_LAYER.search(node.name)
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft" and match:
            size = next((a.i for a in node.attribute if a.name == "local_window_size"), -1)
            windows[int(match[1])] = size
    return windows


def _check_window(config_path: Path, decoder_path: Path, decoder: dict, windows: dict[int, int]) -> None:
    """A `sliding_window` section makes onnxruntime-genai keep the cache of each layer it lists (every layer where
    it lists none) as a window; a layer whose attention has no window then fails in GroupQueryAttention once the past
    passes the window (onnxruntime-genai 0.18's builder writes the section for a config that carries a window its
    layers do not use: SmolLM3 with use_sliding_window false)."""
    section = decoder.get("sliding_window")
    if section is None:
        return
    listed = section.get("layers") or []
    for layer in sorted(set(listed or range(decoder["num_hidden_layers"])) & set(windows)):
        if windows[layer] <= 0:
            which = f"layer {layer}'s" if listed else "every layer's (its 'layers' lists none)"
            raise TaperfoldError(
                f"{config_path}: key 'model.decoder.sliding_window' keeps {which} cache as a window of "
                f"{section.get('window_size')} tokens, and {decoder_path.name}'s attention of layer {layer} has no "
                "window (onnxruntime-genai fails once the past passes it)"
            )


def _fixed_dim(value_info, axis: int) -> int | None:
    dims = value_info.type.tensor_type.shape.dim
    if not dims or not -len(dims) <= axis < len(dims):
        return None
    dim = dims[axis]
    return dim.dim_value if dim.HasField("dim_value") else None


def _check_fixed_dims(config_path: Path, past, decoder: dict) -> None:
    """A past input [batch, kv heads, sequence, head size]: its fixed dims are the config's."""
    for axis, key in ((1, "num_key_value_heads"), (3, "head_size")):
        dim = _fixed_dim(past, axis)
        if dim is not None and dim != decoder[key]:
            raise TaperfoldError(
                f"{config_path}: key 'model.decoder.{key}' is {decoder[key]}, and the decoder's input "
                f"'{past.name}' has {dim}"
            )


def _ranges(indices: set[int]) -> str:
    if not indices:
        return "none"
    low, high = min(indices), max(indices)
    return f"{low}-{high}" if len(indices) == high - low + 1 else ", ".join(map(str, sorted(indices)[:8]))
