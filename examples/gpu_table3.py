"""The paper's Table 3 on a GPU, every way taperfold can run it, with the paper's numbers and the physical floor.

On a machine with a CUDA GPU (H100 / H200), from the repository root (see docs/benchmarks.md, "GPU"):

    python examples/gpu_table3.py run OUT            # about 30-60 minutes; every JSON lands in OUT/
    python examples/gpu_table3.py render OUT         # OUT/gpu_table3.md and OUT/gpu_table3.png from the JSONs
    python examples/gpu_table3.py plan OUT           # print the commands `run` would run, run nothing
    python examples/gpu_table3.py prepare OUT        # only the checkpoint and exports (e.g. while the GPU is busy)

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
import time
from pathlib import Path

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
    manifest.json (artifacts.nonorm, artifacts.nonorm.decoder), as export would with the same options."""
    import torch

    from taperfold.artifacts.onnx_graph import ONNX_GRAPH
    from taperfold.checkpoint import load_checkpoint
    from taperfold.export import ExportOptions, export_to_ir
    from taperfold.exportdir import GROWING, NONORM, PREFILL, torch_dtype
    from taperfold.manifest import read_manifest
    from taperfold.variants import without_norms

    manifest = read_manifest(export_dir)
    model = without_norms(load_checkpoint(ckpt).build(gate=0.0)).to(torch_dtype(manifest.dtype)).eval()
    with torch.no_grad():
        for graph in (PREFILL, GROWING):
            # the same opset as the folded graph it is compared with (export picks one per graph)
            opset = manifest.find("folded", graph).details["opset"]
            opts = ExportOptions(logits=manifest.logits, dtype=manifest.dtype, opset=opset)
            model_ir = export_to_ir(model, opts, graph)
            manifest.add_artifact(
                ONNX_GRAPH.write(model_ir, export_dir, NONORM, graph, manifest.dtype, {"opset": opset})
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


def _run_one(out: Path, name: str, argv: list[str], env: dict, index: dict) -> int:
    print(f"== {name}: taperfold {' '.join(argv[3:])}", flush=True)
    start = time.time()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    # the command as a reader reruns it: OUT for the folder given to `run`, not this machine's path
    index[name] = {
        "command": " ".join(["taperfold", *argv[3:]]).replace(str(out), "OUT"),
        "exit_code": code,
        "seconds": round(time.time() - start, 1),
    }
    (out / "runs.json").write_text(json.dumps(index, indent=2))
    print(f"   exit {code} in {index[name]['seconds']} s", flush=True)
    return code


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
    for dtype in DTYPES:
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
    if runs:
        failed = {n: r for n, r in runs.items() if r["exit_code"] != 0}
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
    return "\n".join(lines) + "\n"


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
