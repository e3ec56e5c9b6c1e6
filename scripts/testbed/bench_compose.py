"""What the containers cost: the same job (scripts/testbed/cluster_job.py: Horovod's allreduce
and three hvd_sparse schemes, 4 ranks, tensors of random whole 256-blocks) on the compose cluster
(docker/docker-compose.yml: 4 worker containers and 1 aggregator container, links capped by tc
inside each container) and on the netns testbed (4 worker hosts and 1 aggregator host behind a
Linux bridge, tbf on both veth ends), same link rate and MTU 1500. Prints a table, writes JSON
and a PNG. Root; starts a Docker engine if none runs and stops what it started.

    python scripts/testbed/bench_compose.py [--rate 1gbit] [--numel 4194304] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import compose  # scripts/testbed/compose.py: this script's folder is first on sys.path

from hvd_sparse.tools.testbed import launch as testbed
from hvd_sparse.tools.testbed import lifecycle
from hvd_sparse.tools.testbed.topology import Testbed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

JOB_TIMEOUT_S = 900


def parse(output: str, where: str) -> dict:
    lines = [ln for ln in output.splitlines() if "cluster_job: " in ln]
    if not lines:
        raise RuntimeError(f"{where}: the job printed no result:\n{output[-4000:]}")
    job = json.loads(lines[-1].split("cluster_job: ", 1)[1])
    if job["bad"]:
        raise RuntimeError(f"{where}: wrong results: {job['bad']}")
    return job


def on_compose(args: argparse.Namespace, job: list[str]) -> dict:
    res = compose.run(" ".join(["python", "/opt/hvd-sparse/scripts/testbed/cluster_job.py", *job]),
                      rate=args.rate, project="hvdbench", timeout=JOB_TIMEOUT_S)
    if res.returncode != 0 or res.leftovers:
        raise RuntimeError(f"compose: exit {res.returncode}, left {res.leftovers}:\n"
                           f"{res.output[-4000:]}")
    return parse(res.output, "compose")


def on_testbed(args: argparse.Namespace, job: list[str]) -> dict:
    lifecycle.down("hvbench")
    tb = lifecycle.up(Testbed("hvbench", workers=4, aggregators=1, rate=args.rate, mtu=1500))
    try:
        out = testbed.run(tb, [sys.executable, str(HERE / "cluster_job.py"), *job],
                          timeout=JOB_TIMEOUT_S, capture=True)
    finally:
        lifecycle.down("hvbench")
    if out.returncode != 0:
        raise RuntimeError(f"testbed: exit {out.returncode}:\n{out.stdout[-3000:]}"
                           f"{out.stderr[-3000:]}")
    return parse(out.stdout, "testbed")


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(r["path"], r["density"]) for r in results["testbed"]["rows"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.4
    for i, where in enumerate(("testbed", "compose")):
        ms = {(r["path"], r["density"]): r["ms"] for r in results[where]["rows"]}
        ax.bar([k + (i - 0.5) * width for k in range(len(keys))], [ms[k] for k in keys], width,
               label=where)
    ax.set_xticks(range(len(keys)), [f"{p}\n{d:.0%}" for p, d in keys], fontsize=8)
    ax.set_ylabel("ms per call (median)")
    ax.set_title("compose cluster vs netns testbed: same job, 4 ranks "
                 f"(python scripts/testbed/bench_compose.py --rate {results['rate']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "compose_vs_testbed.json")
    args = p.parse_args()
    job = ["--numel", str(args.numel), "--reps", str(args.reps)]
    dockerd = [sys.executable, str(HERE / "dockerd.py")]
    subprocess.run([*dockerd, "start"], check=True)
    try:
        compose.build()
        results = {"compose": on_compose(args, job)}
    finally:
        subprocess.run([*dockerd, "stop"], check=True)
    results["testbed"] = on_testbed(args, job)
    print(f"4 ranks, {args.numel:,} floats, links at {args.rate}, median of {args.reps} calls")
    print(f"{'path':<11} {'density':>7} | {'testbed ms':>10} {'compose ms':>10} {'ratio':>6} | "
          f"{'testbed MB':>10} {'compose MB':>10}")
    tb_rows = {(r["path"], r["density"]): r for r in results["testbed"]["rows"]}
    for r in results["compose"]["rows"]:
        t = tb_rows[(r["path"], r["density"])]
        print(f"{r['path']:<11} {r['density']:>7.0%} | {t['ms']:>10.1f} {r['ms']:>10.1f} "
              f"{r['ms'] / t['ms']:>6.2f} | {t['bytes'] / 1e6:>10.2f} {r['bytes'] / 1e6:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"rate": args.rate, **results}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    plot(out, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
