"""How close torch.distributed's Gloo ``all_gather`` comes to the link, issued as DDP's sparse
tables are: several gathers of a few MiB each, one after another or on several process groups
(the DDP hook's streams) at once, against one gather of them all.

    hvd-sparse testbed run --name NAME --launcher torch -- \
        python scripts/bench/bench_gloo_allgather.py

Each rank gathers --count tensors of --mb MB (DLRM-like tables, uniform ids: 8 of ~2 MB per
rank); per way, the slowest rank's median of --reps, ranks aligned by a barrier first, and the
bytes this rank's $GLOO_SOCKET_IFNAME sent as a fraction of what the link
($HVD_SPARSE_LINK_RATE, set by the testbed) carries in that time. Table to stdout, JSON and
PNG to --out-dir.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hvd_sparse.tools.lab.report import plt, print_table, save_png, write_json


def sent() -> float:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return float("nan")
    return float(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=2.0, help="MB per tensor and rank")
    ap.add_argument("--count", type=int, default=8, help="tensors per rank")
    ap.add_argument("--streams", default="2,4", help="process groups gathering at once")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    streams = [int(s) for s in args.streams.split(",")]
    groups = [dist.new_group(backend="gloo") for _ in range(max(streams))]
    k = int(args.mb * 1e6 / 4)
    xs = [torch.randn(k) for _ in range(args.count)]
    outs = [[torch.empty(k) for _ in range(n)] for _ in range(args.count)]

    def on(group: int, which: range) -> None:
        for i in which:
            dist.all_gather(outs[i], xs[i], group=groups[group])

    def at_once(s: int) -> None:
        threads = [threading.Thread(target=on, args=(j, range(j, args.count, s)))
                   for j in range(s)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def whole() -> None:
        x = torch.cat(xs)
        dist.all_gather([torch.empty_like(x) for _ in range(n)], x, group=groups[0])

    ways: list[tuple[str, Callable[[], None]]] = [
        (f"1 gather of {args.count} x {args.mb:g} MB", whole),
        (f"{args.count} gathers, one after another", lambda: on(0, range(args.count)))]
    ways += [(f"{args.count} gathers on {s} groups at once", lambda s=s: at_once(s))
             for s in streams]
    rate = float(os.environ.get("HVD_SPARSE_LINK_RATE", "nan"))
    rows = []
    for name, fn in ways:
        times, bytes_out = [], []
        for _ in range(args.reps):
            dist.barrier()
            b0, t0 = sent(), time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            bytes_out.append(sent() - b0)
        slow = torch.tensor([statistics.median(times)])
        dist.all_reduce(slow, dist.ReduceOp.MAX)
        mb = statistics.median(bytes_out) / 1e6
        rows.append({"way": name, "ms": slow.item() * 1e3, "MB sent": mb,
                     "x of link": mb * 8e6 / slow.item() / rate})
        if rank == 0:
            print(f"  {name}: {slow.item() * 1e3:,.0f} ms", file=sys.stderr, flush=True)
    if rank == 0:
        caption = (f"{n} ranks ({os.environ.get('GLOO_SOCKET_IFNAME', 'loopback')}, "
                   f"{rate / 1e9:g} Gbit/s), slowest rank's median of {args.reps}")
        print_table(rows, "Gloo all_gather as DDP's sparse tables issue it", caption=caption)
        fig, ax = plt.subplots(figsize=(6, 2.8))
        ax.barh([r["way"] for r in rows][::-1], [r["x of link"] for r in rows][::-1])
        ax.set_xlabel("bytes sent / what the link carries in that time")
        ax.set_title(caption, fontsize=8)
        print("wrote", write_json(args.out_dir / "gloo_allgather.json", rows, ranks=n,
                                  link_rate=rate, args=vars(args)),
              save_png(fig, args.out_dir / "gloo_allgather.png"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
