"""Fixed-point accuracy of aggregation in the emulated switch: scheme "switch" against the
float64 sum, per dtype and density, beside Horovod's dense allreduce in the same dtype. Needs
root (a testbed: 4 worker namespaces behind the emulated switch, 1 Gbit/s, MTU 9000).

    .venv/bin/python scripts/checks/switch_accuracy.py [--numel 1048576]

Per dtype and density (of 256-blocks, a different random pattern per rank, values N(0, 1)):
max |out - ref| / max |ref| for the switch and for hvd.allreduce in the dtype (ref: float64
sum of the same inputs; Horovod's MPI operations take no bfloat16), the largest error over the
fixed-point bound of docs/PROTOCOL.md plus one rounding to the dtype (<= 1 holds the promise),
and whether every rank got the same bytes.
Writes bench_results/switch_accuracy.json and .png.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from hvd_sparse.tools.lab.report import (
    console,
    print_table,
    save_png,
    testbed_main,
    write_json,
)

ROOT = Path(__file__).resolve().parents[2]

DTYPES = ("float32", "float16", "bfloat16")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--densities", default="1.0,0.1,0.01")
    ap.add_argument("--name", default="hvacc", help="testbed name")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    ap.add_argument("--rank-side", help=argparse.SUPPRESS)
    return ap.parse_args()


def drive(args: argparse.Namespace) -> int:
    from hvd_sparse.tools.testbed import launch, lifecycle
    from hvd_sparse.tools.testbed.topology import Testbed

    console.rule("testbed: 4 workers behind the emulated switch, 1gbit, MTU 9000")
    tb = lifecycle.up(Testbed(args.name, workers=4, aggregators=0, rate="1gbit", mtu=9000,
                              switch="emu"))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            proc = launch.run(tb, [sys.executable, str(Path(__file__).resolve()), "--rank-side",
                                   str(out), "--numel", str(args.numel), "--densities",
                                   args.densities],
                              env={"HVD_SPARSE_CACHE_DIR": tmp, "OMP_NUM_THREADS": "1"},
                              timeout=1800)
            if proc.returncode != 0 or not out.exists():
                console.print(f"[red]rank job failed (exit {proc.returncode})[/]")
                return 1
            rows = json.loads(out.read_text())
    finally:
        lifecycle.down(args.name)
    print_table(rows, f"sum of {args.numel:,} values over 4 ranks: error vs float64", list(rows[0]),
                caption="rel err: max |out - ref| / max |ref|. of bound: the largest error over "
                "(fixed-point bound + one rounding to the dtype); <= 1 is the promise.")
    path = write_json(args.out_dir / "switch_accuracy.json", rows, args=vars(args))
    plot(rows, args.out_dir / "switch_accuracy.png")
    console.print(f"wrote {path} and {args.out_dir / 'switch_accuracy.png'}")
    return 0 if all(r["of bound"] <= 1 and r["identical"] for r in rows) else 1


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for j, dt in enumerate(DTYPES):
        rs = [r for r in rows if r["dtype"] == dt]
        ax.plot([r["density"] for r in rs], [r["switch rel err"] for r in rs], marker="o",
                color=f"C{j}", label=f"switch {dt}")
        ax.plot([r["density"] for r in rs], [r["hvd dense rel err"] for r in rs], ls="--",
                marker="x", color=f"C{j}", label=f"hvd.allreduce {dt}")
    ax.set(xscale="log", yscale="log", xlabel="block density per rank",
           ylabel="max |out - ref| / max |ref|", title="switch (fixed point) vs float64")
    ax.legend(fontsize=7)
    save_png(fig, path)


def rank_side(args: argparse.Namespace) -> None:
    import hashlib

    import horovod.torch as hvd
    import torch

    import hvd_sparse
    from hvd_sparse import fixedpoint
    from hvd_sparse.tools.lab.inputs import make_tensor

    hvd.init()
    torch.set_num_threads(1)
    hvd_sparse.init(probe="off")
    n, rows = hvd.size(), []
    for dt in DTYPES:
        dtype = getattr(torch, dt)
        for k, d in enumerate(float(x) for x in args.densities.split(",")):
            gen = torch.Generator().manual_seed(hvd.rank() * 7919 + k)
            t = make_tensor(args.numel, 256, d, gen).to(dtype)
            ref = hvd.allreduce(t.double(), op=hvd.Sum, name=f"acc.ref.{dt}.{d}")
            # Horovod's MPI operations have no bfloat16: NaN there
            dense = (hvd.allreduce(t, op=hvd.Sum, name=f"acc.dense.{dt}.{d}")
                     if dtype != torch.bfloat16 else torch.full_like(t, float("nan")))
            out = hvd_sparse.allreduce(t, op=hvd.Sum, scheme="switch", name=f"acc.sw.{dt}.{d}")
            m = float(hvd.allreduce(t.double().abs().max().reshape(1), op=hvd.Max,
                                    name=f"acc.max.{dt}.{d}"))
            info = torch.finfo(dtype)
            bound = fixedpoint.error_bound(m, n)
            allowed = bound + info.eps * (ref.abs() + bound) + info.smallest_normal * info.eps
            err = (out.double() - ref).abs()
            scale = max(float(ref.abs().max()), 1e-300)
            digest = hashlib.sha256(out.view(torch.int16 if out.element_size() == 2
                                             else torch.int32).numpy().tobytes()).hexdigest()
            same = len(set(hvd.allgather_object(digest, name=f"acc.digest.{dt}.{d}"))) == 1
            rows.append({"dtype": dt, "density": d,
                         "scheme": hvd_sparse.metrics()[f"acc.sw.{dt}.{d}"]["scheme"],
                         "switch rel err": float(err.max()) / scale,
                         "hvd dense rel err": float((dense.double() - ref).abs().max()) / scale,
                         "bound rel": bound / scale,
                         "of bound": float((err / allowed).max()), "identical": same})
            if hvd.rank() == 0:
                console.print(f"{dt} at {d:g}: done")
    if hvd.rank() == 0:
        Path(args.rank_side).write_text(json.dumps(rows))
    hvd_sparse.shutdown()


def main() -> int:
    return testbed_main("switch_accuracy", parse_args(), rank_side, drive)


if __name__ == "__main__":
    sys.exit(main())
