"""The DLRM-like model and batches that the embedding benchmarks share (bench_embedding.py
under Horovod, bench_ddp.py under DDP, bench_torchrec.py): several ``nn.EmbeddingBag``
tables, a bottom MLP on dense features and a top MLP. Ids come from one of three laws, since
every speedup here depends on them: uniform (hardly a row shared by the ranks), Zipf (a few hot
rows shared by the ranks, a long tail) and Gaussian around each table's middle with a spread
of ``--spread`` rows (rows near the centre shared by the ranks, as facebookresearch/dlrm's own
random data generator draws them with ``--rand-data-dist gaussian``; unlike it, an id may
repeat within a bag). Bags hold ``--bag`` ids, or 1 to ``--bag-max`` (as DLRM's generator
draws them when not fixed)."""
from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

DENSE_FEATURES = 13
ROWS = (100_000, 150_000, 200_000, 250_000, 300_000, 350_000, 400_000, 500_000)

# a table's ids: [batch, bag] when every bag has ``bag`` ids, else (ids, offsets) as
# nn.EmbeddingBag takes them
Ids = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
Batch = tuple[list[Ids], torch.Tensor, torch.Tensor]  # ids per table, dense, label
DISTRIBUTIONS = ("uniform", "zipf", "gaussian")


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

    def forward(self, ids: list[Ids], dense: torch.Tensor) -> torch.Tensor:
        feats = [t(*i) if isinstance(i, tuple) else t(i)
                 for t, i in zip(self.tables, ids, strict=True)] + [self.bottom(dense)]
        return self.top(torch.cat(feats, 1)).squeeze(1)

    def set_sparse(self, sparse: bool) -> RecModel:
        """The same tables with dense or sparse gradients (EmbeddingBag reads it per call)."""
        for t in self.tables:
            t.sparse = sparse
        return self


def draw(rng: np.random.Generator, dist: str, n: int, size: int | tuple[int, ...],
         zipf: float = 1.05, spread: float = 2000.0) -> np.ndarray:
    """``size`` ids of a table of ``n`` rows by law ``dist`` (``DISTRIBUTIONS``): Zipf with
    exponent ``zipf`` folded into the table (low ids hot on every rank), or Gaussian around
    the table's middle with standard deviation ``spread`` rows, clipped to the table."""
    if dist == "zipf":
        return (rng.zipf(1 + zipf, size=size) - 1) % n
    if dist == "gaussian":
        return np.clip(np.rint(rng.normal(n / 2, spread, size=size)), 0, n - 1).astype(np.int64)
    if dist == "uniform":
        return rng.integers(0, n, size=size)
    raise ValueError(f"ids: one of {DISTRIBUTIONS}, got {dist!r}")


def batches(rank: int, rows: list[int], count: int, batch: int, bag: int,
            dist: str = "uniform", zipf: float = 1.05, spread: float = 2000.0,
            bag_max: int = 0) -> list[Batch]:
    """Rank ``rank``'s batches: ``bag`` ids per example and table (``bag_max``: 1 to bag_max,
    drawn per bag) by ``draw``'s law ``dist``; standard normal features; random labels."""
    rng = np.random.default_rng(1000 + rank)
    out = []
    for _ in range(count):
        ids: list[Ids] = []
        for n in rows:
            if bag_max:
                lengths = rng.integers(1, bag_max + 1, size=batch)
                offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
                ids.append((torch.from_numpy(draw(rng, dist, n, int(lengths.sum()), zipf,
                                                  spread)),
                            torch.from_numpy(offsets)))
            else:
                ids.append(torch.from_numpy(draw(rng, dist, n, (batch, bag), zipf, spread)))
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
    p.add_argument("--bag-max", type=int, default=0,
                   help="bags of 1 to this many ids, drawn per bag (0: --bag each)")
    p.add_argument("--ids", choices=(*DISTRIBUTIONS, "hot"), default="uniform",
                   help="the ids' law: uniform, zipf (hot rows shared by the ranks; 'hot' is "
                        "the same), gaussian (around each table's middle, --spread rows)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent with --ids zipf")
    p.add_argument("--spread", type=float, default=2000.0,
                   help="standard deviation in rows with --ids gaussian")


def bag_label(args: argparse.Namespace) -> str:
    """Ids per bag as the report says it: "4", or "1-10" with --bag-max."""
    return f"1-{args.bag_max}" if args.bag_max else str(args.bag)


def workload(args: argparse.Namespace, rank: int) -> tuple[list[int], list[Batch]]:
    """The tables' rows and rank ``rank``'s --warmup + --steps batches, as ``add_args``'s
    options say."""
    rows = [max(8, int(int(r) * args.scale)) for r in args.rows.split(",")]
    dist = "zipf" if args.ids == "hot" else args.ids
    return rows, batches(rank, rows, args.warmup + args.steps, args.batch, args.bag, dist,
                         args.zipf, args.spread, args.bag_max)
