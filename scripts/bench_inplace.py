"""Out-of-place vs in-place hvd_sparse.allreduce on 4 ranks: the cost of a fresh output buffer.

    .venv/bin/horovodrun -np 4 -H localhost:4 --gloo .venv/bin/python scripts/bench_inplace.py

26,214,400 float32, whole 256-blocks non-zero at random per rank at 1%; median of 5 of the
slowest rank's time. In-place calls restore their input first (timed, so they pay a copy).
Writes bench_results/inplace.json.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvd_sparse  # noqa: E402


def main() -> None:
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    hvd_sparse.init(probe="off")
    numel, bs, density = 26_214_400, 256, 0.01
    g = torch.Generator().manual_seed(hvd.rank())
    nb = numel // bs
    t = torch.zeros(nb, bs)
    t[torch.randperm(nb, generator=g)[: int(density * nb)]] = 1.0
    t = t.view(-1)
    work = t.clone()
    rows = []
    for scheme in ("allgather", "zen", "dense"):
        fns = {
            "out-of-place": lambda s=scheme: hvd_sparse.allreduce(t, name=f"o.{s}", op=hvd.Sum,
                                                                  scheme=s),
            "in-place (incl. restore copy)": lambda s=scheme: hvd_sparse.allreduce_(
                work.copy_(t), name=f"i.{s}", op=hvd.Sum, scheme=s),
        }
        for label, fn in fns.items():
            times = []
            for rep in range(6):
                hvd.allreduce(torch.zeros(1), name="sync", op=hvd.Sum)
                t0 = time.perf_counter()
                fn()
                dt = hvd.allreduce(torch.tensor([time.perf_counter() - t0]), name="max",
                                   op=hvd.Max).item()
                if rep:
                    times.append(dt)
            rows.append({"scheme": scheme, "variant": label,
                         "ms": round(statistics.median(times) * 1e3, 1)})
    if hvd.rank() == 0:
        for r in rows:
            print(f"{r['scheme']:10s} {r['variant']:32s} {r['ms']:8.1f} ms")
        out = Path("bench_results")
        out.mkdir(exist_ok=True)
        (out / "inplace.json").write_text(json.dumps({"command": sys.argv, "rows": rows}))


if __name__ == "__main__":
    main()
