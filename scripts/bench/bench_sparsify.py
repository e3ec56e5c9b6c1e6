"""Selection time of the sparsifiers against ``torch.topk``.

    .venv/bin/python scripts/bench/bench_sparsify.py            # sizes 1M,10M,100M (M = 2**20)
    .venv/bin/python scripts/bench/bench_sparsify.py --quick    # sizes 1M,4M, fewer repetitions

For each float32 tensor of N(0,1) values and each density it times, median of --reps after a
warm-up, only the selection (no error feedback, no copy of the result):

* torch.topk:  ``torch.topk(x.abs(), k)`` (the magnitudes are part of selecting by magnitude);
* TopK:        exact top-k by magnitude (``_C.topk_abs``: sample, one pass, nth_element);
* Threshold:   every |x| >= t, with t the exact k-th magnitude (found outside the timing);
* DGC:         ``DGC.select``: sampled threshold, one pass, exact top-k if > 1.3 k pass;
* ExDyna n=4:  ``ExDyna.select`` of rank 0 of 4, blocks of --block-size: one rank's work in a
               4-rank job (it scores only its partition, a quarter of the tensor);
* ExDyna n=1:  the same on one rank (scores the whole tensor).

Results are checked before timing: TopK against torch.topk's set of indices (up to ties at
the k-th magnitude), Threshold's count against k. Writes <out-dir>/sparsify.json and
<out-dir>/sparsify.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_codec import median_times, parse_size, size_label

from hvd_sparse import _C, DGC, ExDyna
from hvd_sparse.tools.lab.report import console, print_table, save_png, write_json

ROOT = Path(__file__).resolve().parents[2]

TARGET_SIZE, TARGET_DENSITY, TARGET_RATIO = 100 * 2**20, 0.01, 0.25
METHODS = ["torch.topk", "TopK", "Threshold", "DGC", "ExDyna n=4", "ExDyna n=1"]


def bench_one(numel: int, density: float, block: int, reps: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    k = max(1, round(density * numel))
    ref = torch.topk(x.abs(), k)
    ours = _C.topk_abs(x, k, 1)
    kth = float(ref.values[-1])
    # Equal sets up to ties at the k-th magnitude (float32 N(0,1) values repeat at 100M).
    assert ours.numel() == k and float(x[ours].abs().min()) >= kth, "TopK is not a top-k set"
    assert torch.equal(torch.isin(ref.indices[ref.values > kth], ours).all(), torch.tensor(True))
    assert k <= _C.select_abs_ge(x, kth).numel() <= k + 16, "Threshold count differs from k"
    del ref, ours
    dgc = DGC(density, error_feedback=False, rank=0, size=1)
    # density is per rank: the union of 4 ranks at ``density``, as before
    ex4 = ExDyna(density / 4, error_feedback=False, block_size=block, rank=0, size=4)
    ex1 = ExDyna(density, error_feedback=False, block_size=block, rank=0, size=1)
    s = median_times({
        "torch.topk": lambda: torch.topk(x.abs(), k),
        "TopK": lambda: _C.topk_abs(x, k, 1),
        "Threshold": lambda: _C.select_abs_ge(x, kth),
        "DGC": lambda: dgc.select("x", x, 1),
        "ExDyna n=4": lambda: ex4.select("x", x, block),
        "ExDyna n=1": lambda: ex1.select("x", x, block),
    }, reps)
    row = {"size": size_label(numel), "numel": numel, "density": density}
    row.update({f"{m} ms": s[m] * 1e3 for m in METHODS})
    row.update({f"{m} / topk": s[m] / s["torch.topk"] for m in METHODS[1:]})
    return row


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    densities = list(dict.fromkeys(r["density"] for r in rows))
    fig = Figure(figsize=(4.5 * len(densities), 4))
    axes = fig.subplots(1, len(densities), squeeze=False)[0]
    for ax, d in zip(axes, densities, strict=True):
        rs = [r for r in rows if r["density"] == d]
        for i, m in enumerate(METHODS):
            ax.plot([r["numel"] for r in rs], [r[f"{m} ms"] for r in rs], marker="o",
                    ls="--" if m == "torch.topk" else "-", color=f"C{i}", label=m)
        ax.set(xscale="log", yscale="log", xlabel="elements", ylabel="ms (median)",
               title=f"selection at density {d:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save_png(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", help="comma list, K/M/G are powers of 2; default 1M,10M,100M "
                    "(--quick: 1M,4M)")
    ap.add_argument("--densities", default="0.001,0.01,0.1")
    ap.add_argument("--block-size", type=int, default=256, help="ExDyna's block (the codec's)")
    ap.add_argument("--reps", type=int, help="default 5 (--quick: 3)")
    ap.add_argument("--quick", action="store_true", help="smaller defaults, for a smoke run")
    ap.add_argument("--threads", type=int, default=None, help="torch and kernel threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    args = ap.parse_args()
    args.sizes = args.sizes or ("1M,4M" if args.quick else "1M,10M,100M")
    args.reps = args.reps or (3 if args.quick else 5)
    if args.threads:
        torch.set_num_threads(args.threads)
        _C.set_threads(args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    densities = [float(d) for d in args.densities.split(",")]

    rows = []
    with console.status("") as status:
        for numel in sizes:
            for d in densities:
                status.update(f"size {size_label(numel)} density {d}")
                rows.append(bench_one(numel, d, args.block_size, args.reps, args.seed))

    cols = ["size", "density", *(f"{m} ms" for m in METHODS), "ExDyna n=4 / topk",
            "TopK / topk"]
    print_table(rows, f"selection time, float32, median of {args.reps} "
                f"(torch threads {torch.get_num_threads()})", cols,
                caption=f"ExDyna blocks of {args.block_size}; n=4: one rank's partition of a "
                "4-rank job. x / topk: time relative to torch.topk(x.abs(), k).")

    targets = []
    for r in (r for r in rows if r["numel"] == TARGET_SIZE and r["density"] == TARGET_DENSITY):
        met = r["ExDyna n=4 / topk"] <= TARGET_RATIO
        targets.append({"size": r["size"], "ExDyna n=4 / topk": r["ExDyna n=4 / topk"],
                        "met": met})
        console.print(f"target @ {r['size']}/{TARGET_DENSITY:.0%}: ExDyna <= {TARGET_RATIO}x "
                      f"torch.topk ({r['ExDyna n=4 / topk']:.3f}x): "
                      + ("[green]met[/]" if met else "[red]NOT met[/]"))
    if not targets:
        console.print("[yellow]no 100M / 1% row: target not evaluated[/]")
    out_json = write_json(args.out_dir / "sparsify.json", rows, args=vars(args), targets=targets)
    plot(rows, args.out_dir / "sparsify.png")
    console.print(f"wrote {out_json} and {args.out_dir / 'sparsify.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
