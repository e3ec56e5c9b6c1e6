"""One job for any cluster of emulated hosts (the compose cluster, the netns testbed): under a
launcher (horovodrun or mpirun, one rank per host), every rank reduces tensors of whole
256-blocks at random (a different pattern per rank) with Horovod's allreduce and with each
hvd_sparse scheme, checks every result against Horovod's allreduce of the same tensors in
float64, and times each path. Rank 0 prints one line ``cluster_job: {json}`` and exits non-zero
when a result is wrong.

    horovodrun -np 4 -H w0:1,w1:1,w2:1,w3:1 --gloo python scripts/testbed/cluster_job.py
    hvd-sparse testbed run -- python scripts/testbed/cluster_job.py

Bytes are what this host's link (eth0, as on both clusters) carried, sent plus received, per
rank and call, averaged over ranks; times are medians over ranks' per-call wall times.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_sparse

# float32 results against the float64 reference: sums of 4 ranks' values in either order
RTOL, ATOL = 1e-5, 1e-6
PATHS = ("horovod", "dense", "allgather", "omnireduce")
LINK = Path("/sys/class/net/eth0/statistics")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 21, help="floats per tensor")
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.1])
    p.add_argument("--reps", type=int, default=5, help="timed calls per path and density")
    return p.parse_args()


def data(seed: int, numel: int, density: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
    keep = torch.rand(numel // 256, generator=g) < density
    return (torch.randn(numel // 256, 256, generator=g) * keep[:, None]).reshape(-1)


def link_bytes() -> int:
    try:
        return sum(int((LINK / f).read_text()) for f in ("tx_bytes", "rx_bytes"))
    except OSError:  # no eth0 (loopback runs): bytes not measured
        return 0


def reduce(path: str, t: torch.Tensor, name: str) -> torch.Tensor:
    if path == "horovod":
        return hvd.allreduce(t, name=name, op=hvd.Sum)
    return hvd_sparse.allreduce(t, name=name, op=hvd.Sum, scheme=path)


def main() -> int:
    args = parse_args()
    hvd.init()
    hvd_sparse.init()
    rows, bad = [], []
    for d_i, density in enumerate(args.densities):
        for p_i, path in enumerate(PATHS):
            seed = 100 * d_i + p_i
            t = data(seed, args.numel, density)
            ref = hvd.allreduce(t.double(), name=f"ref.{seed}", op=hvd.Sum)
            # one name per tensor, as a training loop has: the check call warms the path up
            out = reduce(path, t, f"t.{seed}")
            scale = max(1.0, float(ref.abs().max()))
            if not torch.allclose(out.double(), ref, rtol=RTOL, atol=ATOL * scale):
                err = float((out.double() - ref).abs().max())
                bad.append(f"{path} at density {density}: max abs error {err:g}")
            times = []
            b0 = link_bytes()
            for r in range(args.reps):
                hvd.allreduce(torch.zeros(1), name=f"sync.{seed}.{r}")  # start together
                t0 = time.perf_counter()
                reduce(path, t, f"t.{seed}")
                times.append((time.perf_counter() - t0) * 1e3)
            per_call = (link_bytes() - b0) / args.reps  # includes the 4-byte sync, negligible
            ms = hvd.allgather_object(statistics.median(times))
            nbytes = hvd.allgather_object(per_call)
            rows.append({"path": path, "density": density, "ms": statistics.median(ms),
                         "bytes": statistics.mean(nbytes)})
    bad = sorted({b for rank_bad in hvd.allgather_object(bad) for b in rank_bad})
    if hvd.rank() == 0:
        print("cluster_job: " + json.dumps({"ranks": hvd.size(), "numel": args.numel,
                                            "reps": args.reps, "rows": rows, "bad": bad}),
              flush=True)
    hvd_sparse.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
