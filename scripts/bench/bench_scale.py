"""Sparse row gradients as workers grow: allgather against aggregation on emulated hosts.

    .venv/bin/python scripts/bench/bench_scale.py [--workers 4,8] [--rate 100mbit] \
        [--ids zipf,uniform]

For each N in --workers the script brings a testbed up (N worker hosts, --aggregators hosts,
links capped at --rate both ways, MTU 9000; hvd_sparse.tools.testbed), runs itself on it as
one Horovod rank per worker host, and takes it down. Each rank holds the gradient of one
embedding table (--rows x --dim float32) as ``nn.Embedding(sparse=True)`` makes it: one row per
lookup, --lookups ids per rank drawn from a Zipf law (``--ids zipf``: hot rows that every rank
touches, as DLRM's lookups are) or uniformly (``uniform``: hardly a row shared). Methods, all
op=Sum, results checked against Horovod's dense allreduce first:

* hvd sparse: Horovod's COO path (``hvd.sparse_allreduce_async``: an allgather of every lookup);
* rows allgather: ``hvd_sparse.allreduce(scheme="allgather")``: each rank's distinct rows,
  allgathered and summed on every rank;
* rows agg xA: ``scheme="omnireduce"`` on the testbed's A aggregator hosts: the rows summed at
  the aggregators, each rank receiving the union once;
* rows agg colocated: the same on the job's own aggregators, a shard on every worker host;
* auto: ``scheme="auto"`` (tries both ways on the tensor, keeps the faster; --warmup >= 5)
  with the testbed's aggregator hosts configured;
* auto colocated: the same under the multi-host default, no aggregators configured (the
  job's colocated shards).

Per method: the median over --reps of the slowest rank's time; bytes each worker received per
call (eth0 counters); the lower bound: the bytes of the distinct rows the worker that must
receive most must receive (rows non-zero on some other rank) over the link rate, and the time
over it ("x of bound"). Table, JSON and a plot of x of bound against N to --out-dir
(scale.json, scale.png). This is the sparse-rows part of the scale benchmark; blocks of dense
tensors on emulated hosts are scripts/bench/bench_testbed.py's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from hvd_sparse.tools.lab.report import (
    console,
    print_table,
    rank_rows,
    save_png,
    testbed_main,
    write_json,
)

ROOT = Path(__file__).resolve().parents[2]

METHODS = ["hvd sparse", "rows allgather", "rows agg xA", "rows agg colocated", "auto",
           "auto colocated"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="4,8")
    ap.add_argument("--aggregators", type=int, default=4)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--cpu-per-host", type=float, default=0.0,
                    help="each host's CPU budget in cores (0: none)")
    ap.add_argument("--ids", default="zipf,uniform")
    ap.add_argument("--zipf", type=float, default=1.3, help="the Zipf law's exponent")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--lookups", type=int, default=16384, help="ids per rank")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5, help="auto decides at its 5th call")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--name", default="hvscale", help="testbed name")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    ap.add_argument("--rank-side", help=argparse.SUPPRESS)  # result file: run as a rank
    args = ap.parse_args()
    args.methods = [m for m in METHODS if m in args.methods.split(",")]
    return args


# --- the driver: one testbed per N --------------------------------------------------------------

def drive(args: argparse.Namespace) -> int:
    from hvd_sparse.tools.testbed import lifecycle
    from hvd_sparse.tools.testbed.topology import Testbed

    rows: list[dict] = []
    failed = False
    for n in (int(x) for x in args.workers.split(",")):
        console.rule(f"testbed: {n} workers + {args.aggregators} aggregator hosts, {args.rate}, "
                     f"MTU 9000, CPU per host {args.cpu_per_host or 'unbudgeted'}")
        tb = lifecycle.up(Testbed(args.name, workers=n, aggregators=args.aggregators,
                                  rate=args.rate, mtu=9000, cpu_per_host=args.cpu_per_host))
        try:
            opts = [x for k in ("ids", "zipf", "rows", "dim", "lookups", "reps", "warmup")
                    for x in (f"--{k}", str(getattr(args, k)))]
            got = rank_rows(tb, str(Path(__file__).resolve()),
                            [*opts, "--methods", ",".join(args.methods)], f"N={n}")
            if got is None:  # report the other sizes anyway
                failed = True
                continue
            rows += [{"workers": n, "rate": args.rate, **r} for r in got]
        finally:
            lifecycle.down(args.name)
    if rows:
        report(rows, args)
    return 1 if failed or not rows else 0


def report(rows: list[dict], args: argparse.Namespace) -> None:
    nan = float("nan")
    by = {(r["workers"], r["ids"], r["method"]): r for r in rows}
    for r in rows:
        base = by.get((r["workers"], r["ids"], "rows allgather"), {})
        r["x vs rows allgather"] = base.get("ms", nan) / r.get("ms", nan)
    cols = ["workers", "ids", "method", "ms", "x vs rows allgather", "bound ms", "x of bound",
            "worker rx MB", "util %", "rows/rank", "union", "scheme", "trial ms", "retransmits",
            "ok"]
    print_table(rows, f"sum of one {args.rows:,} x {args.dim} embedding gradient, "
                f"{args.lookups:,} lookups per rank, {args.rate} links, median of {args.reps} "
                "(slowest rank)", cols,
                caption="bound: the distinct rows non-zero on some other rank, for the worker "
                "that must receive most, over the link rate. worker rx MB: the most any worker "
                "received per call (eth0). util: that worker's received bits / time / rate. "
                "rows/rank: mean distinct rows per rank; union: distinct rows over all ranks. "
                "trial ms: auto's last trial, allgather / aggregated (the slowest rank's best "
                "of two calls each).")
    out = write_json(args.out_dir / "scale.json", rows, args=vars(args))
    plot(rows, args, args.out_dir / "scale.png")
    console.print(f"wrote {out} and {args.out_dir / 'scale.png'}")


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    from matplotlib.figure import Figure

    kinds = list(dict.fromkeys(r["ids"] for r in rows))
    fig = Figure(figsize=(6 * len(kinds), 4.5))
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    for ax, ids in zip(axes, kinds, strict=True):
        ns = sorted({r["workers"] for r in rows if r["ids"] == ids})
        for j, m in enumerate(args.methods):
            ys = [next((r.get("x of bound", float("nan")) for r in rows if r["ids"] == ids
                        and r["workers"] == n and r["method"] == m), float("nan")) for n in ns]
            ax.plot(ns, ys, marker="o", label=m, color=f"C{j}")
        ax.axhline(1.0, color="k", ls="--", lw=0.8)
        ax.set(xlabel="workers", ylabel="time / per-host bound", xticks=ns,
               title=f"{ids} ids, {args.rate} links")
        ax.legend(fontsize=7)
    fig.suptitle(f"embedding gradient {args.rows:,} x {args.dim}, {args.lookups:,} lookups/rank")
    save_png(fig, path)


# --- the rank side: one Horovod rank per worker host --------------------------------------------

def rank_side(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch
    from bench_sync import gather, slowest_median_ms, sync

    import hvd_sparse
    from hvd_sparse import basics
    from hvd_sparse import session as omni
    from hvd_sparse.tools.testbed import links
    from hvd_sparse.tools.testbed.topology import Testbed

    hvd.init()
    torch.set_num_threads(1)
    hvd_sparse.init(probe="off")  # nothing here asks the cost model
    rank, n = hvd.rank(), hvd.size()
    tb = Testbed.load(os.environ["HVD_SPARSE_TESTBED"])
    st = basics.state()
    sessions = {"rows agg xA": st.omni}
    if {"rows agg colocated", "auto colocated"} & set(args.methods):
        sessions["rows agg colocated"] = omni.start(dataclasses.replace(
            st.config, aggregators="", aggregator_layout="colocated"), st.comm)

    def grad(ids: str, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        if ids == "zipf":  # rank r's lookups: the same law, its own draws
            u = torch.rand(args.lookups, generator=gen, dtype=torch.float64)
            lookups = ((1 - u) ** (-1 / (args.zipf - 1)) - 1).long() % args.rows
        else:
            lookups = torch.randint(args.rows, (args.lookups,), generator=gen)
        vals = torch.randn(args.lookups, args.dim, generator=gen)
        return torch.sparse_coo_tensor(lookups[None], vals, (args.rows, args.dim))

    def ours(m: str, g: torch.Tensor, ids: str) -> torch.Tensor:
        # a name per pattern: auto's trial is per tensor name, and must not carry over
        name = f"bench.{m.replace(' ', '.')}.{ids}"
        if m == "auto":
            return hvd_sparse.allreduce(g, name=name, op=hvd.Sum, scheme="auto")
        if m == "rows allgather":
            return hvd_sparse.allreduce(g, name=name, op=hvd.Sum, scheme="allgather")
        if m == "auto colocated":
            with basics.joined(omni=sessions["rows agg colocated"]):
                return hvd_sparse.allreduce(g, name=name, op=hvd.Sum, scheme="auto")
        with basics.joined(omni=sessions[m]):
            return hvd_sparse.allreduce(g, name=name, op=hvd.Sum, scheme="omnireduce")

    def pattern(ids: str) -> list[dict]:
        g = grad(ids, 1000 * rank + len(ids))
        ref = hvd.allreduce(g.to_dense().double(), name="bench.ref", op=hvd.Sum)
        # float32 sums of thousands of hot-row lookups, in whatever order: rounding only
        atol = 1e-5 * max(1.0, float(ref.abs().max()))
        mine = torch.unique(g._indices()[0])
        present = torch.zeros(n, args.rows, dtype=torch.bool)
        present[rank, mine] = True
        present = hvd.allreduce(present.to(torch.int32), name="bench.present", op=hvd.Sum) > 0
        need = [int(present[[j for j in range(n) if j != r]].any(0).sum()) * args.dim * 4
                for r in range(n)]
        fns = {"hvd sparse": lambda: hvd.sparse_allreduce_async(
            g, name="bench.hvd_sparse", op=hvd.Sum)()}
        for m in args.methods:
            fns.setdefault(m, lambda m=m: ours(m, g, ids))
        fns = {m: fns[m] for m in args.methods}
        drows: dict[str, dict] = {}
        for m, fn in list(fns.items()):
            out = fn().to_dense()
            bad = not torch.allclose(out.double(), ref, rtol=1e-5, atol=atol)
            bad_anywhere = gather([float(bad)], "bench.ok").sum().item() > 0
            drows[m] = {"ids": ids, "method": m, "ok": not bad_anywhere,
                        "bound ms": max(need) * 8 / tb.rate_bps * 1e3,
                        "rows/rank": float(gather([float(mine.numel())], "bench.rows").mean()),
                        "union": int(present.any(0).sum())}
            if bad_anywhere:
                del fns[m]
        times: dict[str, list[float]] = {m: [] for m in fns}
        rx: dict[str, list[float]] = {m: [] for m in fns}
        names = list(fns)
        for i in range(args.warmup + args.reps):
            for m in names[i % len(names):] + names[:i % len(names)]:
                c0 = links.counters(tb) if rank == 0 else None
                sync()
                t0 = time.perf_counter()
                fns[m]()
                dt = time.perf_counter() - t0
                sync()
                if i >= args.warmup:
                    times[m].append(dt)
                    if rank == 0:
                        c1 = links.counters(tb)
                        rx[m].append(max(c1[h.name]["rx_bytes"] - c0[h.name]["rx_bytes"]
                                         for h in tb.worker_hosts))
            if rank == 0:
                console.print(f"N={n} {ids}: rep {i + 1}/{args.warmup + args.reps} done")
        metrics = hvd_sparse.metrics()
        for m in fns:
            r = drows[m]
            r["ms"] = slowest_median_ms(times[m], "bench.times")
            r["x of bound"] = r["ms"] / r["bound ms"]
            if rank == 0:
                r["worker rx MB"] = statistics.mean(rx[m]) / 1e6
                r["util %"] = 100 * statistics.mean(rx[m]) * 8 / (r["ms"] / 1e3) / tb.rate_bps
            key = f"bench.{m.replace(' ', '.')}.{ids}"
            if key in metrics:  # the last call's
                r["scheme"] = metrics[key]["scheme"]
                r["retransmits"] = metrics[key].get("retransmits")
            plan = st.context.rows_plans.get(key)
            if plan is not None and plan.decided:  # what auto's trial timed (slowest rank)
                r["trial ms"] = " / ".join(f"{plan.decided[w] * 1e3:.0f}"
                                           for w in ("allgather", "omnireduce"))
        return list(drows.values())

    rows = []
    for ids in args.ids.split(","):
        rows += pattern(ids)
    if rank == 0:
        Path(args.rank_side).write_text(json.dumps(rows, default=float))
    if "rows agg colocated" in sessions:
        sessions["rows agg colocated"].close()
    hvd_sparse.shutdown()


def main() -> int:
    return testbed_main("bench_scale", parse_args(), rank_side, drive)


if __name__ == "__main__":
    sys.exit(main())
