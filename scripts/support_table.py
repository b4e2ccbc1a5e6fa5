"""Run the user path over every causal-LM model type the installed transformers ships and write what happened.

For each `model_type` of transformers' AutoModelForCausalLM mapping (or those given with --types), a tiny model is
built offline from its config class (sizes shrunk; nothing downloaded) and saved with save_pretrained; then, as a
user would, each step through taperfold's command line in a child process with a time limit:

    taperfold inspect PLAIN --json
    taperfold train --from PLAIN --steps 30 --batch-size 2 --data CORPUS -o TAPERED
    taperfold inspect TAPERED --json
    taperfold export TAPERED -o OUT --no-baseline
    taperfold verify OUT --json

Per type it records the norms, how many were tapered and folded, verify's verdict, and the first line of the reason
for anything left (a step's error, an untapered norm's reason). The result is JSON (--json) and the Markdown table
docs/hf.md holds (--markdown), both naming the transformers version. A type takes one to three minutes on 2 cores
(`step_seconds` in the JSON: export is most of it), so the JSON is rewritten after every type and --resume goes on
from it after an interruption:

    .venv/bin/python scripts/support_table.py --json runs/support.json --markdown runs/support.md
    .venv/bin/python scripts/support_table.py --json runs/support.json --markdown runs/support.md --resume
    .venv/bin/python scripts/support_table.py --types llama,gpt_oss,qwen3_next --markdown -
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP_LIMIT_S = 900  # one command; a type whose step runs longer is recorded as timed out
# Sizes every config gets where it has the key (transformers' own names); the rest keep their defaults.
SMALL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "sliding_window": 64,
    "attention_chunk_size": 64,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 256,
    "num_kv_shared_layers": 0,
    "laurel_rank": 8,
    "unpadded_vocab_size": 256,  # Inkling's embedding rows past it are padding, cut on load and added back on save
}
GPT2_STYLE = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "n_inner": 128}
# Where one class's own validation asks more of the sizes above than they give
OWN_SIZES = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one entry per layer, as (kinds, repeats)
    "codegen": {"rotary_dim": 8},  # within the small head_dim (its default, 64, is the full-size one)
    "gptj": {"rotary_dim": 8},
    "xlnet": {"d_head": 16},
    "zaya": {"num_experts_per_tok": 1},
    # the towers write into the text model's hidden states: their width
    "dots3_note": {"vision_config": {"adapter_out_dim": 64}, "audio_config": {"adapter_out_dim": 64}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # no default: a model of the default config fails
    # the indexed layers' sizes have no defaults either
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
}
SCRATCH = re.compile(r"\S*taperfold-support-[^/\s]+/[^/\s]+/")  # a type's folder in the run's scratch directory
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # the defaults lie outside a tiny vocabulary


def small_config(model_type: str):
    """transformers' config for `model_type` at the sizes above (a nested text config shrunk too), or raise."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    probe = config_class()
    given = _small(probe, {**SMALL, **GPT2_STYLE})
    # under the attribute's own name: a class that aliases it (Zamba2's layers_block_type) derives other fields from
    # that one before the alias is set
    layer_types = getattr(config_class, "attribute_map", {}).get("layer_types", "layer_types")
    if layer_types in probe.to_dict():
        given[layer_types] = None  # recomputed for the new layer count, where the class derives it
    if {"expand", "num_heads", "head_dim"} <= set(probe.to_dict()):  # Mamba2: heads · head_dim = expand · hidden
        given["num_heads"] = given.get("hidden_size", probe.hidden_size) * probe.expand // given["head_dim"]
    kwargs = {**given, **TOKENS, **OWN_SIZES.get(model_type, {})}
    for key in ("text_config",):
        sub = getattr(probe, key, None)
        if sub is not None:
            sub_given = _small(sub, SMALL)
            full = sub.to_dict()
            layers = full.get("num_hidden_layers")
            # what the full-size text config holds per layer is derived again for the small one (or refused)
            kept = {k: v for k, v in full.items() if not (_per_layer(v, layers) or k == "per_layer_config")}
            kwargs[key] = {**kept, **sub_given, **TOKENS}
            kwargs[key].pop("layer_types", None)
    kinds = list(dict.fromkeys(getattr(probe, layer_types, None) or ()))
    layers = kwargs.get("num_hidden_layers", 0)
    if len(kinds) > 1 and layers:  # each kind of layer the full-size model has, in turn: a hybrid's every kind
        try:
            return config_class(**{**kwargs, layer_types: [kinds[i % len(kinds)] for i in range(layers)]})
        except Exception:  # noqa: BLE001 - a class with its own rule for where each kind goes derives them
            pass
    try:
        return config_class(**kwargs)
    except Exception:  # a class that refuses a null layer_types: its one kind
        if not kinds:
            raise
        return config_class(**{**kwargs, layer_types: kinds[:1] * layers})


def _small(config, sizes: dict) -> dict:
    """The entries of `sizes` that `config` takes."""
    given = {k: v for k, v in sizes.items() if _settable(config, k)}
    if "qk_rope_head_dim" in given:  # latent attention (MLA): head_dim is the rotary part's, every head keeps K/V
        given.pop("head_dim", None)
        given["num_key_value_heads"] = given["num_attention_heads"]
    return given


def _per_layer(value, layers) -> bool:
    """Whether `value` is a list with one entry per layer of a config with `layers` layers."""
    return isinstance(value, list) and isinstance(layers, int) and len(value) == layers > 2


def _settable(config, key: str) -> bool:
    """Whether `config` takes `key` (a field, or an attribute it maps to one); not a property it computes (Falcon's
    head_dim)."""
    if isinstance(getattr(type(config), key, None), property):
        return False
    try:
        return key in config.to_dict() or hasattr(config, key)
    except Exception:  # noqa: BLE001 - a per-layer attribute the whole config refuses to answer (Gemma 4's head_dim)
        return False


def save_plain(model_type: str, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(model_type))
    model.save_pretrained(folder)


def _taperfold(*args, timeout: int = STEP_LIMIT_S) -> tuple[int, str, str]:
    command = [sys.executable, "-m", "taperfold", *map(str, args)]
    try:
        r = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "", f"timed out after {timeout} s"
    return r.returncode, r.stdout, r.stderr


def _reason(stderr: str, code: int) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if not lines:  # killed (a negative code: the signal's number, e.g. -9 when memory ran out) or silent
        return f"exit code {code}, nothing on stderr"
    if any(line.startswith("Traceback") for line in lines):
        return _shortened(f"traceback: {lines[-1]}")
    return _shortened(lines[-1].removeprefix("taperfold: error: "))


def _shortened(line: str, limit: int = 320) -> str:
    """`line` cut in the middle where it is long: the file it names and the reason at its end both stay."""
    return line if len(line) <= limit else f"{line[: limit // 3]} … {line[-(2 * limit) // 3 :]}"


def run_type(model_type: str, root: Path, corpus: Path) -> dict:
    """The user path for one model type; what each step gave."""
    row: dict = {
        "model_type": model_type,
        "norms": None,
        "tapered": None,
        "folded": None,
        "verify": None,
        "stopped_at": None,
        "reason": "",
    }
    plain, tapered, out = root / "plain", root / "tapered", root / "out"
    build = subprocess.run(
        [sys.executable, __file__, "--save-plain", model_type, str(plain)],
        capture_output=True,
        text=True,
        timeout=STEP_LIMIT_S,
    )
    if build.returncode != 0:
        row.update(stopped_at="build", reason=_reason(build.stderr, build.returncode))
        return row
    steps = [
        ("inspect", ("inspect", plain, "--json")),
        ("train", ("train", "--from", plain, "--steps", "30", "--batch-size", "2", "--data", corpus, "-o", tapered)),
        ("inspect tapered", ("inspect", tapered, "--json")),
        ("export", ("export", tapered, "-o", out, "--no-baseline")),  # the fold's reach: no untapered graphs
        ("verify", ("verify", out, "--json")),
    ]
    row["step_seconds"] = {}
    for name, args in steps:
        start = time.perf_counter()
        code, stdout, stderr = _taperfold(*args)
        row["step_seconds"][name] = round(time.perf_counter() - start, 1)
        if name == "inspect" and code == 0:
            info = json.loads(stdout)
            row["norms"] = len(info["norms"])
            left = [
                f"{n['name']}: {n.get('reason') or n.get('foldable')}" for n in info["norms"] if not n["folds_into"]
            ]
            row["left_plain"] = left
        if name == "inspect tapered" and code == 0:
            info = json.loads(stdout)
            row["tapered"] = sum(1 for n in info["norms"] if n["tapered"])
            row["untapered"] = {n["name"]: n.get("reason", "") for n in info["norms"] if not n["tapered"]}
        if name == "export" and code == 0:
            manifest = json.loads((out / "manifest.json").read_text())
            row["folded"] = manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"]
        if name == "verify":
            row["verify"] = "PASS" if code == 0 else "FAIL" if code == 1 else "error"
            if code == 1:  # the worst pair and the bounds it breaks
                row["reason"] = _reason(stderr, code)
            if code in (0, 1):
                return row
        if code != 0:
            row.update(stopped_at=name, reason=_reason(stderr, code))
            return row
    return row


def markdown(rows: list[dict], version: str) -> str:
    lines = [
        f"Generated by `scripts/support_table.py` with transformers {version}: tiny random models built offline from "
        "each config class, 30 steps of `train --from`, then `export --no-baseline` and `verify`.",
        "",
        "| model_type | norms | tapered | folded | verify | stopped at | reason |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(value) -> str:
        return "–" if value is None else str(value).replace("|", "\\|")

    for r in rows:
        reason = SCRATCH.sub("", r["reason"])  # "plain/config.json: ...", not the run's temporary directory
        lines.append(
            f"| {r['model_type']} | {cell(r['norms'])} | {cell(r['tapered'])} | {cell(r['folded'])} | "
            f"{cell(r['verify'])} | {cell(r['stopped_at'])} | {cell(reason)} |"
        )
    return "\n".join(lines) + "\n"


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, target)


def _json(rows: list[dict], version: str) -> str:
    return json.dumps({"transformers": version, "rows": rows}, indent=1) + "\n"


def _done_rows(path: str | None, version: str, parser: argparse.ArgumentParser) -> list[dict]:
    """The rows of an earlier run at `path` to go on from (none when it is not there yet)."""
    if not path or path == "-":
        parser.error("--resume needs --json FILE: the rows to go on from")
    if not Path(path).exists():
        return []
    try:
        earlier = json.loads(Path(path).read_text())
        rows, ran_on = earlier["rows"], earlier["transformers"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--resume: {path} is no earlier run of this script ({e})")
    if ran_on != version:
        parser.error(f"--resume: {path} ran on transformers {ran_on}, this is {version}: start a new file")
    return list(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--json", dest="json_path", help="write the rows as JSON here ('-': stdout)")
    parser.add_argument("--markdown", help="write the Markdown table here ('-': stdout)")
    parser.add_argument("--resume", action="store_true", help="keep the rows --json already holds; run the rest")
    parser.add_argument("--save-plain", nargs=2, metavar=("TYPE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save_plain:  # the child that builds one tiny model (a crash there is that type's, not the run's)
        save_plain(args.save_plain[0], Path(args.save_plain[1]))
        return
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.types.split(",") if args.types else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = [t for t in types if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        parser.error(f"--types: {unknown[0]!r} is no causal-LM model type of transformers {transformers.__version__}")
    rows = _done_rows(args.json_path, transformers.__version__, parser) if args.resume else []
    done = {r["model_type"] for r in rows}
    with tempfile.TemporaryDirectory(prefix="taperfold-support-") as scratch:
        corpus = Path(scratch) / "corpus.txt"
        corpus.write_bytes(Path(json.__file__).read_bytes() * 8)  # a standard-library file as text: offline
        for i, model_type in enumerate(types, 1):
            if model_type in done:
                continue
            start = time.perf_counter()
            root = Path(scratch) / model_type
            root.mkdir()
            row = run_type(model_type, root, corpus)
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(
                f"[{i}/{len(types)}] {model_type}: {row['verify'] or 'stopped at ' + str(row['stopped_at'])} "
                f"({row['seconds']} s) {row['reason'][:120]}",
                file=sys.stderr,
                flush=True,
            )
            subprocess.run(["rm", "-rf", str(root)], check=False)
            if args.json_path and args.json_path != "-":  # kept after every type: an hour-long run can stop
                _write(args.json_path, _json(rows, transformers.__version__))
    rows.sort(key=lambda r: r["model_type"])
    if args.json_path:
        _write(args.json_path, _json(rows, transformers.__version__))
    if args.markdown:
        _write(args.markdown, markdown(rows, transformers.__version__))


if __name__ == "__main__":
    main()
