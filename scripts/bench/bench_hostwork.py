"""Each scheme's host work on one rank against what memory bandwidth allows.

    .venv/bin/python scripts/bench/bench_hostwork.py [--densities 0.01,0.1] [--ranks 4] [--reps 7]

One process, one thread (codec and torch), no other rank running: a 100 MiB float32 gradient
(26,214,400 elements; whole 256-blocks non-zero at random, per rank) is reduced stage by stage
with the kernels each scheme calls, in its order, as rank 0 of --ranks. What the other ranks
would send (their segments, their partitions) is made beforehand, untimed, by the same
kernels on their own gradients, so the collectives' wire time is left out and what remains is
host work:

- allgather: block mask (the scan), encode (pack), output (fresh zeros out of place, none in
  place), decode_sum of every rank's segment (the write)
- zen: mask, zen_encode, zen_reduce of this rank's partition from every rank, output,
  decode_sum of every rank's partition sum
- omnireduce: the worker thread's whole call (scan, packets out, results in, the write) with
  one worker against one local aggregator process, as process CPU time (the aggregator's own
  is not counted); one rank only, so the aggregator returns this rank's blocks

Bound: the bytes a stage must read and write at least (the scan reads the gradient; a pack
reads and writes the non-zero blocks; a decode reads every segment and writes the result's
blocks, and out of place also writes the zeros around them) divided by this machine's memcpy
rate (``dst.copy_(src)`` of the 100 MiB gradient, bytes read plus written per second), all
measured in the same run, median of --reps, methods interleaved. Table to stdout, JSON and PNG
to --out-dir.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hvd_sparse import _C, blocks
from hvd_sparse.aggregator import LocalAggregators
from hvd_sparse.tools.lab.inputs import make_tensor
from hvd_sparse.tools.lab.report import plt, print_table, save_png, write_json

NUMEL, BS = 26_214_400, 256
F32 = blocks.DTYPE_CODES[torch.float32]


def gradient(rank: int, density: float) -> torch.Tensor:
    return make_tensor(NUMEL, BS, density, torch.Generator().manual_seed(1000 + rank))


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def allgather_stages(ts: list[torch.Tensor], meta: int, inplace: bool
                     ) -> tuple[dict[str, float], torch.Tensor]:
    """Rank 0's stages; returns seconds per stage and the result."""
    t, n = ts[0], len(ts)
    work = t.clone() if inplace else t
    others = [_C.encode(x, BS, meta, blocks.block_mask(x, BS)) for x in ts[1:]]
    s: dict[str, float] = {}
    s["scan"], mask = timed(lambda: _C.block_mask(work, BS, inplace))
    s["pack"], seg = timed(lambda: _C.encode(work, BS, meta, mask))
    gathered = torch.cat([seg, *others])  # the collective's result, untimed
    s["zeros"], out = timed(lambda: work if inplace else blocks.zeros(NUMEL, torch.float32))
    s["decode"], _ = timed(lambda: _C.decode_sum(gathered, out, BS, meta, F32, NUMEL, n))
    return s, out


def zen_stages(ts: list[torch.Tensor], meta: int, inplace: bool
               ) -> tuple[dict[str, float], torch.Tensor]:
    t, n = ts[0], len(ts)
    work = t.clone() if inplace else t
    enc = [_C.zen_encode(x, BS, n, meta, blocks.block_mask(x, BS)) for x in ts[1:]]

    def part_for(dst: int, bufs: list[tuple[torch.Tensor, list[int]]]) -> torch.Tensor:
        pieces = []
        for buf, splits in bufs:
            at = sum(splits[:dst])
            pieces.append(buf[at:at + splits[dst]])
        return torch.cat(pieces)

    s: dict[str, float] = {}
    s["scan"], mask = timed(lambda: _C.block_mask(work, BS, inplace))
    s["pack"], mine = timed(lambda: _C.zen_encode(work, BS, n, meta, mask))
    bufs = [mine, *enc]
    nnz = [int(blocks.block_mask(x, BS).sum()) for x in ts]
    recv0 = part_for(0, bufs)
    s["reduce"], part0 = timed(lambda: _C.zen_reduce(recv0, BS, meta, F32, NUMEL, n, 0, n,
                                                     nnz[0]))
    parts = [part0] + [_C.zen_reduce(part_for(r, bufs), BS, meta, F32, NUMEL, n, r, n, nnz[r])
                       for r in range(1, n)]
    gathered = torch.cat(parts)
    s["zeros"], out = timed(lambda: work if inplace else blocks.zeros(NUMEL, torch.float32))
    s["decode"], _ = timed(lambda: _C.decode_sum(gathered, out, BS, meta, F32, NUMEL, n, True))
    return s, out


def omnireduce_call(t: torch.Tensor, addr: tuple[str, int], token: int
                    ) -> tuple[dict[str, float], torch.Tensor]:
    w = _C.OmniWorker([addr], token, 0, 1, seed=1)
    try:
        w.register(15.0)
        out = blocks.zeros(NUMEL, torch.float32)
        c0, t0 = time.process_time(), time.perf_counter()
        ticket = w.submit(7, t, out, BS, 7, None, "hostwork", 1.0)
        w.wait(ticket, 60.0)
        w.finish(ticket)
        return {"call": time.process_time() - c0, "wall": time.perf_counter() - t0}, out
    finally:
        w.close()


def bound_bytes(scheme: str, d: float, u: float, n: int, inplace: bool) -> dict[str, float]:
    """Bytes each stage must read plus write at least; d: this rank's block density, u: the
    union's, n ranks (zen: each rank owns 1/n of the blocks)."""
    size = NUMEL * 4.0
    write_out = (u if inplace else 1.0) * size
    if scheme == "allgather":
        return {"scan": size, "pack": 2 * d * size, "decode": n * d * size + write_out}
    if scheme == "zen":
        return {"scan": size, "pack": 2 * d * size, "reduce": d * size + u / n * size,
                "decode": u * size + write_out}
    return {"call": size + 2 * d * size + write_out}  # omnireduce, one rank: u == d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--densities", default="0.01,0.1")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out-dir", type=Path, default=Path("bench_results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    _C.set_threads(1)
    meta = blocks.meta_hash(torch.Size([NUMEL]), torch.float32)
    src, dst = torch.randn(NUMEL), torch.empty(NUMEL)
    aggs = LocalAggregators(1, 1, "127.0.0.1")
    addr = ("127.0.0.1", aggs.ports[0])
    rows, token = [], 500
    try:
        for d in map(float, args.densities.split(",")):
            ts = [gradient(r, d) for r in range(args.ranks)]
            ref = torch.stack(ts).double().sum(0)
            u = float((torch.stack([blocks.block_mask(x, BS) for x in ts]).amax(0) > 0)
                      .float().mean())
            runs: dict[str, list[dict[str, float]]] = {}
            copies = []
            methods = ["allgather", "allgather in place", "zen", "zen in place", "omnireduce"]
            for rep in range(args.reps):
                print(f"density {d:g}: rep {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
                for k in range(len(methods)):
                    m = methods[(k + rep) % len(methods)]  # rotated: load falls on all alike
                    inplace = m.endswith("in place")
                    if m == "omnireduce":
                        token += 1
                        s, out = omnireduce_call(ts[0], addr, token)
                        want = ts[0].double()
                    else:
                        fn = allgather_stages if m.startswith("allgather") else zen_stages
                        s, out = fn(ts, meta, inplace)
                        want = ref
                    err = float((out.double() - want).abs().max())
                    assert err < 1e-4, f"{m}: off the float64 sum by {err}"
                    # Freed before the next call, as a training loop frees the step before's
                    # gradient: large buffers then come back from the cache (fresh_zeros.cpp)
                    # and the figures are a loop's steady state, not a first call's faults.
                    del out
                    runs.setdefault(m, []).append(s)
                copies.append(timed(lambda: dst.copy_(src))[0])
            rate = 2 * NUMEL * 4 / statistics.median(copies)  # bytes read + written per second
            for m in methods:
                stages = {k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]}
                scheme = m.split()[0]
                need = bound_bytes(scheme, d, d if scheme == "omnireduce" else u, args.ranks,
                                   m.endswith("in place"))
                host = sum(v for k, v in stages.items() if k != "wall")
                bound = sum(need.values()) / rate
                row = {"density": d, "method": m, "host ms": host * 1e3, "bound ms": bound * 1e3,
                       "x bound": host / bound}
                for k, v in stages.items():
                    row[f"{k} ms"] = v * 1e3
                    if k in need:
                        row[f"{k} x"] = v / (need[k] / rate)
                row["memcpy GB/s"] = rate / 1e9
                rows.append(row)
    finally:
        aggs.stop()
    cols = ["density", "method", "host ms", "bound ms", "x bound", "scan ms", "scan x",
            "pack ms", "pack x", "reduce ms", "reduce x", "zeros ms", "decode ms", "decode x",
            "call ms", "wall ms", "memcpy GB/s"]
    print_table(rows, f"Host work of one rank, {NUMEL:,} float32, {args.ranks} ranks' blocks, "
                      "one thread", cols)
    write_json(args.out_dir / "hostwork.json", rows, ranks=args.ranks, numel=NUMEL,
               block_size=BS)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{r['method']}\n{r['density']:g}" for r in rows]
    ax.bar(labels, [r["x bound"] for r in rows])
    ax.axhline(2.0, color="k", ls="--", lw=1, label="target: 2x the memory bound")
    ax.set_ylabel("host time / memory bound")
    ax.tick_params(axis="x", labelsize=6, labelrotation=30)
    ax.legend(fontsize=8)
    print("wrote", save_png(fig, args.out_dir / "hostwork.png"))


if __name__ == "__main__":
    main()
