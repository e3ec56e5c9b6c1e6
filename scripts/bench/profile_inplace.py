"""Where the time of one in-place allgather allreduce goes, stage by stage, on 4 ranks.

    .venv/bin/horovodrun -np 4 -H localhost:4 --gloo \
        .venv/bin/python scripts/bench/profile_inplace.py

26,214,400 float32, whole 256-blocks non-zero at random per rank at --density (default 1%).
Each rep restores the input (untimed), then times the stages of ``hvd_sparse.allreduce_(t,
scheme="allgather")`` by calling the same ``_C`` kernels and Horovod collective directly:
block mask, encode, allgather, decode. Also timed in the same reps: the public call itself,
the allgather alone (ranks aligned by a barrier, so no waiting on a slower rank's mask) and
Horovod's COO path on a prebuilt COO tensor. Prints the median of --reps per rank (ms).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import horovod.torch as hvd
import torch

import hvd_sparse
from hvd_sparse import _C, blocks


def barrier() -> None:
    hvd.allreduce(torch.zeros(1), name="prof.barrier", op=hvd.Sum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, as bench_sync does
    hvd_sparse.init(probe="off")
    numel, bs, n = 26_214_400, 256, hvd.size()
    nb = numel // bs
    g = torch.Generator().manual_seed(hvd.rank())
    k = max(1, round(args.density * nb))
    t = torch.zeros(nb, bs)
    t[torch.randperm(nb, generator=g)[:k]] = torch.randn(k, bs, generator=g)
    t = t.view(-1)
    w, coo = t.clone(), t.to_sparse()
    meta, code = 7, blocks.DTYPE_CODES[t.dtype]
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    for _ in range(args.reps + 1):  # the first rep warms up and is dropped below
        w.copy_(t)
        barrier()
        mask = timed("mask (+ clear -0)", lambda: _C.block_mask(w, bs, True))
        seg = timed("encode", lambda mask=mask: _C.encode(w, bs, meta, mask))
        got = timed("allgather", lambda seg=seg: hvd.allgather(seg, name="prof.ag"))
        timed("decode", lambda got=got: _C.decode_sum(got, w, bs, meta, code, numel, n, False))
        w.copy_(t)
        barrier()
        timed("hvd_sparse.allreduce_", lambda: hvd_sparse.allreduce_(
            w, name="prof.api", op=hvd.Sum, scheme="allgather"))
        barrier()
        timed("allgather alone", lambda seg=seg: hvd.allgather(seg, name="prof.ag2"))
        barrier()
        timed("hvd COO sparse_allreduce", lambda: hvd.sparse_allreduce_async(
            coo, name="prof.coo", op=hvd.Sum)())
    med = {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}
    every = hvd.allgather_object(med, name="prof.result")
    if hvd.rank() == 0:
        print(f"ms per rank, median of {args.reps}, density {args.density:g}")
        for key in med:
            print(f"{key:26s}" + "".join(f"{r[key]:9.2f}" for r in every))
    hvd_sparse.shutdown()


if __name__ == "__main__":
    main()
