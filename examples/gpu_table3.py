"""The paper's Table 3 on a GPU, every way taperfold can run it, with the paper's numbers and the physical floor.

On a machine with a CUDA GPU (H100 / H200), from the repository root (see docs/benchmarks.md, "GPU"):

    python examples/gpu_table3.py run OUT            # about 30-60 minutes; every JSON lands in OUT/
    python examples/gpu_table3.py render OUT         # OUT/gpu_table3.md and OUT/gpu_table3.png from the JSONs
    python examples/gpu_table3.py plan OUT           # print the commands `run` would run, run nothing
    python examples/gpu_table3.py prepare OUT        # only the checkpoint and exports (e.g. while the GPU is busy)
    python examples/gpu_table3.py device OUT --budget-s 540 --ort-parts /tmp/ortparts   # all of it within a budget

`device` is the one prepared script for a lent GPU machine, whose device time is short (docs/benchmarks.md, "GPU"):
onnxruntime-gpu assembled and installed from its parts (../shared/gpu/README.md), then every measurement below in
the order of what matters most (KV-cached decode first), each bench run given what is left of the budget; a run
that would start too late is recorded as skipped in OUT/runs.json rather than cut off. `--cpu` runs the same
steps on the CPU with the tiny preset (no CUDA graphs, no torch.compile, fp32 ORT, 2 timed calls in 2 rounds): the
dry run the tests make.

`run` writes a paper-30m checkpoint (random weights at g = 0), exports it in fp16 and bf16 with KV-cached decoders,
adds the `nonorm` reference (no tapered norm at all) to each export, then runs `taperfold bench` once per
configuration, each in its own process (a failure is logged in OUT/runs.json and the rest go on):

    torch eager + torch CUDA graph     bench --engine torch --cuda-graph          (one run: rows side by side)
    torch compile (reduce-overhead)    bench --engine torch --compile --compile-mode reduce-overhead
    ORT CUDA + ORT CUDA graph          bench DIR --engine ort --device cuda --cuda-graph

each in bf16 and fp16, prefill (B 1, 4 x T 128, 256, 512) and KV-cached decode (prompt 128 + 32 steps, B 1, 4;
ORT decodes fp16 only: numpy has no bfloat16 for the cache), variants baseline, unfolded, folded, nonorm,
alternated in rounds (taperfold bench's medians; CV recorded per cell). `render` reads every taperfold-bench JSON
in OUT; its arithmetic is tested on the CPU (tests/test_bench_floors.py, tests/test_gpu_table3.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taperfold.bench.floors import decode_floor, gpu_spec, prefill_floor
from taperfold.bench.report import FORMAT, check_report, throughput_stats
from taperfold.errors import TaperfoldError
from taperfold.models import ModelConfig

# Table 3 of the paper (/work/shared/papers/tapernorm-kanavalau-2026.txt): k tokens/s, H100 80GB, bf16, torch eager,
# last-token logits; (baseline, Internal-Taper unfused, Internal-Taper fused = taperfold's folded).
PAPER_TABLE3 = {
    (1, 128): (40.7, 45.9, 48.7),
    (1, 256): (79.3, 90.8, 96.8),
    (1, 512): (163.2, 181.7, 195.5),
    (4, 128): (149.3, 169.3, 180.4),
    (4, 256): (290.5, 323.6, 344.9),
    (4, 512): (546.3, 588.1, 615.9),
}
BATCHES, SEQS, PROMPT, NEW_TOKENS = (1, 4), (128, 256, 512), 128, 32
VARIANTS = "baseline,unfolded,folded,nonorm"
DTYPES = ("bf16", "fp16")
# configuration label of a row: (engine, execution) -> how the tables name it, in the order they show it
CONFIGS = {
    ("torch", "eager"): "torch eager",
    ("torch", "cuda-graph"): "torch CUDA graph",
    ("torch", "compile:reduce-overhead"): "torch compile (reduce-overhead)",
    ("torch", "compile:default"): "torch compile",
    ("torch", "compile:max-autotune"): "torch compile (max-autotune)",
    ("ort", "eager"): "ORT CUDA",
    ("ort", "cuda-graph"): "ORT CUDA graph",
}


# ---- run ------------------------------------------------------------------------------------------------------


def taperfold_cmd() -> list[str]:
    return [sys.executable, "-m", "taperfold"]


def plan(
    out: Path, iters: int, warmup: int, rounds: int, batches: tuple[int, ...] = BATCHES
) -> list[tuple[str, list[str]]]:
    """(name, argv) of every bench run; each writes OUT/NAME.json (NAME ends in -b1 etc. for a subset of batches,
    so that a long configuration can be run in parts)."""
    ckpt = out / "work" / "paper30m.pt"
    timing = ["--iters", str(iters), "--warmup", str(warmup), "--rounds", str(rounds), "--variants", VARIANTS]
    prefill = ["--batch", ",".join(map(str, batches)), "--seq", ",".join(map(str, SEQS))]
    decode = [
        "--mode",
        "decode",
        "--batch",
        ",".join(map(str, batches)),
        "--prompt",
        str(PROMPT),
        "--new-tokens",
        str(NEW_TOKENS),
    ]
    runs = []
    for dtype in DTYPES:
        torch_src = ["bench", "--checkpoint", str(ckpt), "--engine", "torch", "--device", "cuda", "--dtype", dtype]
        ort_src = ["bench", str(out / "work" / f"export-{dtype}"), "--engine", "ort", "--device", "cuda"]
        for mode, shape in (("prefill", prefill), ("decode", decode)):
            runs.append((f"torch-{dtype}-{mode}-eager-graph", torch_src + shape + timing + ["--cuda-graph"]))
            runs.append(
                (
                    f"torch-{dtype}-{mode}-compile",
                    torch_src + shape + timing + ["--compile", "--compile-mode", "reduce-overhead"],
                )
            )
            if not (mode == "decode" and dtype == "bf16"):
                runs.append((f"ort-{dtype}-{mode}-eager-graph", ort_src + shape + timing + ["--cuda-graph"]))
    if tuple(batches) != BATCHES:
        runs = [(name + "-b" + "-".join(map(str, batches)), argv) for name, argv in runs]
    return [(name, taperfold_cmd() + argv + ["--json", str(out / f"{name}.json")]) for name, argv in runs]


def add_nonorm(export_dir: Path, ckpt: Path) -> None:
    """Export the `nonorm` reference (taperfold.variants.without_norms) next to the others and list it in
    manifest.json (artifacts.nonorm, .decoder, .static), for every graph the folded variant has, as export would
    with the same options."""
    import torch

    from taperfold.artifacts.base import details_of
    from taperfold.artifacts.onnx_graph import ONNX_GRAPH, OnnxDetails
    from taperfold.checkpoint import load_checkpoint
    from taperfold.export import ExportOptions
    from taperfold.exportdir import GRAPHS, NONORM, STATIC, torch_dtype
    from taperfold.manifest import read_manifest
    from taperfold.tracing import export_to_ir
    from taperfold.variants import without_norms

    manifest = read_manifest(export_dir)
    model = without_norms(load_checkpoint(ckpt).build(gate=0.0)).to(torch_dtype(manifest.dtype)).eval()
    with torch.no_grad():
        for graph in GRAPHS:
            folded = manifest.find("folded", graph)
            if folded is None:
                continue
            opset = details_of(folded, OnnxDetails).opset  # the same opset as the folded graph it is compared with
            decoders = (STATIC,) if graph == STATIC else ()
            opts = ExportOptions(
                logits=manifest.logits,
                dtype=manifest.dtype,
                opset=opset,
                decoders=decoders,
                max_cache=manifest.max_cache,
            )
            model_ir = export_to_ir(model, opts, graph)
            manifest.add_artifact(
                ONNX_GRAPH.write(model_ir, export_dir, NONORM, graph, manifest.dtype, OnnxDetails(opset=opset))
            )
    manifest.write()


def prepare(out: Path, dtypes: tuple[str, ...] = DTYPES) -> dict:
    """The checkpoint and, for each dtype, its export with the `nonorm` reference added; what exists is reused.
    Returns the environment the bench processes run in."""
    work = out / "work"  # checkpoint and exports: large, not meant for docs/ (kept so that reruns reuse them)
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    ckpt = work / "paper30m.pt"
    if not ckpt.exists():
        subprocess.run(
            [sys.executable, str(Path(__file__).with_name("random_checkpoint.py")), "paper-30m", str(ckpt)],
            check=True,
            env=env,
        )
    for dtype in dtypes:
        export_dir = work / f"export-{dtype}"
        if not (export_dir / "manifest.json").exists():
            subprocess.run(
                [*taperfold_cmd(), "export", str(ckpt), "-o", str(export_dir), "--dtype", dtype, "--kv-cache"],
                check=True,
                env=env,
            )
        if "nonorm" not in json.loads((export_dir / "manifest.json").read_text())["artifacts"]:
            add_nonorm(export_dir, ckpt)
    return env


def run(out: Path, iters: int, warmup: int, rounds: int, only: str | None, batches: tuple[int, ...]) -> None:
    runs = [(n, a) for n, a in plan(out, iters, warmup, rounds, batches) if not only or only in n]
    # torch runs need only the checkpoint; exports are made for the dtypes whose ORT runs are selected
    env = prepare(out, tuple(d for d in DTYPES if any(n.startswith(f"ort-{d}-") for n, _ in runs)))
    run_benches(out, runs, env)


def run_benches(out: Path, runs: list[tuple[str, list[str]]], env: dict) -> dict:
    """Run each (name, argv) as its own process, logging to OUT/NAME.log and indexing in OUT/runs.json; a failed
    run with --cuda-graph is rerun without it, so that its eager rows are still measured."""
    index_path = out / "runs.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    for name, argv in runs:
        code = _run_one(out, name, argv, env, index)
        if code != 0 and "--cuda-graph" in argv:
            # a graph that cannot be captured (e.g. ORT placing a bf16 node on the CPU) must not cost the eager rows
            eager = [a for a in argv if a != "--cuda-graph"]
            eager[-1] = str(out / f"{name.removesuffix('-eager-graph')}-eager-only.json")
            _run_one(out, f"{name.removesuffix('-eager-graph')}-eager-only", eager, env, index)
    return index


def _run_one(out: Path, name: str, argv: list[str], env: dict, index: dict, timeout: float | None = None) -> int:
    print(f"== {name}: taperfold {' '.join(argv[3:])}", flush=True)
    start = time.time()
    with open(out / f"{name}.log", "w") as log:
        try:
            code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124  # as timeout(1) reports it
    # the command as a reader reruns it: OUT for the folder given to `run`, not this machine's path
    index[name] = {
        "command": " ".join(["taperfold", *argv[3:]]).replace(str(out), "OUT"),
        "exit_code": code,
        "seconds": round(time.time() - start, 1),
    }
    (out / "runs.json").write_text(json.dumps(index, indent=2))
    print(f"   exit {code} in {index[name]['seconds']} s", flush=True)
    return code


# ---- device: everything in one budgeted run -----------------------------------------------------------------

# SmolLM2-135M's shape as taperfold's own Llama (the GPU machine has no transformers): the decode model of
# docs/benchmarks.md's CPU tables.
SMOLLM2_135M = dict(
    vocab_size=49_152,
    d_model=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    d_ff=1536,
    max_seq_len=2048,
    tie_embeddings=True,
)
DEVICE_TIMING = ["--iters", "20", "--warmup", "5", "--rounds", "5"]
# the dry run checks that every step runs and writes its report, not its timings: 2 timed calls in 2 rounds
DRY_RUN_TIMING = ["--iters", "2", "--warmup", "1", "--rounds", "2"]
SMOLLM2_RUN = "smollm2"  # in the names of the device run's SmolLM2-135M steps
MIN_RUN_S = 45  # a bench run given less than this is skipped: it would be cut off before writing its JSON


@dataclass(frozen=True)
class Step:
    """One command of the device run; `needs` names the export (a key of device_models) it runs on, if any."""

    name: str
    argv: list[str]
    needs: str | None = None


def device_models(work: Path, cpu: bool) -> dict[str, tuple[str, dict, str]]:
    """name -> (preset, config overrides, export dtype): the models the device run builds, in work/."""
    if cpu:  # the dry run: the same steps on the tiny preset, in the dtype ORT's CPU build runs
        return {"paper30m": ("tiny", {}, "fp32"), "smollm2": ("tiny", {"n_kv_heads": 2}, "fp32")}
    return {"paper30m": ("paper-30m", {}, "fp16"), "smollm2": ("paper-30m", SMOLLM2_135M, "fp16")}


def device_plan(out: Path, cpu: bool, work: Path | None = None) -> list[Step]:
    """Every bench run of the device run, most important first: KV-cached decode (the issue's first target), then
    Table 3's prefill cells, then SmolLM2-135M's decode on ORT, then torch.compile (slow to build)."""
    work, device = work or out / "work", "cpu" if cpu else "cuda"
    graph = [] if cpu else ["--cuda-graph"]
    ckpt = str(work / "paper30m.pt")
    torch_dtype = "fp32" if cpu else "bf16"
    decode = ["--mode", "decode", "--batch", "1,4", "--prompt", "128", "--new-tokens", "32"]
    if cpu:  # the tiny preset's context is 128 tokens
        decode = ["--mode", "decode", "--batch", "1,4", "--prompt", "32", "--new-tokens", "8"]
    prefill = ["--batch", "1,4", "--seq", "32,64" if cpu else "128,512"]
    variants = ["--variants", VARIANTS]
    torch_src = ["bench", "--checkpoint", ckpt, "--engine", "torch", "--device", device]
    ort_src = ["bench", str(work / "export-paper30m"), "--engine", "ort", "--device", device]
    static = ["--kv-cache", "static"]
    steps = [
        Step(
            f"torch-{torch_dtype}-decode-static-graph", [*torch_src, "--dtype", torch_dtype, *decode, *static, *graph]
        ),
        Step("ort-decode-static-graph", ort_src + decode + static + graph, "paper30m"),
        Step(f"torch-{torch_dtype}-prefill-eager-graph", [*torch_src, "--dtype", torch_dtype, *prefill, *graph]),
        Step("ort-prefill-eager-graph", ort_src + prefill + graph, "paper30m"),
        Step(
            "ort-smollm2-decode-static-graph",
            [
                "bench",
                str(work / "export-smollm2"),
                "--engine",
                "ort",
                "--device",
                device,
                *decode,
                *static,
                *graph,
                "--variants",
                "baseline,folded",
            ],
            "smollm2",
        ),
    ]
    if not cpu:
        steps += [
            Step("torch-fp16-decode-static-graph", [*torch_src, "--dtype", "fp16", *decode, *static, *graph]),
            Step("torch-fp16-prefill-eager-graph", [*torch_src, "--dtype", "fp16", *prefill, *graph]),
            Step(
                "torch-bf16-prefill-compile",
                [*torch_src, "--dtype", "bf16", *prefill, "--compile", "--compile-mode", "reduce-overhead"],
            ),
        ]
    return [
        Step(
            s.name,
            taperfold_cmd()
            + s.argv
            + (DRY_RUN_TIMING if cpu else DEVICE_TIMING)
            + ([] if "--variants" in s.argv else variants)
            + ["--json", str(out / f"{s.name}.json")],
            s.needs,
        )
        for s in steps
    ]


def install_ort_gpu(parts: Path, site: Path) -> str:
    """onnxruntime-gpu from the parts ../shared/gpu/ort-gpu-parts writes (part.0*, NAME, SHA256), installed into
    `site` without an index; returns what happened, in one line."""
    import hashlib

    name = (parts / "NAME").read_text().strip()
    wheel = site.parent / name
    with open(wheel, "wb") as whole:
        for part in sorted(parts.glob("part.0*")):
            whole.write(part.read_bytes())
    want = (parts / "SHA256").read_text().split()[0]
    got = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if got != want:
        return f"{name}: sha256 {got[:12]} is not {want[:12]}: parts missing or damaged; ORT runs on the image's build"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), str(wheel)]
    done = subprocess.run(pip, capture_output=True, text=True)
    return f"{name} installed into {site}" if done.returncode == 0 else f"pip failed: {done.stderr.strip()[-200:]}"


def write_model(path: Path, preset: str, overrides: dict) -> None:
    from taperfold.checkpoint import checkpoint_from_model, save_checkpoint
    from taperfold.models import random_gate0_model

    model = random_gate0_model(preset, **overrides)
    save_checkpoint(checkpoint_from_model(model, step=0, meta={"random_weights": True}), path)


def device_run(out: Path, budget_s: float, cpu: bool, ort_parts: Path | None, work: Path | None = None) -> dict:
    """Run device_plan within `budget_s` seconds, each export made when the first run that needs it comes up;
    OUT/runs.json indexes every step (exit code, seconds, or why it was skipped), OUT/device.json the setting;
    checkpoints and exports go to `work` (default OUT/work; on the device machine outside $OUT, which comes back)."""
    deadline = time.monotonic() + budget_s
    work = work or out / "work"
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    setting: dict[str, Any] = {"budget_s": budget_s, "device": "cpu" if cpu else "cuda"}
    if ort_parts:
        site = Path(tempfile.mkdtemp(prefix="ortsite-"))
        setting["onnxruntime_gpu"] = install_ort_gpu(ort_parts, site)
        env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])  # ahead of the image's CPU build
    probe = "import onnxruntime as o; print(o.__version__, ','.join(o.get_available_providers()))"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    setting["onnxruntime"] = found.stdout.strip() or found.stderr.strip()[-200:]
    (out / "device.json").write_text(json.dumps(setting, indent=2))
    models, exported = device_models(work, cpu), set()
    index: dict[str, Any] = {}
    for step in device_plan(out, cpu, work):
        if not (work / "paper30m.pt").exists():
            write_model(work / "paper30m.pt", *models["paper30m"][:2])
        if step.needs and step.needs not in exported:
            preset, overrides, dtype = models[step.needs]
            ckpt, export_dir = work / f"{step.needs}.pt", work / f"export-{step.needs}"
            if not ckpt.exists():
                write_model(ckpt, preset, overrides)
            argv = [
                *taperfold_cmd(),
                "export",
                str(ckpt),
                "-o",
                str(export_dir),
                "--dtype",
                dtype,
                "--kv-cache",
                "growing,static",
            ]
            if _run_budgeted(out, f"export-{step.needs}", argv, env, index, deadline) != 0:
                continue  # its bench runs are recorded as failed exports, below
            if step.needs == "paper30m":
                add_nonorm(export_dir, ckpt)
            exported.add(step.needs)
        if step.needs and step.needs not in exported:
            index[step.name] = {"skipped": f"export-{step.needs} failed or was skipped"}
            continue
        _run_budgeted(out, step.name, step.argv, env, index, deadline)
    return index


def _run_budgeted(out: Path, name: str, argv: list[str], env: dict, index: dict, deadline: float) -> int | None:
    """One command with what is left of the budget as its time limit (None: skipped, too little left)."""
    left = deadline - time.monotonic()
    if left < MIN_RUN_S:
        index[name] = {"skipped": f"budget: {max(left, 0):.0f} s left"}
        (out / "runs.json").write_text(json.dumps(index, indent=2))
        return None
    print(f"({left:.0f} s of the budget left)", flush=True)
    return _run_one(out, name, argv, env, index, timeout=left)


# ---- render ---------------------------------------------------------------------------------------------------


def load_reports(folder: Path) -> list[dict]:
    reports = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("format") == FORMAT:
            check_report(data, path)  # a version this taperfold cannot read: one line naming the file
            data["_file"] = path.name
            reports.append(data)
    return reports


def measurements(reports: list[dict]) -> dict:
    """(dtype, phase, config, batch, seq, variant) -> {tokens_per_s, cv_pct, new_tokens, file}; phase is prefill,
    decode, or prompt (the prompt of a decode run, timed apart)."""
    table = {}
    for report in reports:
        for row in report["results"]:
            config = CONFIGS.get(
                (report["engine"], row.get("execution", "eager")), f"{report['engine']} {row.get('execution', 'eager')}"
            )
            if report.get("device") == "cpu":  # the dry run
                config = config.replace("CUDA", "CPU")
            phase = "prompt" if report["mode"] == "decode" and row["phase"] == "prefill" else row["phase"]
            key = (report["dtype"], phase, config, row["batch"], row["seq"], row["variant"])
            table[key] = {
                "tokens_per_s": row["tokens_per_s"],
                "cv_pct": throughput_stats(row)["cv_pct"],
                "new_tokens": row.get("new_tokens"),
                "file": report.get("_file"),
            }
    return table


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def render_markdown(reports: list[dict], runs: dict | None = None) -> str:
    """The GPU section of docs/benchmarks.md from the reports of one `run`."""
    if not reports:
        return "No taperfold-bench JSON found: nothing has been measured.\n"
    others = [r for r in reports if SMOLLM2_RUN in r["_file"]]  # another model: a table of its own, at the end
    reports = [r for r in reports if r not in others]
    if not reports:
        return smollm2_markdown(others)
    data = measurements(reports)
    env = reports[0]["environment"]
    gpu_name = env.get("gpu", {}).get("name", "unknown GPU")
    spec = gpu_spec(gpu_name)
    cfg = ModelConfig.from_dict(reports[0]["config"])
    versions = {}  # what ran: torch, and the onnxruntime build of the ORT runs (the GPU build beside a CPU one)
    for report in reports:
        found = report["environment"].get("versions", {})
        runtime = "onnxruntime-gpu" if report["engine"] == "ort" and "onnxruntime-gpu" in found else "onnxruntime"
        for key in ("torch", runtime) if report["engine"] == "ort" else ("torch",):
            if found.get(key):
                versions.setdefault(key, found[key])
    lines = [
        f"Measured on **{gpu_name}** ({env.get('cpu', '?')}), "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + ". "
        + f"paper-30m, random weights at g = 0; medians of {reports[0]['settings']['iters']} timed calls per "
        f"cell in {reports[0]['settings']['rounds']} alternating rounds. "
        + (
            f"Floor: {spec.name}, {spec.memory_tb_s} TB/s, {spec.dense_tflops_16} dense BF16/FP16 TFLOPS "
            "(taperfold/bench/floors.py)."
            if spec
            else "No spec for this GPU: no floor."
        ),
        "",
    ]
    configs = list(dict.fromkeys(k[2] for k in data))
    targets = {"ratio": [], "residue": [], "gain": []}
    for dtype in (*DTYPES, "fp32"):  # fp32: the CPU dry run
        for phase in ("prefill", "decode"):
            cells = sorted({(k[3], k[4]) for k in data if k[0] == dtype and k[1] == phase})
            here = [c for c in configs if any(k[0] == dtype and k[1] == phase and k[2] == c for k in data)]
            if not cells:
                continue
            scale, unit = (1e3, "k tok/s") if phase == "prefill" else (1.0, "tok/s")
            paper = dtype == "bf16" and phase == "prefill"
            lines += [f"### {phase}, {dtype}: folded throughput ({unit}, median) and folded × baseline", ""]
            head = (
                ["B", "T" if phase == "prefill" else "prompt"]
                + (["paper folded (×)"] if paper else [])
                + ["floor"]
                + here
                + (["fastest / paper"] if paper else [])
            )
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for batch, seq in cells:
                steps = (
                    next(
                        (
                            v["new_tokens"]
                            for k, v in data.items()
                            if k[:2] == (dtype, phase) and k[3:5] == (batch, seq)
                        ),
                        None,
                    )
                    or NEW_TOKENS
                )
                floor = (
                    (
                        prefill_floor(cfg, spec, batch, seq, dtype)
                        if phase == "prefill"
                        else decode_floor(cfg, spec, batch, seq, steps, dtype)
                    )
                    if spec
                    else None
                )
                row = [str(batch), str(seq)]
                if paper:
                    base, _, fold = PAPER_TABLE3.get((batch, seq), (None, None, None))
                    row.append(f"{_fmt(fold)} ({_fmt(fold / base, '.2f')}×)" if fold else "–")
                row.append(f"{floor.tokens_per_s / scale:,.0f} ({floor.bound})" if floor else "–")
                fastest = 0.0
                for config in here:
                    got = {v: data.get((dtype, phase, config, batch, seq, v)) for v in ("baseline", "folded", "nonorm")}
                    if not got["folded"]:
                        row.append("–")
                        continue
                    folded = got["folded"]["tokens_per_s"]
                    fastest = max(fastest, folded)
                    gain = folded / got["baseline"]["tokens_per_s"] if got["baseline"] else None
                    row.append(f"{folded / scale:.1f} ({_fmt(gain, '.3f')}×)")
                    if gain:
                        targets["gain"].append(gain)
                    if got["nonorm"]:
                        targets["residue"].append(
                            (folded / got["nonorm"]["tokens_per_s"], config, dtype, phase, batch, seq)
                        )
                if paper:
                    fold = PAPER_TABLE3.get((batch, seq), (None, None, None))[2]
                    ratio = fastest / scale / fold if fold and fastest else None
                    row.append(f"{_fmt(ratio, '.2f')}×")
                    if ratio:
                        targets["ratio"].append(ratio)
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
            residue = [
                f"{c}: "
                + ", ".join(
                    f"{r:.3f}" for r, c2, d, p, b, s in targets["residue"] if c2 == c and d == dtype and p == phase
                )
                for c in here
            ]
            lines += ["folded / nonorm (zero residue = 1.000): " + "; ".join(residue) + ".", ""]
            cvs = [(v["cv_pct"], k) for k, v in data.items() if k[0] == dtype and k[1] == phase]
            worst = max(cvs)
            lines += [
                f"CV of the samples behind each figure: median {sorted(c for c, _ in cvs)[len(cvs) // 2]:.1f} %, max "
                f"{worst[0]:.1f} % ({worst[1][2]}, {worst[1][5]}, B{worst[1][3]} T{worst[1][4]}).",
                "",
            ]
    lines += ["### Targets (issue 13)", ""]
    if targets["ratio"]:
        ok = min(targets["ratio"]) >= 6
        lines.append(
            f"- fastest folded ≥ 6× the paper's folded in every bf16 prefill cell: **{'met' if ok else 'not met'}** "
            f"({min(targets['ratio']):.2f}–{max(targets['ratio']):.2f}×)."
        )
    if targets["residue"]:
        worst = min(targets["residue"], key=lambda t: t[0])
        ok = all(abs(r - 1) <= 0.01 for r, *_ in targets["residue"])
        lines.append(
            f"- folded within 1 % of nonorm on every engine: **{'met' if ok else 'not met'}** (worst "
            f"{worst[0]:.3f}: {worst[1]}, {worst[2]} {worst[3]} B{worst[4]} T{worst[5]})."
        )
    if targets["gain"]:
        lines.append(f"- folded × baseline, as measured: {min(targets['gain']):.3f}–{max(targets['gain']):.3f}×.")
    if others:
        lines += ["", smollm2_markdown(others)]
    if runs:
        failed = {n: r for n, r in runs.items() if r.get("exit_code", 0) != 0}
        skipped = {n: r["skipped"] for n, r in runs.items() if "skipped" in r}
        runs = {n: r for n, r in runs.items() if "skipped" not in r}
        lines += [
            "",
            "Commands (each wrote the JSON of the same name; OUT is the folder given to "
            "`python examples/gpu_table3.py run OUT`):",
            "",
            "```",
        ]
        lines += [f"{r['command']}   # {n}: exit {r['exit_code']}, {r['seconds']:.0f} s" for n, r in runs.items()]
        lines += ["```"]
        if failed:
            lines += ["", "Failed runs (their .log says why): " + ", ".join(failed) + "."]
        if skipped:
            lines += ["", "Not run: " + "; ".join(f"{n} ({why})" for n, why in skipped.items()) + "."]
    return "\n".join(lines) + "\n"


def smollm2_markdown(reports: list[dict]) -> str:
    """SmolLM2-135M's shape decoding (the device run's ORT row): folded against baseline per batch."""
    lines = ["### SmolLM2-135M's shape, KV-cached decode: tok/s (median), folded × baseline", ""]
    lines += [
        "| dtype | configuration | B | baseline | folded | folded × baseline | CV max |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, cell in sorted(_pairs(measurements(reports)).items()):
        dtype, config, batch = key
        base, fold = cell.get("baseline"), cell.get("folded")
        if base and fold:
            ratio = fold["tokens_per_s"] / base["tokens_per_s"]
            cv = max(base["cv_pct"], fold["cv_pct"])
            row = [
                dtype,
                config,
                batch,
                f"{base['tokens_per_s']:,.0f}",
                f"{fold['tokens_per_s']:,.0f}",
                f"{ratio:.3f}×",
            ]
            lines.append("| " + " | ".join(map(str, row)) + f" | {cv:.1f} % |")
    return "\n".join(lines) + "\n"


def _pairs(data: dict) -> dict:
    """(dtype, config, batch) -> {variant: measurement} of the decode rows."""
    pairs: dict = {}
    for (dtype, phase, config, batch, _, variant), value in data.items():
        if phase == "decode":
            pairs.setdefault((dtype, config, batch), {})[variant] = value
    return pairs


def render_plot(reports: list[dict], path: Path) -> None:
    """Folded prefill throughput per configuration and cell, with the paper's folded and the floor (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = measurements(reports)
    cfg = ModelConfig.from_dict(reports[0]["config"])
    spec = gpu_spec(reports[0]["environment"].get("gpu", {}).get("name", ""))
    dtypes = [d for d in DTYPES if any(k[0] == d and k[1] == "prefill" for k in data)]
    fig, axes = plt.subplots(1, max(1, len(dtypes)), figsize=(7 * max(1, len(dtypes)), 5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        cells = sorted({(k[3], k[4]) for k in data if k[0] == dtype and k[1] == "prefill"})
        configs = list(dict.fromkeys(k[2] for k in data if k[0] == dtype and k[1] == "prefill"))
        width = 0.8 / max(1, len(configs))
        for i, config in enumerate(configs):
            xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(cells))]
            ys = [
                data.get((dtype, "prefill", config, b, s, "folded"), {}).get("tokens_per_s", 0) / 1e3 for b, s in cells
            ]
            ax.bar(xs, ys, width, label=f"{config} (folded)")
        if dtype == "bf16":
            ax.plot(
                range(len(cells)),
                [PAPER_TABLE3.get(c, (0, 0, 0))[2] for c in cells],
                "k*",
                markersize=10,
                label="paper folded (torch eager)",
            )
        if spec:
            ax.plot(
                range(len(cells)),
                [prefill_floor(cfg, spec, b, s, dtype).tokens_per_s / 1e3 for b, s in cells],
                "r_",
                markersize=22,
                mew=2,
                label=f"floor ({spec.name})",
            )
        ax.set_xticks(range(len(cells)), [f"B{b} T{s}" for b, s in cells])
        ax.set_yscale("log")
        ax.set_ylabel("prefill throughput (k tokens/s)")
        ax.set_title(f"{dtype}: folded, last-token logits")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def render(folder: Path, markdown: Path, plot: Path | None) -> None:
    from taperfold.fsutil import atomic_path

    reports = load_reports(folder)
    runs_path = folder / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else None
    with atomic_path(markdown) as tmp:
        tmp.write_text(render_markdown(reports, runs))
    if plot and reports:
        with atomic_path(plot) as tmp:
            render_plot(reports, tmp)
    print(f"wrote {markdown}" + (f" and {plot}" if plot and reports else ""))


def _batches(text: str) -> tuple[int, ...]:
    try:
        batches = tuple(int(b) for b in text.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,4, got {text!r}")
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="only write the checkpoint and the exports that `run` uses")
    p.add_argument("out", type=Path)
    p.add_argument("--dtypes", default=",".join(DTYPES))
    for name in ("run", "plan"):
        p = sub.add_parser(name)
        p.add_argument("out", type=Path, help="folder for every JSON and log (keep the JSONs under docs/gpu/)")
        p.add_argument("--iters", type=int, default=50)
        p.add_argument("--warmup", type=int, default=10)
        p.add_argument("--rounds", type=int, default=5)
        p.add_argument("--only", help="run only the configurations whose name contains this")
        p.add_argument(
            "--batches",
            type=_batches,
            default=BATCHES,
            help="a subset of Table 3's batch sizes (names get a -bN suffix)",
        )
    p = sub.add_parser("device", help="every measurement within a device-time budget, most important first")
    p.add_argument("out", type=Path)
    p.add_argument("--budget-s", type=float, default=540.0, help="wall seconds for everything after the start")
    p.add_argument("--ort-parts", type=Path, help="the folder holding onnxruntime-gpu's parts, NAME and SHA256")
    p.add_argument("--cpu", action="store_true", help="the dry run: the same steps on the CPU, tiny preset")
    p.add_argument("--work", type=Path, help="checkpoints and exports (default OUT/work)")
    p = sub.add_parser("render")
    p.add_argument("out", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if args.command == "plan":
        for name, argv in plan(args.out, args.iters, args.warmup, args.rounds, args.batches):
            print(f"{name}: taperfold {' '.join(argv[3:])}")
    elif args.command == "prepare":
        prepare(args.out, tuple(args.dtypes.split(",")))
    elif args.command == "device":
        missing = [n for n in ("NAME", "SHA256") if args.ort_parts and not (args.ort_parts / n).is_file()]
        if missing:
            parser.error(f"--ort-parts {args.ort_parts}: no {missing[0]} file (../shared/gpu/ort-gpu-parts writes it)")
        args.out.mkdir(parents=True, exist_ok=True)
        device_run(args.out, args.budget_s, args.cpu, args.ort_parts, args.work)
    elif args.command == "run":
        run(args.out, args.iters, args.warmup, args.rounds, args.only, args.batches)
    else:
        if not args.out.is_dir():
            parser.error(f"{args.out}: no such directory (the folder `run` wrote its JSONs to)")
        try:
            render(args.out, args.markdown or args.out / "gpu_table3.md", args.plot or args.out / "gpu_table3.png")
        except TaperfoldError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
