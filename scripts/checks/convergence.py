"""Convergence suite: every sparsifier at 1% against dense and PowerSGD, four tasks, 4 ranks.

    .venv/bin/python scripts/checks/convergence.py             # 4 tasks x 8 methods x 3 seeds
    .venv/bin/python scripts/checks/convergence.py --tasks digits --seeds 1 --methods dense,exdyna
    .venv/bin/python scripts/checks/convergence.py --density 0.001 --methods dense,topk,dgc,exdyna
    .venv/bin/python scripts/checks/convergence.py --density 0.001 --tasks mlp --epochs-x 4
    .venv/bin/python scripts/checks/convergence.py --tasks lm --methods dense,topk --lm-steps 60
    .venv/bin/python scripts/checks/convergence.py --tasks lm --methods dense+bf16,topk,topk+bf16

One ``horovodrun -np 4 --gloo`` job per seed trains each task with each method
(hvd_sparse/tools/lab/accuracy.py: tasks, methods, how bytes count). Prints per task and
method the held-out score (mean over seeds, with min-max), its gap to dense (mean of the
per-seed gaps, negative when worse: in points for accuracy and AUC, in % of dense's loss for
the language model's nats per byte, where lower is better), and bytes per step per rank
(every step, a dense warm-up's included) as a share of dense's; writes
<out-dir>/convergence.json and convergence.png (score against epochs, mean over seeds;
convergence-0.001.* for another --density, -x4 for --epochs-x 4).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hvd_sparse.tools.lab.accuracy import (
    DENSITY,
    EXTRA,
    LM_STEPS,
    LOWER_IS_BETTER,
    METHODS,
    TASKS,
    known,
)
from hvd_sparse.tools.lab.report import console, print_table, save_png, write_json

ROOT = Path(__file__).resolve().parents[2]


def run_seed(seed: int, tasks: list[str], methods: list[str], np_: int, timeout: float,
             density: float, epochs_x: int, lm_steps: int = LM_STEPS,
             sparsify: str = "gradient", dense_steps: int = 0) -> list[dict]:
    """One Horovod job: rank 0's results, one dict per (task, method)."""
    runs = ",".join(f"{t}:{m}:{seed}" for t in tasks for m in methods)
    bindir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HVD_SPARSE_TEST_OUT": tmp,
               "HVD_SPARSE_CACHE_DIR": str(Path(tmp) / "cache"), "OMP_NUM_THREADS": "1",
               "HVD_SPARSE_ACC_RUNS": runs, "HVD_SPARSE_ACC_DENSITY": str(density),
               "HVD_SPARSE_ACC_EPOCHS_X": str(epochs_x),
               "HVD_SPARSE_ACC_LM_STEPS": str(lm_steps), "HVD_SPARSE_ACC_SPARSIFY": sparsify,
               "HVD_SPARSE_ACC_DENSE_STEPS": str(dense_steps),
               "PYTHONWARNINGS": "ignore"}
        cmd = [str(bindir / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
               sys.executable, "-m", "hvd_sparse.tools.lab.accuracy"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        tail: list[str] = []
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        for line in proc.stdout:  # progress: rank 0 prints a line per finished run
            tail = (tail + [line])[-40:]
            if "[accuracy]" in line:
                console.print(line.split("[accuracy] ", 1)[1].rstrip())
            if time.monotonic() > deadline:
                proc.kill()
                break
        proc.wait()
        path = Path(tmp) / "rank0.jsonl"
        results = [json.loads(ln) for ln in path.read_text().splitlines()] \
            if path.exists() else []
    if proc.returncode != 0 or len(results) != len(tasks) * len(methods):
        console.print("".join(tail), markup=False, highlight=False)
        raise SystemExit(f"seed {seed}: the job failed (exit {proc.returncode}) after "
                         f"{len(results)} of {len(tasks) * len(methods)} runs")
    return results


def summarize(results: list[dict], tasks: list[str], methods: list[str]) -> list[dict]:
    rows = []
    for t in tasks:
        dense = {r["seed"]: r for r in results if r["task"] == t and r["method"] == "dense"}
        for m in methods:
            mine = [r for r in results if r["task"] == t and r["method"] == m]
            # negative: worse than dense
            if mine[0]["metric"] in LOWER_IS_BETTER:  # a loss: as it is, gaps in % of dense's
                scores = [r["score"] for r in mine]
                gaps = [100 * (1 - r["score"] / dense[r["seed"]]["score"]) for r in mine
                        if r["seed"] in dense]
            else:  # accuracy, AUC: in %, gaps in points
                scores = [100 * r["score"] for r in mine]
                gaps = [100 * (r["score"] - dense[r["seed"]]["score"]) for r in mine
                        if r["seed"] in dense]
            bytes_ = statistics.mean(r["bytes_per_step"] for r in mine)
            rows.append({
                "task": t, "method": m, "metric": mine[0]["metric"],
                "score": statistics.mean(scores), "min": min(scores), "max": max(scores),
                "vs dense (points; lm: %)": statistics.mean(gaps) if gaps else float("nan"),
                "bytes/step/rank": bytes_,
                "% of dense bytes": 100 * bytes_ / mine[0]["dense_bytes_per_step"],
                "union density %": (100 * statistics.mean(r["union_density"] for r in mine)
                                    if mine[0]["union_density"] is not None else float("nan")),
                "seeds": len(mine)})
    return rows


def plot(results: list[dict], tasks: list[str], methods: list[str], path: Path) -> None:
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5 * len(tasks), 4))
    for i, t in enumerate(tasks):
        ax = fig.add_subplot(1, len(tasks), i + 1)
        for m in methods:
            curves = [r["scores"] for r in results if r["task"] == t and r["method"] == m]
            k = 1 if curves and next(r["metric"] for r in results if r["task"] == t) \
                in LOWER_IS_BETTER else 100
            mean = [k * statistics.mean(c[e] for c in curves) for e in range(len(curves[0]))]
            ax.plot(range(1, len(mean) + 1), mean, marker=".", label=m,
                    linestyle="-" if m == "dense" or not m.startswith("powersgd") else "--")
        metric = next(r["metric"] for r in results if r["task"] == t)
        ax.set(title=t, xlabel="epoch (lm: evaluation)",
               ylabel=f"held-out {metric}" + ("" if metric in LOWER_IS_BETTER else " (%)"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_png(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--density", type=float, default=DENSITY,
                    help="the sparsifiers' per rank (exdyna: the union's, per rank / ranks)")
    ap.add_argument("--epochs-x", type=int, default=1,
                    help="train every task this many times its epochs (same warm-up)")
    ap.add_argument("--lm-steps", type=int, default=LM_STEPS,
                    help="the language model's steps (fewer for a quick, reduced run)")
    ap.add_argument("--sparsify", default="gradient",
                    choices=("gradient", "update", "frozen", "frozen-local"),
                    help="what the sparsifiers sparsify (DistributedOptimizer's sparsify=; "
                         "frozen-local: frozen with local_updates=True)")
    ap.add_argument("--dense-steps", type=int, default=0,
                    help="sparsified methods: this many dense steps first (DistributedOptimizer's "
                         "dense_steps=; their bytes counted); frozen needs >= 1")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per seed's job")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    args = ap.parse_args()
    tasks, methods = args.tasks.split(","), args.methods.split(",")
    bad = [t for t in tasks if t not in TASKS] + [m for m in methods if not known(m)]
    if bad:
        ap.error(f"unknown: {bad} (tasks {list(TASKS)}, methods {list(METHODS + EXTRA)}, "
                 "those of hvd_sparse with +bf16)")
    if "dense" not in methods:
        methods.insert(0, "dense")  # the reference every gap is taken against
    results: list[dict] = []
    t0 = time.monotonic()
    for seed in map(int, args.seeds.split(",")):
        console.print(f"[bold]seed {seed}[/]: {len(tasks)} tasks x {len(methods)} methods, "
                      f"{args.np} ranks")
        results += run_seed(seed, tasks, methods, args.np, args.timeout, args.density,
                            args.epochs_x, args.lm_steps, args.sparsify, args.dense_steps)
    rows = summarize(results, tasks, methods)
    print_table(rows, f"convergence, {args.np} ranks, seeds {args.seeds}, sparsifiers at "
                f"{args.density:.2%}",
                columns=[c for c in rows[0] if c != "metric"],
                caption="score: held-out accuracy (mlp, digits) or AUC (ctr), in %, vs dense "
                        "in points; lm: held-out loss in nats/byte, vs dense in % of dense's "
                        "(negative: worse); "
                        f"{time.monotonic() - t0:.0f} s in all")
    stem = "convergence" + ("" if args.density == DENSITY else f"-{args.density:g}") \
        + ("" if args.epochs_x == 1 else f"-x{args.epochs_x}") \
        + ("" if args.lm_steps == LM_STEPS or "lm" not in tasks else f"-lm{args.lm_steps}") \
        + ("" if args.sparsify == "gradient" else f"-{args.sparsify}") \
        + ("" if not args.dense_steps else f"-d{args.dense_steps}")
    out = write_json(args.out_dir / f"{stem}.json", rows, args=vars(args), runs=results)
    plot(results, tasks, methods, args.out_dir / f"{stem}.png")
    console.print(f"wrote {out} and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
