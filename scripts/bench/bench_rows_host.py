"""The rows path's host work on one rank, against DDP's own sparse path's, per id law.

    .venv/bin/python scripts/bench/bench_rows_host.py [--ids gaussian,zipf,uniform] [--reps 7]

One process, one thread, no collective: the DLRM-like tables of bench_ddp.py
(hvd_sparse/tools/lab/dlrm.py, --scale 0.25, bags of 1-10 ids) give 4 ranks' gradients of one
step. For each table, rank 0's work is timed stage by stage, the other ranks' parts made
beforehand (untimed) by the same code, so what remains is host work with no wire:

- ours, send: what ``schemes/rows.py`` does before the allgather (runs or summed rows)
- ours, receive: the gathered runs undone and the rows summed (``gathered_uses``, ``sum_rows``)
- DDP, send / receive: what Gloo's sparse allreduce does around its allgathers (``coalesce``
  of the rank's gradient; ``coalesce`` of every rank's coalesced rows)

Times are per step (the 8 tables), median of --reps. Table to stdout, JSON and PNG to
--out-dir.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from hvd_sparse import _C
from hvd_sparse.schemes import rows
from hvd_sparse.tools.lab.dlrm import DISTRIBUTIONS, RecModel, add_args, workload
from hvd_sparse.tools.lab.report import plt, print_table, save_png, write_json

RANKS = 4
HEADER = -12345  # any negative: the allgather's header row


def gradients(args: argparse.Namespace) -> list[list[torch.Tensor]]:
    """Each rank's table gradients of its first batch (the same model on every rank)."""
    out = []
    for r in range(RANKS):
        sizes, data = workload(args, r)
        torch.manual_seed(0)
        model = RecModel(sizes, args.dim, sparse=True)
        ids, dense, label = data[0]
        torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label).backward()
        out.append([t.weight.grad for t in model.tables])
    return out


def timed(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def law(args: argparse.Namespace, ids: str) -> dict[str, object]:
    args.ids = ids
    grads = gradients(args)
    res = {"ids": ids, "ours send_ms": 0.0, "ours receive_ms": 0.0, "ddp send_ms": 0.0,
           "ddp receive_ms": 0.0}
    stats = SimpleNamespace(stats=SimpleNamespace(rows_local=0))
    for j in range(len(grads[0])):
        g, nrows = grads[0][j], grads[0][j].shape[0]
        res["ours send_ms"] += timed(lambda g=g, n=nrows: rows._sent(stats, g, n), args.reps)
        parts = [rows._sent(stats, grads[r][j], nrows) for r in range(RANKS)]
        all_rows = torch.cat([t for p in parts for t in (torch.tensor([HEADER]), p[0])])
        all_runs = torch.cat([p[1] for p in parts])
        all_vals = torch.cat([p[2] for p in parts])

        def receive(all_rows=all_rows, all_runs=all_runs, all_vals=all_vals, n=nrows):
            uses = _C.gathered_uses(all_rows, HEADER, all_runs, all_vals.shape[0], RANKS)
            return _C.sum_rows(all_rows, all_vals, n, 1 / RANKS, uses)

        res["ours receive_ms"] += timed(receive, args.reps)
        res["ddp send_ms"] += timed(g.coalesce, args.reps)
        own = [grads[r][j].coalesce() for r in range(RANKS)]
        cat = torch.sparse_coo_tensor(torch.cat([c._indices() for c in own], 1),
                                      torch.cat([c._values() for c in own]), g.shape)
        res["ddp receive_ms"] += timed(cat.coalesce, args.reps)
    res["ours_ms"] = res["ours send_ms"] + res["ours receive_ms"]
    res["ddp_ms"] = res["ddp send_ms"] + res["ddp receive_ms"]
    print(f"  {ids}: ours {res['ours_ms']:.1f} ms, DDP {res['ddp_ms']:.1f} ms", file=sys.stderr)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p, scale=0.25)
    p.set_defaults(bag_max=10)
    p.add_argument("--laws", default=",".join(DISTRIBUTIONS), help="id laws to run")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out-dir", type=Path, default=Path("bench_results/rows_host"))
    args = p.parse_args()
    args.warmup, args.steps = 1, 0
    torch.set_num_threads(1)
    _C.set_threads(1)
    results = [law(args, ids) for ids in args.laws.split(",")]
    caption = (f"one rank's host work per step, 8 tables (--scale {args.scale}), batch "
               f"{args.batch} x 1-{args.bag_max} ids, {RANKS} ranks' parts; median of "
               f"{args.reps}, one thread")
    print_table(results, "Rows path host work", caption=caption)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [r["ids"] for r in results]
    at = range(len(names))
    ax.bar([i - 0.2 for i in at], [r["ddp_ms"] for r in results], 0.4, label="DDP's sparse path")
    ax.bar([i + 0.2 for i in at], [r["ours_ms"] for r in results], 0.4, label="ours (rows)")
    ax.set_xticks(list(at), names)
    ax.set_ylabel("ms per step")
    ax.set_title(caption, fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    print("wrote", write_json(args.out_dir / "rows_host.json", results, args=vars(args)),
          save_png(fig, args.out_dir / "rows_host.png"))


if __name__ == "__main__":
    main()
