"""The export directory's contract: what `taperfold export` writes and everything else reads.

    DIR/manifest.json          what was exported, from which checkpoint, with which options, and every artifact
                               (taperfold.manifest)
    DIR/baseline.onnx          ordinary RMSNorm / LayerNorm in its fused form: the benchmark's reference
    DIR/baseline.decomposed.onnx  the same RMSNorm as plain ops (what hand-written norms export to)
    DIR/unfolded.onnx          tapered norms at g = 0 as explicit constant multiplies
    DIR/model.onnx             those constants folded into their readers (the "folded" variant)
    DIR/*.decoder.onnx         KV-cached decoders of each variant, the cache growing every step (`export --kv-cache`)
    DIR/*.static.onnx          KV-cached decoders with a static cache: fixed-size buffers written at a position
                               (`export --kv-cache static`)
    DIR/*.plan                 TensorRT engines (`export --trt`, or built by `bench --engine trt`)
    DIR/*.onnx.data            each graph's weights (external data)

`VARIANT_TABLE` names every variant with its files and meaning; `unfused` (the paper's word) is accepted
wherever a user types `unfolded`. `GRAPH_TYPES` describes the graphs a variant may have (prefill and the
KV-cached decoders: file suffix, past, cache), `GRAPHS` names them. Other modules ask this one for file names, dtypes,
graph types and decoder tensor names instead of spelling them out (CLI choices and docs/design.md's variant table come
from it); artifact kinds (taperfold.artifacts) name their files from these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from taperfold.errors import TaperfoldError

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Variant:
    """One row of the variant table: what a variant is, and what its files are called."""

    name: str
    stem: str  # its files: STEM.onnx, STEM.decoder.onnx / STEM.static.onnx (--kv-cache), STEM.plan (TensorRT)
    meaning: str
    default: bool = False  # in the set bench and verify take when none is named
    exported: bool = True  # written by `taperfold export` (else a reference built for timing only)
    aliases: tuple[str, ...] = ()  # other spellings a user may type


BASELINE, UNFOLDED, FOLDED = "baseline", "unfolded", "folded"
DECOMPOSED_BASELINE, NONORM = "baseline-decomposed", "nonorm"

# The variants, in report order. The folded model is the deployable one: model.onnx / model.plan.
VARIANT_TABLE = (
    Variant(
        BASELINE,
        "baseline",
        "the same weights with the model's own untapered norms, in their fused form: "
        "the reference every speedup is measured against",
        default=True,
    ),
    Variant(
        UNFOLDED,
        "unfolded",
        "the tapered model at g = 0: each tapered norm an explicit constant map (the paper's Internal-Taper unfused)",
        default=True,
        aliases=("unfused",),
    ),
    Variant(
        FOLDED, "model", "those constant maps folded into the layers that read them: what you deploy", default=True
    ),
    Variant(
        DECOMPOSED_BASELINE,
        "baseline.decomposed",
        "the baseline with RMSNorm as plain ops, as hand-written "
        "norms export (RMS families; a weaker reference, reported apart)",
    ),
    Variant(
        NONORM,
        "nonorm",
        "the tapered norms deleted, weights unscaled: not the same function, the timing a "
        "fold with zero residue matches",
        exported=False,
    ),
)
VARIANTS_BY_NAME = {v.name: v for v in VARIANT_TABLE}
VARIANTS = tuple(v.name for v in VARIANT_TABLE if v.default)  # the default set of bench and verify
ALL_VARIANTS = tuple(v.name for v in VARIANT_TABLE if v.exported)  # every variant `taperfold export` may write
NAMEABLE_VARIANTS = tuple(VARIANTS_BY_NAME)  # what a user may name
ALIASES = {alias: v.name for v in VARIANT_TABLE for alias in v.aliases}

DTYPES = ("fp32", "fp16", "bf16")
LOGITS = ("last", "all")

INPUT = "input_ids"
OUTPUT = "logits"


def canonical_variant(name: str) -> str:
    """`name` as the report and the manifest spell it; `unfused` is the paper's word for `unfolded`."""
    name = ALIASES.get(name, name)
    if name not in NAMEABLE_VARIANTS:
        choices = ", ".join([*NAMEABLE_VARIANTS, *(f"{a} (= {v})" for a, v in ALIASES.items())])
        raise TaperfoldError(f"unknown variant {name!r}; choose from {choices}")
    return name


def canonical_variants(names: list[str]) -> list[str]:
    """Canonical names of `names`, in order, without repeats; one error listing every unknown name."""
    unknown = [n for n in names if n not in NAMEABLE_VARIANTS and n not in ALIASES]
    if not names or unknown:
        aliases = ", ".join(f"{a} (= {v})" for a, v in ALIASES.items())
        raise TaperfoldError(f"unknown {unknown or names}; choose from {', '.join(NAMEABLE_VARIANTS)}, or {aliases}")
    return list(dict.fromkeys(ALIASES.get(n, n) for n in names))


# The graphs a variant may have: the prefill graph (a whole prompt, no cache: the paper's benchmark) and KV-cached
# decoders, each a graph of its own named by its file suffix: growing (past + new every step, so every step has new
# shapes) and static (buffers of a fixed length written at a position: every step has the same shapes). Wherever code
# names a graph it is one of GRAPHS; `export --kv-cache` alone still means the growing decoder (the CLI's alias).
Graph = Literal["prefill", "growing", "static"]
PREFILL: Graph = "prefill"
GROWING: Graph = "growing"
STATIC: Graph = "static"


@dataclass(frozen=True)
class GraphType:
    """What the modules that run, verify and time a graph ask of its type, looked up instead of branched on
    (torch-free; how the type is traced is tracing.GRAPH_SPECS)."""

    file_suffix: str  # its files STEM{suffix}.onnx and its manifest key VARIANT{suffix}
    has_past: bool  # a KV-cached decoder: takes past_key_values.*, returns logits and present.*
    # its cache is buffers of one length (export --max-cache), written in place at `cache_position` (an input): the
    # presents are the pasts, and every step has the same shapes
    fixed_cache: bool = False

    @property
    def grows(self) -> bool:
        """Its cache grows by the new tokens every call: every step has new shapes."""
        return self.has_past and not self.fixed_cache


GRAPH_TYPES: dict[Graph, GraphType] = {
    PREFILL: GraphType("", has_past=False),
    GROWING: GraphType(".decoder", has_past=True),
    STATIC: GraphType(".static", has_past=True, fixed_cache=True),
}
GRAPHS: tuple[Graph, ...] = tuple(GRAPH_TYPES)
KV_CACHES: tuple[Graph, ...] = tuple(g for g, t in GRAPH_TYPES.items() if t.has_past)  # the decoders


def check_graph(graph: str) -> Graph:
    """`graph` if it names one of GRAPHS, else a ValueError (a programming error: users name caches through flags)."""
    if graph not in GRAPHS:
        raise ValueError(f"a graph is one of {GRAPHS}, got {graph!r}")
    return graph


def kv_cache(name: str) -> Graph:
    """The decoder graph `--kv-cache` names, or one line listing what it takes."""
    if name not in KV_CACHES:
        raise TaperfoldError(f"--kv-cache must be {' or '.join(KV_CACHES)} (or both, comma-separated), got {name}")
    return check_graph(name)


def graph_key(variant: str, graph: Graph = PREFILL) -> str:
    """`folded`, `unfolded.decoder`, `folded.static`...: how manifest.json and reports name a variant's graph."""
    return canonical_variant(variant) + GRAPH_TYPES[check_graph(graph)].file_suffix


def onnx_file(variant: str, graph: Graph = PREFILL) -> str:
    """`model.onnx`, `unfolded.decoder.onnx`, `model.static.onnx`...: the file name export writes for a variant."""
    return f"{VARIANTS_BY_NAME[canonical_variant(variant)].stem}{GRAPH_TYPES[check_graph(graph)].file_suffix}.onnx"


def parse_graph_key(key: str) -> tuple[str, Graph] | None:
    """(variant, graph) of a key `graph_key` wrote, or None."""
    for graph, graph_type in GRAPH_TYPES.items():
        suffix = graph_type.file_suffix
        variant = key.removesuffix(suffix) if suffix else key
        if (not suffix or key.endswith(suffix)) and variant in VARIANTS_BY_NAME:
            return variant, graph
    return None


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def numpy_dtype(name: str):
    """The numpy type of `name`; bf16 has none (numpy has no bfloat16), so feeding it raises a TaperfoldError."""
    import numpy as np

    if name == "bf16":
        raise TaperfoldError("numpy has no bfloat16: bf16 tensors cannot be fed from the host")
    return {"fp32": np.float32, "fp16": np.float16}[name]


PAST = "past_key_values."  # the prefix of a decoder's cache inputs
# A static decoder's positions of the new tokens (int64 [sequence]), as transformers' StaticCache names them; where
# its keys and values are written in the cache, and how far each query sees
CACHE_POSITION = "cache_position"
# What the torch runner's static decoder also returns: the greedy token of the last position, [batch, 1] int64,
# computed on the device (fed back as the next step's input_ids without a trip to the host)
NEXT_TOKEN = "next_token"


def decoder_io_names(n_layers: int, graph: Graph = GROWING) -> tuple[list[str], list[str]]:
    """Input and output names of a KV-cached decoder, as optimum and onnxruntime-genai name them: `input_ids`,
    (`cache_position` for a static cache), `past_key_values.{i}.key|value` → `logits`, `present.{i}.key|value`. A
    static cache's present is its past, written at the positions: onnxruntime-genai's past_present_share_buffer
    binds the two to one buffer (shape [batch, kv_heads, cache length, head_dim])."""
    past = [f"{PAST}{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    positions = [CACHE_POSITION] if GRAPH_TYPES[check_graph(graph)].fixed_cache else []
    return [INPUT, *positions, *past], [OUTPUT, *present]


def shared_cache_buffers(n_layers: int) -> dict[str, str]:
    """A static decoder's outputs that may share their input's buffer: present name -> past name."""
    inputs, outputs = decoder_io_names(n_layers, STATIC)
    return dict(zip(outputs[1:], inputs[2:]))


# ---- the decoder protocol: what a caller feeds a KV-cached decoder, step by step ----------------------------------
# Growing cache: the prompt runs with an empty past (length 0) through the same graph as every later step, each
# step's present one longer than its past. Static cache: `cache_len` zeros, `cache_position` saying where the new
# tokens go (0..prompt-1, then one position per step); the presents are the cache buffers, written in place.
# `cfg` is the model's shape: anything with n_layers, kv_heads and head_dim (a ModelConfig, an HF model's info).


def empty_cache(cfg: Any, batch: int, dtype: str, cache_len: int | None = None) -> dict[str, np.ndarray]:
    """The cache before the prompt: past length 0 (growing), or `cache_len` zeros (static)."""
    import numpy as np

    names = [n for n in decoder_io_names(cfg.n_layers)[0] if n != INPUT]
    shape = (batch, cfg.kv_heads, cache_len or 0, cfg.head_dim)
    return {name: np.zeros(shape, dtype=numpy_dtype(dtype)) for name in names}


def prompt_feeds(cfg: Any, ids: np.ndarray, dtype: str, cache_len: int | None = None) -> dict:
    """The feeds of the prompt call: an empty growing cache, or (with `cache_len`) a static one and the prompt's
    positions."""
    import numpy as np

    feeds = {INPUT: ids, **empty_cache(cfg, ids.shape[0], dtype, cache_len)}
    if cache_len is not None:
        feeds[CACHE_POSITION] = np.arange(ids.shape[1], dtype=np.int64)
    return feeds


def step_feeds(cfg: Any, tokens: Any, previous: dict, position: int, static: bool) -> dict:
    """The feeds of one step: `tokens` ([batch, 1], host or the runner's own), the presents of the `previous` call as
    the past, and for a static cache the step's `position`."""
    import numpy as np

    inputs, outputs = decoder_io_names(cfg.n_layers, STATIC if static else GROWING)
    cache_inputs = [n for n in inputs if n not in (INPUT, CACHE_POSITION)]
    feeds = {INPUT: tokens, **{past: previous[present] for past, present in zip(cache_inputs, outputs[1:])}}
    if static:
        feeds[CACHE_POSITION] = np.array([position], dtype=np.int64)
    return feeds
