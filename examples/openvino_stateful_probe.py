"""How much of optimum-intel's decode lead (docs/benchmarks.md, "OpenVINO against optimum-intel") the KV cache held in
OpenVINO's state buys alone: the folded growing decoder of an export as it is (each step hands the cache out and back
in) against the same graph made stateful by OpenVINO's own make-stateful transformation (pasts and presents become
variables, zeros of the prompt's batch to start), greedy decode of 64 tokens after 128, alternated in 5 rounds, the
two required to choose the same tokens.

    python examples/openvino_stateful_probe.py runs/openvino-bench/out/model.decoder.onnx

A probe of the first half of the fix: taperfold's stateful IR (`export --openvino`, taperfold.artifacts.openvino_ir)
holds the cache so and runs attention as ScaledDotProductAttention too.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import openvino as ov
from openvino import opset13
from openvino._offline_transformations import apply_make_stateful_transformation

CONFIG = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "2"}


def made_stateful(model: ov.Model) -> ov.Model:
    """As optimum-intel's make_stateful and build_state_initializer do it."""
    pasts = [i.get_any_name() for i in model.inputs if i.get_any_name().startswith("past_key_values")]
    apply_make_stateful_transformation(model, {p: p.replace("past_key_values", "present") for p in pasts})
    batch = opset13.gather(opset13.shape_of(model.input("input_ids"), output_type="i64"), opset13.constant([0]),
                           opset13.constant(0))  # fmt: skip
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.min_length for d in op.get_output_partial_shape(0)]
            dims[0] = batch
            dims = [opset13.constant(np.array([d], dtype=np.int64)) if isinstance(d, int) else d for d in dims]
            zero = opset13.constant(0.0, dtype=op.get_output_element_type(0))
            op.set_arguments([opset13.broadcast(zero, opset13.concat(dims, 0))])
    model.validate_nodes_and_infer_types()
    return model


def last_token(logits) -> np.ndarray:
    logits = np.asarray(logits)
    return (logits[:, -1] if logits.ndim == 3 else logits).argmax(-1)


def main() -> None:
    path = sys.argv[1]
    core = ov.Core()
    stateless = core.compile_model(core.read_model(path), "CPU", CONFIG)
    stateful = core.compile_model(made_stateful(core.read_model(path)), "CPU", CONFIG)
    plain_request, state_request = stateless.create_infer_request(), stateful.create_infer_request()
    pasts = [i for i in stateless.inputs if i.any_name.startswith("past_key_values")]

    def as_exported(ids, steps):
        shape = lambda p: (ids.shape[0], p.partial_shape[1].get_length(), 0, p.partial_shape[3].get_length())  # noqa: E731
        feeds = {"input_ids": ids, **{p.any_name: np.zeros(shape(p), np.float32) for p in pasts}}
        tokens, seconds = [], []
        for _ in range(steps + 1):
            start = time.perf_counter()
            out = plain_request.infer(feeds, share_outputs=False)
            results = {o.any_name: out[o] for o in stateless.outputs}
            token = last_token(results["logits"])
            seconds.append(time.perf_counter() - start)
            tokens.append(token)
            feeds = {"input_ids": token[:, None].astype(np.int64)}
            feeds |= {n.replace("present", "past_key_values"): v for n, v in results.items() if n.startswith("present")}
        return np.stack(tokens, 1), seconds

    def in_state(ids, steps):
        state_request.reset_state()
        tokens, seconds, feed = [], [], ids
        for _ in range(steps + 1):
            start = time.perf_counter()
            token = last_token(state_request.infer({"input_ids": feed})["logits"])
            seconds.append(time.perf_counter() - start)
            tokens.append(token)
            feed = token[:, None].astype(np.int64)
        return np.stack(tokens, 1), seconds

    contenders = {"as exported": as_exported, "stateful": in_state}
    rng = np.random.default_rng(0)
    vocab = stateless.output("logits").partial_shape[-1].get_length()
    for batch in (1, 4):
        ids = rng.integers(0, vocab, (batch, 128)).astype(np.int64)
        rates: dict[str, list[float]] = {name: [] for name in contenders}
        tokens = {}
        for run in contenders.values():
            run(ids, 4)  # warm-up
        for round_ in range(5):
            for name in list(contenders)[:: 1 if round_ % 2 == 0 else -1]:
                tokens[name], seconds = contenders[name](ids, 64)
                rates[name].append(batch * 64 / sum(seconds[1:]))
        medians = {name: round(float(np.median(r)), 1) for name, r in rates.items()}
        same = bool((tokens["as exported"] == tokens["stateful"]).all())
        print(json.dumps({"batch": batch, "decode_tok_s_median": medians, "same_tokens": same}))


if __name__ == "__main__":
    main()
