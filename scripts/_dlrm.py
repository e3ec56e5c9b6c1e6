"""The DLRM-like model and batches that the embedding benchmarks share (bench_embedding.py
under Horovod, bench_ddp.py under DDP, bench_torchrec.py): several ``nn.EmbeddingBag``
tables, a bottom MLP on dense features and a top MLP; ids uniform or Zipf-distributed (a few
hot rows shared by the ranks, a long tail)."""
from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

DENSE_FEATURES = 13
ROWS = (100_000, 150_000, 200_000, 250_000, 300_000, 350_000, 400_000, 500_000)

Batch = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]  # ids per table, dense, label


class RecModel(nn.Module):
    """``sparse=True``: the tables' gradients are sparse COO tensors (one row per lookup)."""

    def __init__(self, rows: list[int], dim: int, sparse: bool = True) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=sparse)
                                    for n in rows)
        self.bottom = nn.Sequential(nn.Linear(DENSE_FEATURES, 128), nn.ReLU(),
                                    nn.Linear(128, dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(dim * (len(rows) + 1), 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, ids: list[torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        feats = [t(i) for t, i in zip(self.tables, ids, strict=True)] + [self.bottom(dense)]
        return self.top(torch.cat(feats, 1)).squeeze(1)

    def set_sparse(self, sparse: bool) -> RecModel:
        """The same tables with dense or sparse gradients (EmbeddingBag reads it per call)."""
        for t in self.tables:
            t.sparse = sparse
        return self


def batches(rank: int, rows: list[int], count: int, batch: int, bag: int,
            zipf: float) -> list[Batch]:
    """Rank ``rank``'s batches: ``bag`` ids per example and table, Zipf with exponent ``zipf``
    (rank k of the law folded into the table, so low ids are hot on every rank) or uniform
    with ``zipf=0``; standard normal features; random labels."""
    rng = np.random.default_rng(1000 + rank)
    out = []
    for _ in range(count):
        ids = []
        for n in rows:
            if zipf > 0:
                raw = rng.zipf(1 + zipf, size=(batch, bag)) - 1
                ids.append(torch.from_numpy(raw % n))
            else:
                ids.append(torch.from_numpy(rng.integers(0, n, size=(batch, bag))))
        dense = torch.from_numpy(rng.standard_normal((batch, DENSE_FEATURES), dtype=np.float32))
        out.append((ids, dense, torch.from_numpy(rng.integers(0, 2, batch)).float()))
    return out


def add_args(p: argparse.ArgumentParser, scale: float) -> None:
    """The tables' and batches' options (bench_ddp.py, bench_torchrec.py); ``scale``: the
    default of --scale."""
    p.add_argument("--rows", default=",".join(map(str, ROWS)),
                   help="rows of each table, before --scale")
    p.add_argument("--scale", type=float, default=scale,
                   help="tables' rows times this (1: 576 MB of tables; dense methods hold "
                        "several copies per rank)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048, help="per rank")
    p.add_argument("--bag", type=int, default=4, help="ids per bag")
    p.add_argument("--ids", choices=("uniform", "hot"), default="uniform",
                   help="uniform ids, or Zipf ids (hot rows shared by the ranks)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent with --ids hot")


def workload(args: argparse.Namespace, rank: int) -> tuple[list[int], list[Batch]]:
    """The tables' rows and rank ``rank``'s --warmup + --steps batches, as ``add_args``'s
    options say."""
    rows = [max(8, int(int(r) * args.scale)) for r in args.rows.split(",")]
    zipf = args.zipf if args.ids == "hot" else 0.0
    return rows, batches(rank, rows, args.warmup + args.steps, args.batch, args.bag, zipf)
