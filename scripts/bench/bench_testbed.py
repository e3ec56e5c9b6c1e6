"""Every scheme on emulated hosts: 4 worker namespaces (--workers) and 4 aggregator namespaces
(--aggregators) behind a switch namespace, every link rate-capped (tbf) in both directions,
MTU 9000. Needs root.

    .venv/bin/python scripts/bench/bench_testbed.py [--rates 1gbit,10gbit] [--quick]
    .venv/bin/python scripts/bench/bench_testbed.py --switch emu --rates 1gbit \
        --densities 1,0.1,0.01


For each rate the script brings a testbed up (hvd_sparse.tools.testbed), runs itself on it as one
Horovod rank per worker host (Open MPI, Horovod's MPI operations), and takes it down. Each rank
holds --numel float32 (default 26,214,400) with whole 256-blocks non-zero at random, a
different pattern per rank, at each density. Methods, all op=Sum, in place as the optimizers
call them (the input restored outside the timed region):

* hvd dense: ``hvd.allreduce_``; hvd sparse: Horovod's COO path (``hvd.sparse_allreduce_async``
  on ``t.to_sparse()`` made outside the timed region, as in bench_sync.py); hvd sparse e2e: the
  same with ``to_sparse()`` and the final ``to_dense()`` timed, dense in and out as ours;
* allgather, zen, auto, omnireduce x4 (the 4 aggregator hosts), omnireduce x1 (only a0):
  ``hvd_sparse.allreduce_(t, scheme=...)``;
* omnireduce colocated (the job's own aggregators, a shard on every worker host: the default
  with no aggregators configured) and omnireduce rank0 (the job's own, all on rank 0's host:
  the default before): the aggregator hosts stay idle;
* with ``--switch emu`` (the emulated switch in place of the bridge): switch, aggregation in
  the switch (scheme "switch"), with the emulator's packets per second, passes per packet,
  mean slots in flight and mean round wait (its first DATA to its last, at the switch);
* allgather gloo, zen gloo: the same schemes over torch.distributed's Gloo (the DDP front end's
  collective layer) on the same hosts' eth0, beside Horovod in the same ranks: a reference line
  for the peer-to-peer exchange that does not ride on Open MPI.

Per method: the median over --reps of the slowest rank's time; bytes each host received
(its eth0 counters, read by rank 0 around every timed call); the link utilization of the
busiest worker (its received bits / time / rate); and the ratio to its lower bound (``bound
ms``): the bytes a worker must receive (every block non-zero on some other rank) over the link
rate, for the worker that must receive most (``worker bound ms``, the same for every method),
or, where more, what the method's aggregators must move through their own links: each of A
aggregator hosts sends every worker its 1/A of the union and receives 1/A of every worker's
blocks; colocated shards share the worker hosts' links, and rank0 puts it all on one.
Results are checked against ``hvd.allreduce`` first.
Writes bench_results/testbed.json and testbed.png (with --switch emu: switch.json, switch.png).
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

METHODS = ["hvd dense", "hvd sparse", "hvd sparse e2e", "allgather", "allgather gloo", "zen",
           "zen gloo", "omnireduce x1", "omnireduce x4", "omnireduce colocated",
           "omnireduce rank0", "switch", "auto"]
OURS = ["allgather", "allgather gloo", "zen", "zen gloo", "omnireduce x1", "omnireduce x4",
        "omnireduce colocated", "switch"]
GLOO = {"allgather gloo": "allgather", "zen gloo": "zen"}  # scheme over torch.distributed
# the job's own aggregators (no HVD_SPARSE_AGGREGATORS), by aggregator_layout
OWN = {"omnireduce colocated": "colocated", "omnireduce rank0": "rank0"}
TARGET_SPARSE_X, TARGET_BOUND_X, TARGET_AUTO_X = 2.0, 1.5, 0.95
TARGET_SWITCH_X = 2.5  # the switch against one aggregator host at 10%
TARGET_AGG_X = 1.3  # aggregation against the faster allgather (ours or over Gloo), 10%, N=16


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--densities", default="1.0,0.4,0.1,0.01")
    ap.add_argument("--numel", type=int, default=26_214_400)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mtu", type=int, default=9000)
    ap.add_argument("--workers", default="4",
                    help="worker hosts, one rank each; several (4,8,16): a testbed each")
    ap.add_argument("--aggregators", type=int, default=4, help="aggregator hosts")
    ap.add_argument("--cpu-per-host", type=float, default=0.0, metavar="CORES",
                    help="each host's CPU budget in cores (0: none; the switch is never capped):"
                    " what the times owe to the hosts' CPU rather than the links")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--quick", action="store_true", help="4 Mi elements, 3 reps: a smoke run")
    ap.add_argument("--switch", choices=("bridge", "emu"), default="bridge",
                    help="the testbed's switch; emu adds the method 'switch'")
    ap.add_argument("--probe", choices=("force", "off"), default="force",
                    help="probe the cost model at init (off: no model columns; the probe "
                    "moves tens of MB per rank, minutes on slow links)")
    ap.add_argument("--name", default="hvbench", help="testbed name")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    ap.add_argument("--rank-side", help=argparse.SUPPRESS)  # result file: run as a rank
    args = ap.parse_args()
    if args.quick:
        args.numel, args.reps = 4 * 2**20, 3
    args.methods = [m for m in METHODS if m in args.methods.split(",")
                    and (m != "switch" or args.switch == "emu")]
    return args


# --- the driver: one testbed per rate ---------------------------------------------------------

def drive(args: argparse.Namespace) -> int:
    from hvd_sparse.tools.testbed import lifecycle
    from hvd_sparse.tools.testbed.topology import Testbed

    rows: list[dict] = []
    failed = False
    for rate, n in ((r, int(w)) for r in args.rates.split(",")
                    for w in args.workers.split(",")):
        console.rule(f"testbed: {n} workers + {args.aggregators} aggregator hosts, "
                     f"{rate}, MTU {args.mtu}, switch {args.switch}")
        tb = lifecycle.up(Testbed(args.name, workers=n, aggregators=args.aggregators,
                                  rate=rate, mtu=args.mtu, switch=args.switch,
                                  cpu_per_host=args.cpu_per_host))
        try:
            got = rank_rows(tb, str(Path(__file__).resolve()), [
                "--densities", args.densities, "--numel", str(args.numel), "--reps",
                str(args.reps), "--warmup", str(args.warmup), "--switch", args.switch,
                "--probe", args.probe,
                "--methods", ",".join(args.methods)], f"{rate}, N={n}")
            if got is None:  # report the other rates and sizes anyway
                failed = True
                continue
            rows += [{"rate": rate, "workers": n, "cpu per host": args.cpu_per_host, **r}
                     for r in got]
        finally:
            lifecycle.down(args.name)
    if rows:
        report(rows, args)
    return 1 if failed or not rows else 0


def report(rows: list[dict], args: argparse.Namespace) -> None:
    nan = float("nan")
    by = {(r["rate"], r["workers"], r["density"], r["method"]): r for r in rows}
    for r in rows:
        base = by.get((r["rate"], r["workers"], r["density"], "hvd sparse"), {})
        r["x vs hvd sparse"] = base.get("ms", nan) / r.get("ms", nan)
    cols = ["rate", "workers", "density", "method", "ms", "x vs hvd sparse", "bound ms",
            "x of bound", "util %", "worker rx MB", "aggregators tx MB", "busiest link MB",
            "worker links rx/tx MB", "scheme", "retransmits", "model ms",
            "model err %", "link model err %", "switch kpps", "slots in flight", "round wait ms",
            "passes / packet", "ok"]
    print_table(rows, f"in-place allreduce of {args.numel:,} float32 on emulated hosts, "
                      f"median of {args.reps} (slowest rank)", cols,
                caption="bound: the bytes the worker that must receive most must receive "
                "(blocks non-zero on some other rank), over the link rate, or what the "
                "method's aggregator links must carry where more (worker bound ms: the former). "
                "util: the busiest worker's received bits / time / rate. worker rx MB: mean "
                "over workers, per call (eth0 counters). aggregators tx MB: all aggregator "
                "hosts together, per call. busiest link MB: the most any worker host's link "
                "carried in one direction, per call; worker links rx/tx MB: each worker host's "
                "(w0 first). model: the cost model's prediction (probed at init on these "
                "links; omnireduce's terms fitted on the 4 aggregator hosts, so x1 has none). "
                "switch kpps: packets the emulator aggregated per second of the call; "
                "slots in flight: the emulator's slot groups bound to a slot, averaged over "
                "the call (its occupied_us); round wait ms: from a round's first DATA at the "
                "switch to its last, the mean over the call's rounds; "
                "passes / packet: pipeline passes (1 + recirculations) per aggregated packet.")
    targets = []

    def target(name: str, value: float, need: float, higher: bool = True) -> None:
        met = value >= need if higher else value <= need  # NaN meets nothing
        targets.append({"target": name, "value": value, "need": need, "met": met})
        console.print(f"target {name}: {value:.2f} (need {'>=' if higher else '<='} {need}): "
                      + ("[green]met[/]" if met else "[red]NOT met[/]"))

    for rate, n in dict.fromkeys((r["rate"], r["workers"]) for r in rows):
        at = f"{rate}, N={n}"
        densities = sorted({r["density"] for r in rows if (r["rate"], r["workers"]) == (rate, n)})
        for d in densities:
            def get(m: str, key: tuple = (rate, n, d)) -> dict:
                return by.get((*key, m), {})
            ours = [get(m) for m in OURS if "ms" in get(m)]
            if ours and rate == "1gbit" and d in (0.01, 0.1):
                best = min(ours, key=lambda r: r["ms"])
                target(f"{at} @ {d:g}: best of ours ({best['method']}) vs hvd sparse",
                       best["x vs hvd sparse"], TARGET_SPARSE_X)
                target(f"{at} @ {d:g}: best of ours ({best['method']}) x of bound",
                       best["x of bound"], TARGET_BOUND_X, higher=False)
            a = get("auto")
            if a and any(get(m) for m in ("hvd dense", "hvd sparse", "hvd sparse e2e")):
                for sparse in ("hvd sparse", "hvd sparse e2e"):
                    base = min(get(m).get("ms", nan) for m in ("hvd dense", sparse))
                    target(f"{at} @ {d:g}: auto ({a.get('scheme')}) vs best of hvd dense/"
                           f"{sparse.removeprefix('hvd ')}", base / a.get("ms", nan),
                           TARGET_AUTO_X)
            gathers = [get(m)["ms"] for m in ("allgather", "allgather gloo") if "ms" in get(m)]
            if gathers and d == 0.1 and n >= 16:
                for m in ("omnireduce colocated", "switch"):
                    if get(m):
                        target(f"{at} @ {d:g}: {m} vs the faster allgather",
                               min(gathers) / get(m).get("ms", nan), TARGET_AGG_X)
            sw, one = get("switch"), get("omnireduce x1")
            if "ms" in sw and rate == "1gbit" and d in (0.01, 0.1):
                if d == 0.1 and "ms" in one:
                    target(f"{at} @ {d:g}: switch vs omnireduce x1", one["ms"] / sw["ms"],
                           TARGET_SWITCH_X)
                target(f"{at} @ {d:g}: switch x of bound", sw["x of bound"], TARGET_BOUND_X,
                       higher=False)
    stem = "switch" if args.switch == "emu" else "testbed"
    out = write_json(args.out_dir / f"{stem}.json", rows, args=vars(args), targets=targets)
    plot(rows, args, args.out_dir / f"{stem}.png")
    console.print(f"wrote {out} and {args.out_dir / f'{stem}.png'}")


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    """One panel per rate: ms against density with the per-host bound, or, with several worker
    counts, time over the bound against N, one panel per (rate, density)."""
    from matplotlib.figure import Figure

    ns = sorted({r["workers"] for r in rows})
    panels = list(dict.fromkeys((r["rate"], r["density"] if len(ns) > 1 else None)
                                for r in rows))
    fig = Figure(figsize=(7 * len(panels), 5))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (rate, density) in zip(axes, panels, strict=True):
        rs = [r for r in rows if r["rate"] == rate and density in (None, r["density"])]
        if density is None:
            densities = sorted({r["density"] for r in rs})
            for j, m in enumerate(args.methods):
                ax.plot(densities, [pick(rs, m, density=d).get("ms", nan_) for d in densities],
                        marker="o", label=m, color=f"C{j}")
            ax.plot(densities, [pick(rs, None, density=d).get("worker bound ms", nan_)
                                for d in densities], "k--", label="per-host lower bound")
            ax.set(xscale="log", yscale="log", xlabel="block density per rank", ylabel="ms",
                   title=f"{rate} links, {ns[0]} workers")
        else:
            for j, m in enumerate(args.methods):
                ax.plot(ns, [pick(rs, m, workers=n).get("ms", nan_)
                             / pick(rs, m, workers=n).get("worker bound ms", nan_) for n in ns],
                        marker="o", label=m, color=f"C{j}")
            ax.axhline(1.0, color="k", ls="--", lw=0.8, label="per-host lower bound")
            ax.set(xticks=ns, yscale="log", xlabel="workers", ylabel="time / per-host bound",
                   title=f"{rate} links, density {density:g}")
        ax.legend(fontsize=7)
    fig.suptitle(f"allreduce of {args.numel:,} float32 on emulated hosts (MTU {args.mtu})")
    save_png(fig, path)


def pick(rows: list[dict], method: str | None, **key: object) -> dict:
    """The row of ``method`` (any, when None) whose fields match ``key``; {} when none."""
    return next((r for r in rows if method in (None, r["method"])
                 and all(r[k] == v for k, v in key.items())), {})


nan_ = float("nan")


# --- the rank side: one Horovod rank per worker host ------------------------------------------

def aggregation_bounds(masks, aggregator_hosts: int, worker_need: int,
                       ms_per_byte: float) -> dict[str, float]:
    """Lower bounds (ms) per method from the ranks' block masks (n x blocks, bool): the worker
    bound, raised where a method's aggregators must move more through their own links (each
    link full duplex; 256 float32 per block; headers not counted). What comes back to a rank
    is the union less the blocks it alone holds (flag OWN)."""
    from hvd_sparse import costmodel

    n = masks.shape[0]
    block = 256 * 4
    union = int(masks.any(0).sum()) * block
    nnz = [int(m.sum()) * block for m in masks]
    held = masks.sum(0)  # ranks holding each block
    alone = [int((m & (held == 1)).sum()) * block for m in masks]

    def agg_hosts(a: int) -> float:
        return costmodel.aggregation_link_blocks(nnz, union, a, alone) * ms_per_byte

    # colocated: host r's shard serves 1/n of the slots, its own worker's share stays local
    colocated = costmodel.aggregation_link_blocks(nnz, union, 0, alone)
    return {"worker": worker_need * ms_per_byte,
            "omnireduce x1": agg_hosts(1), "omnireduce x4": agg_hosts(aggregator_hosts),
            "omnireduce colocated": max(worker_need, colocated) * ms_per_byte,
            "omnireduce rank0": max(worker_need, (n - 1) * union - sum(alone[1:]),
                                    sum(nnz) - nnz[0]) * ms_per_byte}


def gloo_collectives(tb, rank: int, n: int):
    """torch.distributed's Gloo beside Horovod on the worker hosts' eth0 (rank 0's address and
    a free port, broadcast over Horovod): the collective layer of the DDP front end."""
    import socket

    import horovod.torch as hvd
    import torch.distributed as dist

    from hvd_sparse.comm.distributed import TorchCollectives

    addr = None
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((tb.worker_hosts[-1].ip, 9))  # sends nothing: picks eth0's address
            ip = s.getsockname()[0]
        with socket.socket() as s:
            s.bind((ip, 0))
            addr = f"tcp://{ip}:{s.getsockname()[1]}"
    addr = hvd.broadcast_object(addr, root_rank=0, name="bench.gloo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    dist.init_process_group("gloo", init_method=addr, rank=rank, world_size=n)
    return TorchCollectives()


def rank_side(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch
    from bench_sync import Method, check, slowest_median_ms, sync

    import hvd_sparse
    from hvd_sparse import _C, basics, blocks, costmodel, engine, schemes
    from hvd_sparse import session as omni
    from hvd_sparse.job import Job
    from hvd_sparse.tools.lab.inputs import make_tensor
    from hvd_sparse.tools.testbed import links
    from hvd_sparse.tools.testbed.topology import Testbed

    hvd.init()
    torch.set_num_threads(1)
    hvd_sparse.init(probe=args.probe)
    rank, n = hvd.rank(), hvd.size()
    tb = Testbed.load(os.environ["HVD_SPARSE_TESTBED"])
    st = basics.state()
    cfg = st.config
    one = omni.start(dataclasses.replace(cfg, aggregators=cfg.aggregator_list()[:1]), st.comm)
    sessions = {"omnireduce x1": one, "omnireduce x4": st.omni}
    for m, layout in OWN.items():
        if m in args.methods:
            sessions[m] = omni.start(dataclasses.replace(
                cfg, aggregators="", aggregator_layout=layout), st.comm)
    if st.switch is not None:
        sessions["switch"] = st.switch
    gloo = gloo_collectives(tb, rank, n) if any(m in GLOO for m in args.methods) else None

    def over_gloo(scheme: str, w: torch.Tensor) -> torch.Tensor:
        """``scheme`` as the DDP front end runs it: the same Job, over Gloo."""
        job = Job(name=f"bench.{scheme}.gloo", tensor=w.view(-1), shape=w.shape, average=False,
                  prescale=1.0, postscale=1.0, block_size=cfg.block_size,
                  meta=blocks.meta_hash(w.shape, w.dtype), scheme=scheme, ctx=st.context,
                  comm=gloo, inplace=True, asked=scheme)
        return engine.synchronize(engine.submit(job, schemes.run(job), lambda h: None),
                                  cfg.timeout).view(w.shape)

    def switch_counters() -> dict:
        from hvd_sparse.tools.switch import control
        return control.Client(tb.switch_control).stats()["aggregation"]

    def ours(scheme: str, w: torch.Tensor) -> torch.Tensor:
        name = f"bench.{scheme.replace(' ', '.')}"
        if scheme in GLOO:
            return over_gloo(GLOO[scheme], w)
        if scheme not in sessions or scheme == "switch":
            return hvd_sparse.allreduce_(w, name=name, op=hvd.Sum, scheme=scheme)
        with basics.joined(omni=sessions[scheme]):
            return hvd_sparse.allreduce_(w, name=name, op=hvd.Sum, scheme="omnireduce")

    def density(di: int, d: float) -> list[dict]:
        gen = torch.Generator().manual_seed(rank * 7919 + di)
        t = make_tensor(args.numel, 256, d, gen)
        t_orig, work = t.clone(), t.clone()
        coo = t.to_sparse()
        ref = hvd.allreduce(t, name="bench.ref", op=hvd.Sum)
        # The bound: per worker, the blocks non-zero on some other rank.
        masks = hvd.allgather(_C.block_mask(t, 256)[None], name="bench.masks") > 0
        need = [int((masks[[j for j in range(n) if j != r]].any(0)).sum()) * 256 * 4
                for r in range(n)]
        bound_ms = aggregation_bounds(masks, len(tb.aggregator_hosts), max(need),
                                      8e3 / tb.rate_bps)
        # What the cost model (probed at init on these links) predicts, for its validation.
        nnz, union = masks.sum(1).tolist(), float(masks.any(0).sum())
        model_of = {} if args.probe == "off" else {
            "hvd dense": "dense", "allgather": "allgather", "zen": "zen",
            "omnireduce x4": "omnireduce", "switch": "switch"}
        pred: dict[str, float] = {}
        link: dict[str, float] = {}
        if model_of:
            pred = costmodel.predict(st.net, args.numel, 4, 256, nnz, union).seconds
            # ... and moved onto these links as `hvd-sparse analyze`'s what-if moves it
            link = costmodel.predict(costmodel.NetModel.for_link(
                tb.rate_bps, n, st.net, len(tb.aggregator_hosts)), args.numel, 4, 256, nnz,
                union).seconds
            link["colocated"] = costmodel.predict(costmodel.NetModel.for_link(
                tb.rate_bps, n, st.net, 0), args.numel, 4, 256, nnz, union).seconds[
                    "omnireduce"]
        inputs = {"nnz": nnz, "union": union, "workers": n, "rate_bps": tb.rate_bps,
                  "aggregator hosts": len(tb.aggregator_hosts), "net": dataclasses.asdict(st.net)}

        def restore() -> torch.Tensor:
            return work.copy_(t)

        fns = {"hvd dense": Method(lambda: hvd.allreduce_(work, name="bench.hvd_dense",
                                                            op=hvd.Sum), restore),
               "hvd sparse": Method(lambda: hvd.sparse_allreduce_async(
                   coo, name="bench.hvd_sparse", op=hvd.Sum)()),
               "hvd sparse e2e": Method(lambda: hvd.sparse_allreduce_async(
                   t.to_sparse(), name="bench.hvd_sparse_e2e", op=hvd.Sum)().to_dense())}
        for m in args.methods:
            if m not in fns:
                fns[m] = Method(lambda m=m: ours(m, work), restore)
        fns = {m: fns[m] for m in args.methods}
        drows = {}
        for m, fn in list(fns.items()):
            t0 = time.perf_counter()
            problem, _ = check(fn, ref, t, t_orig)
            if problem and m in sessions:  # what this rank's worker dropped, and why
                ws = sessions[m].worker.stats()
                problem += " [worker: " + ", ".join(
                    f"{k} {ws[k]}" for k in ("retransmits", "malformed", "stale", "foreign",
                                             "bad_mac", "replayed", "rx_packets")) + "]"
            # every rank's problem, and when it ended: the first to fail names the cause
            said = hvd.allgather_object((problem, time.perf_counter() - t0))
            bad = sum(bool(p) for p, _ in said)
            drows[m] = {"density": d, "method": m, "ok": bad == 0,
                        "worker bound ms": bound_ms["worker"],
                        "bound ms": bound_ms.get(m, bound_ms["worker"])}
            if m in model_of:
                drows[m]["model ms"] = pred[model_of[m]] * 1e3
            if m in model_of or (m == "omnireduce colocated" and model_of):
                drows[m]["link model ms"] = link[model_of.get(m, "colocated")] * 1e3
            drows[m]["model inputs"] = inputs  # to check other models against this run
            if bad:
                first = min((secs, r, p) for r, (p, secs) in enumerate(said) if p)
                drows[m]["problem"] = f"rank {first[1]} after {first[0]:.1f} s: {first[2]}"
                drows[m]["problems"] = {r: f"after {secs:.1f} s: {p}"
                                        for r, (p, secs) in enumerate(said) if p}
                if rank == 0:
                    console.print(f"[red]{m} failed[/]: {drows[m]['problems']}")
                del fns[m]
        times: dict[str, list[float]] = {m: [] for m in fns}
        rx: dict[str, list[dict]] = {m: [] for m in fns}
        pipeline: dict[str, list[tuple[float, int, int]]] = {m: [] for m in fns}
        retx0 = {k: s.worker.stats()["retransmits"] for k, s in sessions.items()}
        names = list(fns)
        for i in range(args.warmup + args.reps if names else 0):
            for m in names[i % len(names):] + names[:i % len(names)]:
                fns[m].restore()
                c0 = links.counters(tb) if rank == 0 else None
                s0 = switch_counters() if rank == 0 and m == "switch" else None
                sync()
                t0 = time.perf_counter()
                fns[m].call()
                dt = time.perf_counter() - t0
                sync()
                if i >= args.warmup:
                    times[m].append(dt)
                    if rank == 0:
                        c1 = links.counters(tb)
                        rx[m].append({h: (c1[h]["rx_bytes"] - c0[h]["rx_bytes"],
                                          c1[h]["tx_bytes"] - c0[h]["tx_bytes"]) for h in c1})
                        if s0 is not None:
                            s1 = switch_counters()
                            # (a switch without occupied_us, round_wait_us: 0, NaN below)
                            pipeline[m].append((dt, *(s1.get(k, 0) - s0.get(k, 0) for k in (
                                "packets", "passes", "occupied_us", "round_wait_us",
                                "results"))))
            if rank == 0:
                console.print(f"density {d:g}: rep {i + 1}/{args.warmup + args.reps} done")
        metrics = hvd_sparse.metrics()
        for m in fns:
            ms = slowest_median_ms(times[m], "bench.times")
            r = drows[m]
            r["ms"] = ms
            if rank == 0:
                per = rx[m]
                workers = [h.name for h in tb.worker_hosts]
                wrx = [statistics.mean(p[h][0] for p in per) for h in workers]
                r["worker rx MB"] = statistics.mean(wrx) / 1e6
                r["aggregators tx MB"] = sum(statistics.mean(p[h.name][1] for p in per)
                                             for h in tb.aggregator_hosts) / 1e6
                # each worker host's link, both directions: where the aggregation load sits
                r["worker links rx/tx MB"] = " ".join(
                    f"{statistics.mean(p[h][0] for p in per) / 1e6:.1f}/"
                    f"{statistics.mean(p[h][1] for p in per) / 1e6:.1f}" for h in workers)
                r["busiest link MB"] = max(statistics.mean(p[h][k] for p in per)
                                           for h in workers for k in (0, 1)) / 1e6
                r["util %"] = 100 * max(wrx) * 8 / (ms / 1e3) / tb.rate_bps
                r["x of bound"] = ms / r["bound ms"]
                for k in ("model", "link model"):
                    if f"{k} ms" in r:
                        r[f"{k} err %"] = 100 * (r[f"{k} ms"] - ms) / ms
                if pipeline[m]:
                    secs, pkts, passes, occ_us, wait_us, results = (
                        sum(x) for x in zip(*pipeline[m], strict=True))
                    r["switch kpps"] = pkts / secs / 1e3
                    r["passes / packet"] = passes / max(1, pkts)
                    r["slots in flight"] = occ_us / 1e6 / secs if occ_us else nan_
                    r["round wait ms"] = wait_us / 1e3 / max(1, results) if wait_us else nan_
            key = f"bench.{m.replace(' ', '.')}"
            if key in metrics:
                r["scheme"] = metrics[key]["scheme"]
        for k, s in sessions.items():
            if k in fns:
                drows[k]["retransmits"] = int(hvd.allreduce(torch.tensor(
                    [s.worker.stats()["retransmits"] - retx0[k]]), op=hvd.Sum,
                    name=f"bench.retx.{k}"))
        return list(drows.values())

    rows = []
    for di, d in enumerate(float(x) for x in args.densities.split(",")):
        rows += density(di, d)
    if rank == 0:
        Path(args.rank_side).write_text(json.dumps(rows, default=float))
    one.close()
    for m in OWN:
        if m in sessions:
            sessions[m].close()
    if gloo is not None:
        import torch.distributed as dist
        dist.destroy_process_group()
    hvd_sparse.shutdown()


def main() -> int:
    return testbed_main("bench_testbed", parse_args(), rank_side, drive)


if __name__ == "__main__":
    sys.exit(main())
