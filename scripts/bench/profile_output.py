"""What an out-of-place result costs: allocating the dense output vs decoding the sum into it.

    .venv/bin/python scripts/bench/profile_output.py [--densities 0.01,0.1] [--reps 7]

One process, one thread. Four ranks' allgather segments of 26,214,400 float32 (whole 256-blocks
non-zero at random per rank) are decoded (``_C.decode_sum``, what allgather does after its
collective) into:

* torch.zeros: what every out-of-place call did before (a fresh 100 MiB buffer, memset: every
  page faulted in and written);
* blocks.zeros: what the schemes use now; the previous rep's output, freed, is reused after a
  memset (csrc/fresh_zeros.cpp), so this row is a cache hit;
* fresh, huge pages: a new mapping with MADV_HUGEPAGE, what blocks.zeros costs on a miss (only
  written pages fault, 2 MiB at a time);
* fresh, 4 KiB pages: the same with MADV_NOHUGEPAGE (what THP "never" gives);
* warm: a buffer already mapped (what in place pays: the decode alone).

Each row also times a full read of the result afterwards (``out.sum()``, as an optimizer
reads a gradient: untouched pages of a fresh mapping fault in as the shared zero page), and
reports minor page faults and system CPU time per call (getrusage). Methods interleaved,
median of --reps.
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import resource
import statistics
import time
from collections.abc import Callable

import torch

from hvd_sparse import _C, blocks

NUMEL, BS, RANKS = 26_214_400, 256, 4
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15


def fresh(numel: int, advice: int) -> torch.Tensor:
    """float32 zeros in a new private mapping, with the given madvise advice."""
    buf = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    libc = ctypes.CDLL(None, use_errno=True)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(numel * 4), advice)
    return torch.frombuffer(buf, dtype=torch.float32)  # keeps buf alive


def segments(density: float, gen: torch.Generator) -> torch.Tensor:
    nb = NUMEL // BS
    segs = []
    for _ in range(RANKS):
        x = torch.zeros(nb, BS)
        rows = torch.randperm(nb, generator=gen)[:max(1, round(density * nb))]
        x[rows] = torch.randn(len(rows), BS, generator=gen)
        segs.append(_C.encode(x.view(-1), BS, 1))
    return torch.cat(segs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--densities", default="0.01,0.1")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _C.set_threads(1)
    warm = torch.zeros(NUMEL)
    allocs: dict[str, Callable[[], torch.Tensor]] = {
        "torch.zeros": lambda: torch.zeros(NUMEL),
        "blocks.zeros": lambda: blocks.zeros(NUMEL, torch.float32),
        "fresh, huge pages": lambda: fresh(NUMEL, MADV_HUGEPAGE),
        "fresh, 4 KiB pages": lambda: fresh(NUMEL, MADV_NOHUGEPAGE),
        "warm (in place)": lambda: warm,
    }
    print(f"{NUMEL:,} float32, {RANKS} ranks' segments, block {BS}; median of {args.reps}")
    print(f"{'density':>8} {'output':20} {'alloc+decode ms':>16} {'faults':>8} {'sys ms':>7} "
          f"{'then read ms':>13} {'faults':>8}")
    for d in (float(x) for x in args.densities.split(",")):
        buf = segments(d, torch.Generator().manual_seed(0))
        stats: dict[str, list[tuple[float, ...]]] = {k: [] for k in allocs}
        for rep in range(args.reps + 1):  # the first rep warms up
            for name, alloc in allocs.items():
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                out = alloc()
                _C.decode_sum(buf, out, BS, 1, 0, NUMEL, RANKS, False)
                r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                out.sum()
                r2, t2 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                del out
                if rep:
                    stats[name].append((t1 - t0, r1.ru_minflt - r0.ru_minflt,
                                        r1.ru_stime - r0.ru_stime, t2 - t1,
                                        r2.ru_minflt - r1.ru_minflt))
        for name, rows in stats.items():
            ms, flt, sys_s, read, rflt = (statistics.median(c) for c in zip(*rows, strict=True))
            print(f"{d:>8g} {name:20} {ms * 1e3:>16.2f} {flt:>8.0f} {sys_s * 1e3:>7.1f} "
                  f"{read * 1e3:>13.2f} {rflt:>8.0f}")


if __name__ == "__main__":
    main()
