"""Wall time of one sparse-gradient allreduce: hvd_sparse schemes against Horovod's own paths.

Run from the repo root, 4 ranks over Gloo on this host:

    .venv/bin/horovodrun -np 4 -H localhost:4 --gloo .venv/bin/python scripts/bench/bench_sync.py

or let the script do that (it re-execs itself under horovodrun when HOROVOD_RANK is unset):

    .venv/bin/python scripts/bench/bench_sync.py [--np 4] [--quick]

Each rank holds a float32 tensor of --numel elements (default 26,214,400 = 100 MiB) in which
whole --block-size blocks are non-zero at random, a different pattern per rank (seeded), at
each of --densities. Methods, all with op=Sum:

* hvd dense:  ``hvd.allreduce(t)`` (ring allreduce);
* hvd sparse: ``hvd.sparse_allreduce_async(coo, ...)`` then calling the handle it returns, on
  ``coo = t.to_sparse()`` made *outside* the timed region (1-D COO, int64 index per non-zero
  element). Horovod's sparse handle is a closure: ``hvd.synchronize(handle)`` returns None
  without waiting, so the benchmark calls ``handle()`` as Horovod's optimizer does. The timed
  result is the uncoalesced sparse tensor; the to_sparse() time is reported separately;
* hvd sparse e2e: the same, dense tensor in, dense tensor out as hvd_sparse returns:
  ``t.to_sparse()``, the sparse allreduce, ``.to_dense()``, all timed (informational);
* ours <scheme>: ``hvd_sparse.allreduce(t, scheme=...)`` for dense, allgather, zen,
  omnireduce (one local aggregator, started by hvd_sparse.init), "omnireduce K=2" (the same
  over a second session of two local aggregators), auto,
  starting from the dense tensor (its bitmap + pack is inside the timed region);
* hvd dense in-place: ``hvd.allreduce_(w)``; ours <scheme> in-place: ``hvd_sparse.allreduce_(w,
  scheme=...)``, as both optimizers call it. ``w`` is a work tensor restored from the input by
  ``w.copy_(t)`` before each call, *outside* the timed region for every in-place method: an
  optimizer reduces the gradient it just computed and never pays that copy. (The copy leaves
  ``w``'s pages mapped and partly cached, as a freshly written gradient is.)

Every result is compared with Horovod's dense allreduce (allclose, rtol 1e-5, atol 1e-6) and
the input checked unmodified before timing; a wrong method is reported, not timed. A time is
the median over --reps of the slowest rank's time, each call preceded by a tiny allreduce so
that ranks start together; reps interleave the methods (order rotated each rep) so that load
from other processes on the machine spreads over all of them. With more ranks than cores
(4 ranks on a 2-core box) every rank's local work is stretched by time-slicing, which weighs
on the schemes that pack and unpack on the host. Each rank runs --threads torch intra-op
threads, by default cores // ranks on the host (at least 1): torch's own default, one per
core in every rank, oversubscribes the cores and makes every OpenMP region crawl.

Bytes sent per rank: ours from hvd_sparse.metrics() (mean over ranks); Horovod dense
2(n-1)/n * numel * 4; Horovod sparse (n-1)/n * total gathered bytes (4 B value + 8 B index per
non-zero element, summed over ranks). Rank 0 prints the table and writes <out-dir>/sync.json
and <out-dir>/sync.png. --quick: 4 Mi elements, 3 reps, 1 warm-up. --methods runs a subset
("hvd dense" and "hvd sparse", the baselines of every ratio, always run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import horovod.torch as hvd
import torch
from rich.progress import Progress

import hvd_sparse
from hvd_sparse import protocol
from hvd_sparse import session as omni
from hvd_sparse.tools.lab.inputs import make_tensor
from hvd_sparse.tools.lab.report import console, print_table, save_png, write_json

ROOT = Path(__file__).resolve().parents[2]

SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
# "omnireduce K=2": the same scheme over two aggregators instead of init's one
OURS = [*SCHEMES[:-1], "omnireduce K=2", "auto"]
METHODS = ["hvd dense", "hvd dense in-place", "hvd sparse", "hvd sparse e2e",
           *(f"ours {s}" for s in OURS), *(f"ours {s} in-place" for s in OURS)]
RTOL, ATOL = 1e-5, 1e-6
TARGET_ALLGATHER_DENSITY, TARGET_ALLGATHER_X = 0.01, 1.5
TARGET_AUTO_X = 0.95
TARGET_OOP_DENSITY, TARGET_OOP_X, TARGET_INPLACE_X = 0.01, 1.0, 1.5


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=4, help="ranks when self-launching")
    ap.add_argument("--numel", type=int, help="default 26,214,400 (--quick: 4Mi)")
    ap.add_argument("--densities", default="1.0,0.4,0.1,0.01")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated subset of: " + ", ".join(METHODS))
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--reps", type=int, help="default 5 (--quick: 3)")
    ap.add_argument("--warmup", type=int, help="default 2 (--quick: 1)")
    ap.add_argument("--quick", action="store_true", help="smaller defaults, for a smoke run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads per rank (0: cores // ranks on this host)")
    ap.add_argument("--probe", choices=["auto", "force", "off"], default=None,
                    help="hvd_sparse network probe for 'auto' (default: its own; 'auto' reuses "
                    "a cached probe, so use 'force' on a machine whose load has changed)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    args = ap.parse_args()
    # Explicit flags win over --quick.
    for key, full, quick in (("numel", 26_214_400, 4 * 2**20), ("reps", 5, 3), ("warmup", 2, 1)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    chosen = {m.strip() for m in args.methods.split(",")} | {"hvd dense", "hvd sparse"}
    if chosen - set(METHODS):
        ap.error(f"unknown methods: {sorted(chosen - set(METHODS))}")
    args.methods = [m for m in METHODS if m in chosen]
    return args


def self_launch(n: int) -> int:
    runner = ROOT / ".venv" / "bin" / "horovodrun"
    exe = str(runner) if runner.exists() else shutil.which("horovodrun") or "horovodrun"
    cmd = [exe, "-np", str(n), "-H", f"localhost:{n}", "--gloo", sys.executable,
           str(Path(__file__).resolve()), *sys.argv[1:]]
    print("+", shlex.join(cmd), flush=True)
    return subprocess.call(cmd)


def main() -> int:
    args = parse_args()
    if "HOROVOD_RANK" not in os.environ:
        return self_launch(args.np)
    return run(args)


def sync() -> None:
    """Tiny allreduce as a barrier, so every rank starts a timed call together."""
    hvd.allreduce(torch.zeros(1), name="bench.sync", op=hvd.Sum)


def gather(xs: list[float], name: str) -> torch.Tensor:
    """[n, len(xs)]: row r holds rank r's values."""
    return hvd.allgather(torch.tensor([xs], dtype=torch.float64), name=name)


@dataclass
class Method:
    call: Callable[[], torch.Tensor]
    restore: Callable[[], object] = lambda: None  # untimed, before each call


def k2_session() -> omni.Session:
    """A second aggregation session over two local aggregators (rank 0 starts them)."""
    cfg = dataclasses.replace(hvd_sparse.basics.state().config, aggregators="",
                              local_aggregators=2)
    session = omni.start(cfg, hvd_sparse.basics.state().comm)
    assert session is not None
    return session


def reduce(scheme: str, inplace: bool, x: torch.Tensor, k2: omni.Session | None) -> torch.Tensor:
    name = f"bench.{scheme.replace(' ', '.')}{'_' if inplace else ''}"
    fn = hvd_sparse.allreduce_ if inplace else hvd_sparse.allreduce
    if scheme != "omnireduce K=2":
        return fn(x, name=name, op=hvd.Sum, scheme=scheme)
    with hvd_sparse.basics.joined(omni=k2):
        return fn(x, name=name, op=hvd.Sum, scheme="omnireduce")


def methods(t: torch.Tensor, coo: torch.Tensor, work: torch.Tensor, k2: omni.Session | None,
            chosen: list[str]) -> dict[str, Method]:
    def restore() -> torch.Tensor:
        return work.copy_(t)

    ms = {
        "hvd dense": Method(lambda: hvd.allreduce(t, name="bench.hvd_dense", op=hvd.Sum)),
        "hvd dense in-place": Method(
            lambda: hvd.allreduce_(work, name="bench.hvd_dense_", op=hvd.Sum), restore),
        # The returned handle is a closure that waits on both allgathers.
        "hvd sparse": Method(lambda: hvd.sparse_allreduce_async(
            coo, name="bench.hvd_sparse", op=hvd.Sum)()),
        # Dense in, dense out, like hvd_sparse.allreduce.
        "hvd sparse e2e": Method(lambda: hvd.sparse_allreduce_async(
            t.to_sparse(), name="bench.hvd_sparse_e2e", op=hvd.Sum)().to_dense()),
    }
    for s in OURS:
        ms[f"ours {s}"] = Method(lambda s=s: reduce(s, False, t, k2))
    for s in OURS:
        ms[f"ours {s} in-place"] = Method(lambda s=s: reduce(s, True, work, k2), restore)
    return {m: ms[m] for m in chosen}


def udp_limit(n: int, payload_bytes: int) -> dict:
    """Raw loopback UDP: n senders blasting one socket with datagrams of the size the
    aggregation protocol sends for float32 (rank 0 runs it while the others wait)."""
    lanes, _ = protocol.layout(1, 256, 4, payload_bytes, 1)
    dgram = (protocol.HEADER_BYTES + protocol.BITMAP_BYTES + protocol.LANE_BYTES * lanes
             + lanes * 256 * 4)
    result = None
    if hvd.rank() == 0:
        out = subprocess.run([str(ROOT / "hvd_sparse" / "bin" / "hvd-sparse-udpblast"),
                              "--senders", str(n), "--bytes", str(dgram), "--seconds", "2"],
                             capture_output=True, text=True, timeout=60)
        result = json.loads(out.stdout)
    return hvd.broadcast_object(result, 0, name="bench.udp")


def check(m: Method, ref: torch.Tensor, t: torch.Tensor,
          t_orig: torch.Tensor) -> tuple[str, float]:
    """(problem or "", max abs error) of one call against the reference; restores t."""
    err = float("nan")
    problem = ""
    try:
        m.restore()
        out = m.call()
        out = out.to_dense() if out.is_sparse else out
        if out.shape != ref.shape:
            problem = f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
        else:
            err = (out - ref).abs().max().item()
            if not torch.allclose(out, ref, rtol=RTOL, atol=ATOL):
                problem = f"mismatch (max abs err {err:.3g})"
    except Exception as e:  # noqa: BLE001 - report it, keep benchmarking the other methods
        problem = f"{type(e).__name__}: {e}"
    if not torch.equal(t, t_orig):
        problem = (problem + "; " if problem else "") + "input tensor modified"
        t.copy_(t_orig)
    return problem, err


def slowest_median_ms(times: list[float], name: str) -> float:
    """Median over reps of the slowest rank's time for that rep."""
    return 1e3 * statistics.median(gather(times, name).max(0).values.tolist())


def time_methods(fns: dict[str, Method], warmup: int, reps: int,
                 tick: Callable[[str], None]) -> dict[str, float]:
    """Median ms per method. Reps are interleaved (method order rotated every rep), so load
    from whatever else shares the machine falls on all methods alike, not on whichever ran
    during a burst."""
    names = list(fns)
    times: dict[str, list[float]] = {m: [] for m in names}
    for i in range(warmup + reps):
        k = i % len(names)
        for m in names[k:] + names[:k]:
            fns[m].restore()
            sync()
            t0 = time.perf_counter()
            fns[m].call()
            if i >= warmup:
                times[m].append(time.perf_counter() - t0)
            tick(f"{'warm-up' if i < warmup else f'rep {i - warmup + 1}/{reps}'}: {m}")
    return {m: slowest_median_ms(times[m], "bench.times") for m in names}


def to_sparse_ms(t: torch.Tensor, reps: int) -> tuple[torch.Tensor, float]:
    """t.to_sparse() and its median time (slowest rank); what Horovod's path needs first."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        coo = t.to_sparse()
        times.append(time.perf_counter() - t0)
    return coo, slowest_median_ms(times, "bench.to_sparse")


def run(args: argparse.Namespace) -> int:
    hvd.init()
    # torch defaults every rank to one thread per core; with 4 ranks on 2 cores the OpenMP
    # regions of the codec (and of torch) then stall on descheduled siblings, 50-100x slower.
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(args.threads)
    hvd_sparse.init(block_size=args.block_size, probe=args.probe)
    rank, n = hvd.rank(), hvd.size()
    densities = [float(d) for d in args.densities.split(",")]
    k2 = k2_session() if any("K=2" in m for m in args.methods) else None
    udp = udp_limit(n, hvd_sparse.basics.state().config.payload_bytes)
    rows: list[dict] = []
    progress = Progress(console=console)
    task = progress.add_task("bench", total=len(densities) * len(args.methods) *
                             (1 + args.warmup + args.reps))
    if rank == 0:  # update/advance on the other ranks are harmless no-ops on screen
        progress.start()
    for di, d in enumerate(densities):

        def tick(what: str, d: float = d) -> None:
            progress.update(task, advance=1, description=f"density {d:g}: {what}")

        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 7919 + di)
        t = make_tensor(args.numel, args.block_size, d, gen)
        t_orig, work = t.clone(), t.clone()
        coo, coo_ms = to_sparse_ms(t, min(args.reps, 3))
        coo_bytes = coo._nnz() * (coo.values().element_size()
                                  + coo.indices().shape[0] * coo.indices().element_size())
        total_coo = gather([float(coo_bytes)], "bench.coo_bytes").sum().item()
        ref = hvd.allreduce(t, name="bench.ref", op=hvd.Sum)

        # Correctness first; all ranks agree on each verdict so none waits on a skipped call.
        fns = methods(t, coo, work, k2, args.methods)
        drows: dict[str, dict] = {}
        for method, m in list(fns.items()):
            problem, err = check(m, ref, t, t_orig)
            if problem:
                console.print(f"[red]rank {rank}: {method} @ density {d:g}: {problem}[/]")
            bad = gather([float(bool(problem))], "bench.ok").sum().item()
            drows[method] = {"density": d, "method": method, "max abs err": err, "ok": bad == 0}
            if bad:
                drows[method]["problem"] = problem or "wrong on another rank"
                del fns[method]
                progress.advance(task, args.warmup + args.reps)
            tick(f"checked {method}")

        for method, ms in time_methods(fns, args.warmup, args.reps, tick).items():
            drows[method]["ms"] = ms
        for method in {"hvd dense", "hvd dense in-place"} & drows.keys():
            drows[method]["MB sent/rank"] = 2 * (n - 1) / n * t.numel() * t.element_size() / 1e6
        drows["hvd sparse"] |= {"MB sent/rank": (n - 1) / n * total_coo / 1e6,
                                "to_sparse ms": coo_ms}
        if "hvd sparse e2e" in drows:
            drows["hvd sparse e2e"]["MB sent/rank"] = (n - 1) / n * total_coo / 1e6
        for s, suffix in ((s, x) for s in OURS for x in ("", " in-place")):
            method = f"ours {s}{suffix}"
            if method in fns:  # metrics of the last (timed) call
                m = hvd_sparse.metrics()[f"bench.{s.replace(' ', '.')}{'_' if suffix else ''}"]
                sent = gather([float(m["bytes_sent"]), float(m.get("bytes_received", 0))],
                              "bench.bytes_sent")
                drows[method] |= {
                    "MB sent/rank": sent[:, 0].mean().item() / 1e6, "scheme": m["scheme"],
                    # hvd_sparse leaves it out for scheme "dense", which never looks.
                    "block density": m.get("block_density", float("nan"))}
                if m["scheme"] == "omnireduce":  # bytes through the aggregators per second
                    goodput = sent.sum().item() / (drows[method]["ms"] / 1e3)
                    drows[method]["agg GB/s"] = goodput / 1e9
                    drows[method]["x of UDP limit"] = goodput / udp["goodput_Bps"]
        rows += drows.values()
        del t, t_orig, work, coo, ref, fns  # free this density's buffers before the next one's
    if rank == 0:
        progress.stop()
        report(rows, densities, args, n, udp)
    if k2 is not None:
        k2.close()
    hvd_sparse.shutdown()
    return 0


def report(rows: list[dict], densities: list[float], args: argparse.Namespace, n: int,
           udp: dict) -> None:
    nan = float("nan")
    by = {(r["density"], r["method"]): r for r in rows}
    for r in rows:
        hd = by[(r["density"], "hvd dense")].get("ms", nan)
        hs = by[(r["density"], "hvd sparse")].get("ms", nan)
        r["x vs hvd dense"] = hd / r.get("ms", nan)
        r["x vs hvd sparse"] = hs / r.get("ms", nan)

    cols = ["density", "method", "ms", "x vs hvd dense", "x vs hvd sparse", "MB sent/rank",
            "scheme", "block density", "agg GB/s", "x of UDP limit", "to_sparse ms",
            "max abs err", "ok"]
    table_rows = [{c: r.get(c, nan if c not in ("scheme", "method") else "") for c in cols}
                  for r in rows]
    print_table(table_rows, f"allreduce of {args.numel:,} float32, {n} ranks x {args.threads} "
                f"threads, B={args.block_size}, median of {args.reps} (slowest rank)", cols,
                caption="hvd sparse excludes to_sparse() (its time shown separately) and the "
                "final to_dense(); hvd sparse e2e includes both. In-place methods exclude the "
                "copy that restores their input before each call. 'scheme' is what hvd_sparse "
                "ran (for 'ours auto': its pick). Targets use hvd sparse. agg GB/s: block bytes "
                "into and out of the aggregators per second; x of UDP limit: that over raw "
                f"loopback UDP, {n} senders to one socket, {udp['bytes']} B datagrams: "
                f"{udp['goodput_Bps'] / 1e9:.2f} GB/s.")
    for r in rows:
        if not r["ok"]:
            console.print(f"[red]WRONG: {r['method']} @ density {r['density']:g}: "
                          f"{r['problem']}[/]")

    targets = []

    def target(name: str, value: float, need: float) -> None:
        met = value >= need  # False for NaN: a failed method does not meet its target
        targets.append({"target": name, "value": value, "need": need, "met": met})
        console.print(f"target {name}: {value:.2f}x (need >= {need}x): "
                      + ("[green]met[/]" if met else "[red]NOT met[/]"))

    # Each target twice: out of place (as first measured) and in place (as the
    # optimizers run). In place, Horovod's own in-place dense allreduce joins the baselines.
    ms = {k: r.get("ms", nan) for k, r in by.items()}
    for suffix in ("", " in-place"):
        ag = (TARGET_ALLGATHER_DENSITY, f"ours allgather{suffix}")
        if ag in by:
            target(f"allgather{suffix} vs hvd sparse @ {TARGET_ALLGATHER_DENSITY:g}",
                   by[ag]["x vs hvd sparse"], TARGET_ALLGATHER_X)
            e2e = ms.get((TARGET_ALLGATHER_DENSITY, "hvd sparse e2e"), nan)
            console.print(f"  (informational: vs hvd sparse e2e: {e2e / ms[ag]:.2f}x)")
        else:
            console.print(f"[yellow]density {TARGET_ALLGATHER_DENSITY} not run: allgather "
                          "target not evaluated[/]")
        baselines = ["hvd dense", "hvd sparse"] + (["hvd dense in-place"] if suffix else [])
        for d in densities:
            if (d, f"ours auto{suffix}") not in by:
                continue
            # nan (a wrong or not run baseline) must not win the min
            best = min((ms.get((d, b), nan) for b in baselines),
                       key=lambda v: (math.isnan(v), v))
            target(f"auto{suffix} vs best of {'/'.join(baselines)} @ {d:g} (auto picked "
                   f"{by[(d, f'ours auto{suffix}')].get('scheme', '?')})",
                   best / ms[(d, f"ours auto{suffix}")], TARGET_AUTO_X)

    # Aggregation against Horovod dense and sparse, in place (as the optimizers run).
    for suffix in ("", " in-place"):
        for k in ("omnireduce", "omnireduce K=2"):
            for d, need_dense, need_sparse in ((0.01, 8.0, 1.0), (0.1, 1.3, 1.3)):
                if (d, f"ours {k}{suffix}") in by:
                    r = by[(d, f"ours {k}{suffix}")]
                    target(f"{k}{suffix} vs hvd dense @ {d:g}", r["x vs hvd dense"], need_dense)
                    target(f"{k}{suffix} vs hvd sparse @ {d:g}", r["x vs hvd sparse"],
                           need_sparse)
    # Every sparse scheme against Horovod's COO path at 1%, out of place and in place.
    for s in ("allgather", "zen", "omnireduce", "auto"):
        for suffix, need in (("", TARGET_OOP_X), (" in-place", TARGET_INPLACE_X)):
            if (TARGET_OOP_DENSITY, f"ours {s}{suffix}") in by:
                target(f"{s}{suffix} vs hvd sparse @ {TARGET_OOP_DENSITY:g}",
                       by[(TARGET_OOP_DENSITY, f"ours {s}{suffix}")]["x vs hvd sparse"], need)
    out = write_json(args.out_dir / "sync.json", rows, args=vars(args), ranks=n, targets=targets,
                     udp_limit=udp)
    plot(rows, densities, args.out_dir / "sync.png",
         f"{args.numel:,} float32, {n} ranks x {args.threads} threads", args.methods)
    console.print(f"wrote {out} and {args.out_dir / 'sync.png'}")


def plot(rows: list[dict], densities: list[float], path: Path, title: str,
         methods: list[str]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5))
    ax = fig.subplots()
    by = {(r["density"], r["method"]): r for r in rows}
    width = 0.8 / len(methods)
    bases = list(dict.fromkeys(m.removesuffix(" in-place") for m in methods))
    for j, method in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(densities))]
        ys = [by.get((d, method), {}).get("ms", 0.0) for d in densities]  # 0: wrong/not run
        base = method.removesuffix(" in-place")  # in place: its out-of-place colour, hatched
        bars = ax.bar(xs, ys, width, label=method, color=f"C{bases.index(base)}",
                      hatch="//" if base != method else None)
        if method.startswith("ours auto"):
            for bar, d in zip(bars, densities, strict=True):
                ax.annotate(by.get((d, method), {}).get("scheme", "?"), (bar.get_x() + width / 2,
                            bar.get_height() or 1), ha="center", va="bottom", fontsize=7,
                            rotation=90)
    ax.set_xticks(range(len(densities)), [f"{d:g}" for d in densities])
    ax.set(yscale="log", xlabel="block density", ylabel="median ms (slowest rank)",
           title=f"sparse allreduce, {title}")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
