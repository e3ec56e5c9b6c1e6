"""Embedding-heavy training step: Horovod dense, Horovod's sparse path, and ours, side by side.

A recommendation model: 8 ``nn.EmbeddingBag(sparse=True)`` tables (100k-500k rows x 64), a
bottom MLP on 13 dense features and a top MLP, batch 2048 per rank, SGD. Every method trains
the same model from the same start on the same batches, one after another in one run:

- hvd dense: ``hvd.DistributedOptimizer(sparse_as_dense=True)`` (every table allreduced dense)
- hvd sparse: ``hvd.DistributedOptimizer`` (Horovod's sparse path: COO allgather, uncoalesced)
- ours compression: ``hvd.DistributedOptimizer(sparse_as_dense=True,
  compression=hvd_sparse.Compression.sparse("auto"))`` (blocks of the densified gradient)
- ours rows: ``hvd_sparse.DistributedOptimizer`` (coalesced rows, csrc/rows.cpp)

Per method: median step time (forward + backward + reduction + update), split into forward +
backward (reductions start from its hooks), sync (what ``optimizer.synchronize()`` still waits
for after backward) and the optimizer's update, each the slowest rank's; bytes each rank
sent for the tables; and how far the final tables' hot rows are from hvd dense's (they must
agree to float rounding). Ids by ``--ids`` (hvd_sparse/tools/lab/dlrm.py): Zipf by default (a
few hot rows, a long tail), uniform, or Gaussian around each table's middle. Table, JSON and PNG
go to --out-dir.

    .venv/bin/horovodrun -np 4 -H localhost:4 --gloo \
        .venv/bin/python scripts/bench/bench_embedding.py
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import hvd_sparse
from hvd_sparse.tools.lab.dlrm import DISTRIBUTIONS, ROWS, RecModel, batches
from hvd_sparse.tools.lab.report import print_table, save_png, write_json

METHODS = ("hvd dense", "hvd sparse", "ours compression", "ours rows")
HOT = 2000  # rows of each table compared across methods


def hot(n: int, dist: str) -> slice:
    """The HOT rows of an ``n``-row table that every rank touches most under ``dist``."""
    if dist == "gaussian":
        return slice(max(0, n // 2 - HOT // 2), n // 2 - HOT // 2 + HOT)
    return slice(0, HOT)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(map(str, ROWS)),
                   help="rows of each table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048, help="per rank")
    p.add_argument("--bag", type=int, default=4, help="ids per bag")
    p.add_argument("--ids", choices=DISTRIBUTIONS, default="zipf",
                   help="the ids' law (hvd_sparse/tools/lab/dlrm.py): uniform, zipf, gaussian")
    p.add_argument("--zipf", type=float, default=1.05,
                   help="Zipf exponent with --ids zipf; 0: uniform (as --ids uniform)")
    p.add_argument("--spread", type=float, default=2000.0,
                   help="standard deviation in rows with --ids gaussian")
    p.add_argument("--bag-max", type=int, default=0,
                   help="bags of 1 to this many ids, drawn per bag (0: --bag each)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out-dir", default="bench_results/embedding")
    return p.parse_args()


def optimizer(method: str, model: nn.Module) -> torch.optim.Optimizer:
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    named = model.named_parameters()
    if method == "hvd dense":
        return hvd.DistributedOptimizer(base, named_parameters=named, sparse_as_dense=True)
    if method == "hvd sparse":
        return hvd.DistributedOptimizer(base, named_parameters=named)
    if method == "ours compression":
        return hvd.DistributedOptimizer(base, named_parameters=named, sparse_as_dense=True,
                                        compression=hvd_sparse.Compression.sparse("auto"))
    return hvd_sparse.DistributedOptimizer(base, named_parameters=named)


def slowest(x: float) -> float:
    return float(hvd.allreduce(torch.tensor([x]), name="bench.max", op=hvd.Max))


def run(method: str, model: nn.Module, data: list, warmup: int) -> dict[str, object]:
    opt = optimizer(method, model)
    loss_fn = nn.BCEWithLogitsLoss()
    steps, syncs, backs, updates = [], [], [], []
    hvd_sparse.reset_metrics()
    for i, (ids, dense, y) in enumerate(data):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(ids, dense), y).backward()
        t1 = time.perf_counter()
        lookups = sum(t.weight.grad._nnz() for t in model.tables)  # rows Horovod's path ships
        opt.synchronize()
        t2 = time.perf_counter()
        with opt.skip_synchronize():
            opt.step()
        t3 = time.perf_counter()
        if i >= warmup:
            steps.append(slowest(t3 - t0))
            syncs.append(slowest(t2 - t1))
            backs.append(slowest(t1 - t0))
            updates.append(slowest(t3 - t2))
    # Bytes this rank sent for the tables in the last step, ring model (as hvd_sparse.metrics).
    n, row_bytes = hvd.size(), model.tables[0].weight.shape[1] * 4
    if method == "hvd dense":
        sent = 2 * (n - 1) / n * sum(t.weight.numel() * 4 for t in model.tables)
    elif method == "hvd sparse":  # allgather of every lookup's row and its int64 index
        gathered = float(hvd.allreduce(torch.tensor([float(lookups)]), op=hvd.Sum,
                                       name="bench.lookups"))
        sent = (n - 1) / n * gathered * (row_bytes + 8)
    else:  # hvd_sparse's own record of each table's last reduction
        sent = sum(v.get("bytes_sent", 0) for k, v in hvd_sparse.metrics().items()
                   if k.startswith(("tables.", "grad.tables.")))
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"step_ms": ms(steps), "forward+backward_ms": ms(backs), "sync_ms": ms(syncs),
            "update_ms": ms(updates),
            "tables MB sent/step": sent / 1e6}


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    hvd_sparse.init()
    rows = [int(r) for r in args.rows.split(",")]
    methods = args.methods.split(",")
    torch.manual_seed(0)
    start = RecModel(rows, args.dim)
    dist = "uniform" if args.ids == "zipf" and args.zipf == 0 else args.ids
    data = batches(hvd.rank(), rows, args.warmup + args.steps, args.batch, args.bag, dist,
                   args.zipf, args.spread, args.bag_max)
    results, finals = [], {}
    for k, method in enumerate(methods):
        if hvd.rank() == 0:
            print(f"[{k + 1}/{len(methods)}] {method} ...", flush=True)
        model = copy.deepcopy(start)
        res = run(method, model, data, args.warmup)
        # The hot rows (touched by every rank: Zipf's low ids, Gaussian's middle): whole
        # copies would not fit.
        finals[method] = torch.cat([t.weight.detach()[hot(t.num_embeddings, dist)].reshape(-1)
                                    for t in model.tables])
        results.append({"method": method, **res})
        del model
    ref = finals.get("hvd dense")
    best_hvd = min((r["step_ms"] for r in results if r["method"].startswith("hvd")), default=None)
    hvd_sparse_ms = next((r["step_ms"] for r in results if r["method"] == "hvd sparse"), None)
    for r in results:
        r["max |Δ hot rows| vs hvd dense"] = (float((finals[r["method"]] - ref).abs().max())
                                            if ref is not None else float("nan"))
        r["speedup vs hvd sparse"] = hvd_sparse_ms / r["step_ms"] if hvd_sparse_ms else float("nan")
        r["speedup vs best hvd"] = best_hvd / r["step_ms"] if best_hvd else float("nan")
    if hvd.rank() != 0:
        return
    out = Path(args.out_dir)
    caption = (f"{hvd.size()} ranks, {len(rows)} tables ({min(rows):,}-{max(rows):,} rows x "
               f"{args.dim}), batch {args.batch}/rank x {args.bag} ids, zipf {args.zipf}; "
               f"median of {args.steps} steps, slowest rank")
    print_table(results, "Embedding-heavy training step", caption=caption)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["method"] for r in results]
    ax.barh(names, [r["step_ms"] for r in results], label="step")
    ax.barh(names, [r["sync_ms"] for r in results], label="sync (after backward)")
    ax.set_xlabel("ms (median, slowest rank)")
    ax.set_title(caption, fontsize=7)
    ax.legend()
    stem = f"embedding-{args.ids}"  # one file per id law: runs of the three sit side by side
    print("wrote", write_json(out / f"{stem}.json", results, args=vars(args)),
          save_png(fig, out / f"{stem}.png"))


if __name__ == "__main__":
    main()
