"""Throughput of the hvd_sparse block codec against a plain copy and a pure-torch codec.

    .venv/bin/python scripts/bench/bench_codec.py          # sizes 1M,10M,100M (M = 2**20 elements)
    .venv/bin/python scripts/bench/bench_codec.py --quick  # sizes 1M,4M, fewer repetitions

For each float32 tensor size and block density (whole blocks of --block-size elements made
non-zero at random) it times, median of --reps after a warm-up:

* ours pack:    ``blocks.pack(t, B)`` with mask=None, i.e. bitmap + pack in one call;
* torch pack:   ``hvd_sparse.device.torch_pack``: view as [nblocks, B], ``(x != 0).any(1)``,
                ``nonzero``, ``index_select`` (what a device without our kernels runs);
* copy:         ``buf.copy_(t)`` into a preallocated buffer (no allocation in the timed region);
* ours unpack:  ``blocks.unpack(out, idx, vals, B)`` into a preallocated buffer;
* torch unpack: ``hvd_sparse.device.torch_unpack``: ``index_add_`` on the whole blocks.

Unpack timings exclude zero-filling the output (a real caller reuses its buffer), which is
why sparse unpacks can beat the copy bandwidth by far.

Every GB/s figure divides the *input tensor's* bytes (numel * 4) by the time, so the columns
compare directly. A copy reads and writes each byte, so its memory traffic is twice that: the
``copy r+w GB/s`` column shows it. Reps interleave the five operations (order rotated each rep)
so that load from other processes falls on all of them alike. Results are checked against the
torch codec (and on edge cases: ragged tail, NaN/Inf, empty) before any timing. Writes
<out-dir>/codec.json and <out-dir>/codec.png.

``--device cuda`` times the same on a GPU: ours is ``hvd_sparse.device`` (the CUDA kernels),
copy is a device-to-device copy, and two more columns time the path a GPU gradient takes to
the host and back: ``staged`` (``staging.to_host`` then ``staging.to_device``: packed blocks
cross the bus) against ``d2h`` (the dense tensor copied to pinned host memory).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hvd_sparse import blocks, device, staging
from hvd_sparse.device import torch_blocks, torch_pack, torch_unpack
from hvd_sparse.tools.lab.inputs import make_tensor
from hvd_sparse.tools.lab.report import console, print_table, save_png, write_json

ROOT = Path(__file__).resolve().parents[2]

MI = 2**20
TARGET_DENSITY = 0.01
TARGET_VS_COPY = 0.5
TARGET_VS_TORCH = 5.0


def parse_size(s: str) -> int:
    """'4M' -> 4 * 2**20 (binary, so sizes are whole blocks like the 25M tensor in bench_sync)."""
    s = s.strip().upper()
    mult = {"K": 2**10, "M": MI, "G": 2**30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


def size_label(n: int) -> str:
    return f"{n // MI}M" if n % MI == 0 else f"{n:,}"


def torch_mask(t: torch.Tensor, block: int) -> torch.Tensor:
    return (torch_blocks(t, block) != 0).any(1)


def check_codec(t: torch.Tensor, block: int) -> None:
    """Ours must agree exactly with the torch codec: mask, indices, values, round trip."""
    mask = blocks.block_mask(t, block)
    ref_mask = torch_mask(t, block)
    assert mask.dtype == torch.uint8, mask.dtype
    assert torch.equal(mask.bool(), ref_mask), "block_mask differs from torch"
    ref_idx, ref_vals = torch_pack(t, block)
    for m in (None, mask):
        idx, vals = blocks.pack(t, block, mask=m)
        what = "pack(mask=None)" if m is None else "pack(mask=block_mask(...))"
        assert idx.dtype == torch.int32, f"{what}: idx dtype {idx.dtype}"
        assert torch.equal(idx, ref_idx), f"{what}: indices differ from torch"
        assert vals.dtype == t.dtype and vals.shape == ref_vals.shape, f"{what}: {vals.shape}"
        # NaN != NaN, so compare with equal_nan semantics.
        assert torch.allclose(vals, ref_vals, rtol=0, atol=0, equal_nan=True), f"{what}: values"
    out = torch.zeros_like(t)
    blocks.unpack(out, idx, vals, block)
    assert torch.allclose(out, t, rtol=0, atol=0, equal_nan=True), "unpack(pack(t)) != t"
    blocks.unpack(out, idx, vals, block)  # unpack adds: a second pass doubles
    assert torch.allclose(out, 2 * t, rtol=0, atol=0, equal_nan=True), "unpack does not add"


def check_edge_cases(block: int) -> None:
    """Shapes the timed sizes do not reach: ragged tail, empty, NaN/Inf, non-1-D."""
    gen = torch.Generator().manual_seed(1)
    check_codec(torch.zeros(block * 3 + 7), block)  # no non-zero block at all
    t = make_tensor(block * 5 + 3, block, 0.5, gen)
    t[-1] = 1.5  # non-zero only inside the zero-padded tail block
    check_codec(t, block)
    t = torch.zeros(block * 4)
    t[block + 3], t[3 * block] = float("nan"), float("inf")
    check_codec(t, block)
    check_codec(make_tensor(block * 6, block, 0.5, gen).view(3, 2, block), block)
    check_codec(torch.ones(block - 1), block)  # a single, partial block


def check_device_codec(t: torch.Tensor, block: int) -> None:
    """On a GPU: hvd_sparse.device must agree exactly with the CPU codec."""
    idx, vals = device.pack(t, block)
    ref_idx, ref_vals = blocks.pack(t.cpu(), block)
    assert torch.equal(idx.cpu(), ref_idx), "device.pack: indices differ from the CPU codec"
    assert torch.allclose(vals.cpu(), ref_vals, rtol=0, atol=0, equal_nan=True), "values"
    out = torch.zeros_like(t)
    device.unpack(out, idx, vals, block)
    assert torch.allclose(out, t, rtol=0, atol=0, equal_nan=True), "unpack(pack(t)) != t"


def median_times(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 1,
                 sync: Callable[[], object] = lambda: None) -> dict[str, float]:
    """Median seconds per function. Reps interleave the functions (order rotated each rep) so
    that load from other processes on a shared machine falls on all of them alike. ``sync``
    waits for a GPU's queued work before and after each timed call."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(warmup + reps):
        r = i % len(names)
        for k in names[r:] + names[:r]:
            sync()
            t0 = time.perf_counter()
            fns[k]()
            sync()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_one(numel: int, density: float, block: int, reps: int, seed: int,
              dev: torch.device) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t = make_tensor(numel, block, density, gen).to(dev)
    cuda = dev.type == "cuda"
    (check_device_codec if cuda else check_codec)(t, block)
    ours = device if cuda else blocks
    gb = t.numel() * t.element_size() / 1e9

    # Preallocated outputs, packed inputs for the unpacks: only the operation itself is timed.
    buf = torch.empty_like(t)
    idx, vals = ours.pack(t, block)
    out = torch.zeros_like(t)
    tidx, tvals = torch_pack(t, block)
    out2 = torch.zeros_like(t)
    fns = {
        "copy": lambda: buf.copy_(t),
        "ours pack": lambda: ours.pack(t, block),
        "torch pack": lambda: torch_pack(t, block),
        "ours unpack": lambda: ours.unpack(out, idx, vals, block),
        "torch unpack": lambda: torch_unpack(out2, tidx, tvals, block),
    }
    if cuda:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        back = torch.empty_like(t)
        fns["staged"] = lambda: staging.to_device(staging.to_host(t, block), back, block)
        fns["d2h"] = lambda: host.copy_(t, non_blocking=True)
    s = median_times(fns, reps, sync=torch.cuda.synchronize if cuda else lambda: None)
    extra = {"staged ms": 1e3 * s["staged"], "d2h ms": 1e3 * s["d2h"],
             "d2h/staged": s["d2h"] / s["staged"]} if cuda else {}

    return extra | {
        "size": size_label(numel),
        "numel": numel,
        "density": density,
        "ours pack GB/s": gb / s["ours pack"],
        "torch pack GB/s": gb / s["torch pack"],
        "copy GB/s": gb / s["copy"],
        "copy r+w GB/s": 2 * gb / s["copy"],
        "pack/copy": s["copy"] / s["ours pack"],
        "ours/torch": s["torch pack"] / s["ours pack"],
        "ours unpack GB/s": gb / s["ours unpack"],
        "torch unpack GB/s": gb / s["torch unpack"],
        "unpack ours/torch": s["torch unpack"] / s["ours unpack"],
    }


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    axes = fig.subplots(1, 2)
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    colors = {s: f"C{i}" for i, s in enumerate(sizes)}
    panels = [("pack (bitmap + pack)", [("ours pack GB/s", "-", "o", "ours"),
                                       ("torch pack GB/s", "--", "s", "torch"),
                                       ("copy GB/s", ":", "", "copy")]),
              ("unpack (scatter-add)", [("ours unpack GB/s", "-", "o", "ours"),
                                        ("torch unpack GB/s", "--", "s", "torch"),
                                        ("copy GB/s", ":", "", "copy")])]
    for ax, (title, series) in zip(axes, panels, strict=True):
        for size in sizes:
            rs = [r for r in rows if r["size"] == size]
            x = [r["density"] for r in rs]
            for key, ls, marker, label in series:
                ax.plot(x, [r[key] for r in rs], ls=ls, marker=marker, color=colors[size],
                        label=f"{label} {size}")
        ax.set(xscale="log", yscale="log", xlabel="block density",
               ylabel="GB/s of input tensor", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=len(sizes))
    save_png(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", help="comma list, K/M/G are powers of 2; default 1M,10M,100M "
                    "(--quick: 1M,4M)")
    ap.add_argument("--densities", default="0.001,0.01,0.1,1.0")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--reps", type=int, help="default 9 (--quick: 5)")
    ap.add_argument("--quick", action="store_true", help="smaller defaults, for a smoke run")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the codec on a GPU")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    args = ap.parse_args()
    # Explicit flags win over --quick.
    args.sizes = args.sizes or ("1M,4M" if args.quick else "1M,10M,100M")
    args.reps = args.reps or (5 if args.quick else 9)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    densities = [float(d) for d in args.densities.split(",")]

    dev = torch.device(args.device)
    if dev.type == "cpu":
        check_edge_cases(args.block_size)
    rows = []
    with console.status("") as status:
        for numel in sizes:
            for d in densities:
                status.update(f"size {size_label(numel)} density {d}")
                rows.append(bench_one(numel, d, args.block_size, args.reps, args.seed, dev))

    cols = ["size", "density", "ours pack GB/s", "torch pack GB/s", "copy GB/s", "pack/copy",
            "ours/torch", "ours unpack GB/s", "torch unpack GB/s", "copy r+w GB/s"]
    if dev.type == "cuda":
        cols += ["staged ms", "d2h ms", "d2h/staged"]
    print_table(rows, f"block codec on {dev}, float32, B={args.block_size}, median of "
                f"{args.reps}", cols,
                caption="GB/s = input tensor bytes / time. copy = buf.copy_(t) into a "
                "preallocated buffer; its read+write traffic is 2x ('copy r+w').")

    targets = []
    for r in (r for r in rows if r["density"] == TARGET_DENSITY):
        met = r["pack/copy"] >= TARGET_VS_COPY and r["ours/torch"] >= TARGET_VS_TORCH
        targets.append({"size": r["size"], "pack/copy": r["pack/copy"],
                        "ours/torch": r["ours/torch"], "met": met})
        console.print(
            f"target @ {TARGET_DENSITY:.0%} density, {r['size']}: pack >= {TARGET_VS_COPY}x copy "
            f"({r['pack/copy']:.2f}x) and >= {TARGET_VS_TORCH}x torch ({r['ours/torch']:.2f}x): "
            + ("[green]met[/]" if met else "[red]NOT met[/]"))
    if not targets:
        console.print(f"[yellow]no {TARGET_DENSITY} density row: targets not evaluated[/]")

    out_json = write_json(args.out_dir / "codec.json", rows, args=vars(args), targets=targets)
    plot(rows, args.out_dir / "codec.png")
    console.print(f"wrote {out_json} and {args.out_dir / 'codec.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
