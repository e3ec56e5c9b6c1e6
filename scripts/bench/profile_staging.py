"""Where a staged GPU gradient's round trip spends its time, step by step.

    python scripts/bench/profile_staging.py [--sizes 1M,10M,100M] [--densities 0.001,0.01,0.1]

On a CUDA device (``HVD_SPARSE_CPU_AS_DEVICE=1`` runs the same steps on CPU tensors). For each
float32 size and block density (whole 256-blocks non-zero at random) it times, median of
--reps, synchronized before and after each call:

* to_host: ``staging.to_host`` whole; split into ``to_host_no_value`` (mask, count, pack on the
  device and the copies of the packed blocks) and ``value`` (host zeros plus the scatter of the
  blocks into them), with ``zeros`` (``blocks.zeros`` alone) beside it;
* to_device: ``staging.to_device`` whole, with ``host_pack`` (``blocks.pack`` of the host
  result, which it starts with) beside it;
* d2h / h2d dense: the whole tensor copied to / from pinned host memory, what a dense path
  would move instead.

Writes <out-dir>/staging.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from hvd_sparse import blocks, device, staging
from hvd_sparse.tools.lab.report import print_table, write_json

B = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1M,10M,100M", help="M = 2**20 elements")
    ap.add_argument("--densities", default="0.001,0.01,0.1")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out-dir", default="bench_results")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not device.CPU_AS_DEVICE:
        sys.exit("no CUDA device: run on a GPU host, or with HVD_SPARSE_CPU_AS_DEVICE=1")
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def ms(fn) -> float:
        times = []
        for _ in range(args.reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def host_steps(x: torch.Tensor) -> staging.ToHost:
        st = staging.ToHost(x, B)
        while not st.poll():
            st.event.synchronize()
        return st

    def profile(numel: int, density: float) -> dict[str, float]:
        g = torch.Generator(device=dev).manual_seed(0)
        keep = torch.rand(blocks.num_blocks(numel, B), device=dev, generator=g) < density
        x = torch.randn(numel, device=dev, generator=g) * keep.repeat_interleave(B)[:numel]
        out, host = torch.empty_like(x), staging.to_host(x, B)
        pinned = torch.empty(numel, pin_memory=dev == "cuda")
        assert torch.equal(staging.to_device(host, out, B), x), "round trip changed values"
        return {"to_host ms": ms(lambda: staging.to_host(x, B)),
                "to_host_no_value ms": ms(lambda: host_steps(x)),
                "value ms": ms(host_steps(x).value),
                "zeros ms": ms(lambda: blocks.zeros(numel, torch.float32)),
                "to_device ms": ms(lambda: staging.to_device(host, out, B)),
                "host_pack ms": ms(lambda: blocks.pack(host, B)),
                "d2h dense ms": ms(lambda: pinned.copy_(x, non_blocking=True)),
                "h2d dense ms": ms(lambda: out.copy_(pinned, non_blocking=True))}

    rows = []
    for size in args.sizes.split(","):
        for density in map(float, args.densities.split(",")):
            rows.append({"size": size, "density": density,
                         **profile(int(size.rstrip("M")) << 20, density)})
            print(f"{size} {density}: done", flush=True)
    print_table(rows, f"staged round trip on {dev}, float32, B={B}, median of {args.reps}")
    print(f"wrote {write_json(Path(args.out_dir) / 'staging.json', rows, device=dev)}")


if __name__ == "__main__":
    main()
