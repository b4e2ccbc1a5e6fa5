"""The export directory's contract: variant names and aliases, the graph types, file names and manifest keys, and
the decoder protocol's feeds. (manifest.json itself: test_manifest.py.)"""

import numpy as np
import pytest

from taperfold.errors import TaperfoldError
from taperfold.exportdir import (
    GRAPH_TYPES,
    GRAPHS,
    GROWING,
    KV_CACHES,
    PREFILL,
    STATIC,
    canonical_variant,
    canonical_variants,
    check_graph,
    decoder_io_names,
    graph_key,
    onnx_file,
    parse_graph_key,
    prompt_feeds,
    step_feeds,
)


def test_variant_names_and_files():
    assert canonical_variant("unfused") == "unfolded" and canonical_variant("folded") == "folded"
    assert canonical_variants(["unfused", "folded", "unfolded"]) == ["unfolded", "folded"]
    with pytest.raises(TaperfoldError, match=r"^unknown \['fast'\]; choose from baseline, unfolded, folded"):
        canonical_variants(["baseline", "fast"])
    assert [onnx_file(v) for v in ("baseline", "unfused", "folded")] == ["baseline.onnx", "unfolded.onnx", "model.onnx"]
    assert onnx_file("folded", GROWING) == "model.decoder.onnx"
    assert onnx_file("baseline-decomposed", STATIC) == "baseline.decomposed.static.onnx"
    assert graph_key("unfused", GROWING) == "unfolded.decoder"
    assert decoder_io_names(1) == (
        ["input_ids", "past_key_values.0.key", "past_key_values.0.value"],
        ["logits", "present.0.key", "present.0.value"],
    )


def test_a_graph_is_one_of_three_and_its_key_reads_back():
    assert GRAPHS == (PREFILL, GROWING, STATIC)
    for variant in ("baseline", "unfolded", "folded", "baseline-decomposed"):
        for graph in GRAPHS:
            assert parse_graph_key(graph_key(variant, graph)) == (variant, graph)
    assert parse_graph_key("engine") is None and parse_graph_key("folded.plan") is None
    for wrong in (True, False, "decoder", None):  # the spellings of the bool | str flag this replaced
        with pytest.raises(ValueError, match="a graph is one of"):
            check_graph(wrong)


def test_each_graph_type_says_if_it_carries_a_past_and_a_cache_of_fixed_length():
    prefill, growing, static = (GRAPH_TYPES[g] for g in GRAPHS)
    assert not prefill.has_past and not prefill.fixed_cache and not prefill.grows
    assert growing.has_past and not growing.fixed_cache and growing.grows
    assert static.has_past and static.fixed_cache and not static.grows
    assert KV_CACHES == (GROWING, STATIC)  # the types with a past
    assert decoder_io_names(1, STATIC)[0][:2] == ["input_ids", "cache_position"]  # a fixed cache is written at it


def test_every_graph_type_has_a_trace_spec():
    from taperfold.tracing import GRAPH_SPECS

    assert tuple(GRAPH_SPECS) == GRAPHS


class Shape:
    n_layers, kv_heads, head_dim = 2, 3, 4


def test_decoder_feeds_for_a_growing_and_a_static_cache():
    ids = np.arange(10, dtype=np.int64).reshape(2, 5)
    growing = prompt_feeds(Shape, ids, "fp32")
    assert growing["past_key_values.1.value"].shape == (2, 3, 0, 4) and "cache_position" not in growing
    static = prompt_feeds(Shape, ids, "fp16", cache_len=16)
    assert (
        static["past_key_values.0.key"].shape == (2, 3, 16, 4) and static["past_key_values.0.key"].dtype == np.float16
    )
    assert static["cache_position"].tolist() == [0, 1, 2, 3, 4]
    presents = {f"present.{i}.{kv}": f"buffer {i} {kv}" for i in range(2) for kv in ("key", "value")}
    step = step_feeds(Shape, ids[:, :1], presents, 5, static=True)
    assert step["past_key_values.1.key"] == "buffer 1 key" and step["cache_position"].tolist() == [5]
    assert "cache_position" not in step_feeds(Shape, ids[:, :1], presents, 5, static=False)
