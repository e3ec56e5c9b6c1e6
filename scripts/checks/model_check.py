"""The cost model's link what-if against measured runs on emulated hosts.

    .venv/bin/python scripts/checks/model_check.py bench_results/testbed.json [MORE.json ...]
        [--fit-workers 4] [--save-points tests/data/model_points.json] [--extrapolate]
    python scripts/checks/model_check.py --points tests/data/model_points.json --extrapolate

Reads what scripts/bench/bench_testbed.py wrote (each row carries the inputs the model needs: every
rank's non-zero blocks, the union, the workers, the link rate, the model the job probed) and
predicts each measured point as ``hvd-sparse analyze``'s what-if does: ``costmodel.predict`` on
``NetModel.for_link`` (the probed latencies and CPU rates, the links' bytes at the model's
link efficiencies). Prints measured against predicted per point with the error, the largest
error and the geometric mean of the errors; with --fit-workers N, also fits the two
efficiencies on the points of N workers alone (a grid, least geometric-mean error) and reports
the error of the other points, held out of that fit. Writes model_check.json and a plot
(predicted against measured) to --out-dir; --save-points keeps the points themselves (what
tests/test_costmodel.py checks the model against). --extrapolate: the same model, from the
smallest run's probe, for 16-1,024 workers on 10, 25, 100 and 400 Gbit/s links, one
tensor of the runs' size at each density, blocks placed independently (the union
1 - (1 - d)^n of the blocks), aggregation colocated (a shard on every worker host).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from hvd_sparse import costmodel
from hvd_sparse.tools.analyze import net_model
from hvd_sparse.tools.lab.report import console, print_table, save_png, write_json

ROOT = Path(__file__).resolve().parents[2]

# bench_testbed's methods the model covers: (scheme, aggregator hosts: None = the testbed's)
METHODS = {"hvd dense": ("dense", None), "allgather": ("allgather", None), "zen": ("zen", None),
           "omnireduce x4": ("omnireduce", None), "omnireduce colocated": ("omnireduce", 0)}


def points(paths: list[Path]) -> list[dict]:
    """One point per measured row the model covers, with what predicting it needs."""
    out = []
    for path in paths:
        d = json.loads(path.read_text())
        numel = d.get("args", {}).get("numel", 26_214_400)
        for r in d["rows"]:
            if r.get("method") not in METHODS or "ms" not in r or "model inputs" not in r:
                continue
            i = r["model inputs"]
            scheme, hosts = METHODS[r["method"]]
            out.append({"method": r["method"], "scheme": scheme, "density": r["density"],
                        "workers": i["workers"], "rate_bps": i["rate_bps"], "numel": numel,
                        "aggregator_hosts": i["aggregator hosts"] if hosts is None else hosts,
                        "nnz": i["nnz"], "union": i["union"], "net": i["net"],
                        "measured_s": r["ms"] / 1e3})
    return out


def predict(p: dict, efficiency: tuple[float, float] = (costmodel.COLLECTIVE_EFFICIENCY,
                                                        costmodel.AGGREGATION_EFFICIENCY)) -> float:
    """The what-if's seconds for point ``p``."""
    base = net_model(p["net"])
    net = costmodel.NetModel.for_link(p["rate_bps"], p["workers"], base, p["aggregator_hosts"],
                                      efficiency=efficiency)
    return costmodel.predict(net, p["numel"], 4, 256, p["nnz"], p["union"]).seconds[p["scheme"]]


def errors(ps: list[dict], efficiency: tuple[float, float]) -> list[float]:
    return [predict(p, efficiency) / p["measured_s"] - 1 for p in ps]


def gmean_abs(errs: list[float]) -> float:
    """Geometric-mean error: exp(mean |log(predicted / measured)|) - 1."""
    return math.exp(sum(abs(math.log1p(e)) for e in errs) / len(errs)) - 1 if errs else math.nan


def fit(ps: list[dict]) -> tuple[float, float]:
    """The efficiencies (0.5-1.0, steps of 0.01) of least geometric-mean error on ``ps``."""
    grid = [x / 100 for x in range(50, 101)]
    return min(((c, a) for c in grid for a in grid),
               key=lambda e: gmean_abs(errors(ps, e)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path, help="bench_testbed JSON files")
    ap.add_argument("--points", type=Path,
                    help="points saved by --save-points (tests/data/model_points.json) instead")
    ap.add_argument("--fit-workers", type=int, help="fit the efficiencies on these points")
    ap.add_argument("--save-points", type=Path, help="write the points here")
    ap.add_argument("--extrapolate", action="store_true",
                    help="predict 16-1,024 workers on 10-400 Gbit/s links too")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_results")
    args = ap.parse_args()
    ps = json.loads(args.points.read_text()) if args.points else points(args.runs)
    if not ps:
        console.print("[red]no point with model inputs in these files (bench_testbed.py "
                      "records them)[/]")
        return 1
    eff = (costmodel.COLLECTIVE_EFFICIENCY, costmodel.AGGREGATION_EFFICIENCY)
    rows = []
    for p, e in zip(ps, errors(ps, eff), strict=True):
        rows.append({"workers": p["workers"], "density": p["density"], "method": p["method"],
                     "measured ms": p["measured_s"] * 1e3,
                     "predicted ms": (1 + e) * p["measured_s"] * 1e3, "error %": 100 * e})
    print_table(rows, "link model (NetModel.for_link) against measured, efficiencies "
                      f"{eff[0]} (collectives), {eff[1]} (aggregation)", list(rows[0]))
    errs = [r["error %"] / 100 for r in rows]
    summary = {"efficiency": eff, "points": len(ps), "max_abs_error": max(map(abs, errs)),
               "gmean_error": gmean_abs(errs)}
    console.print(f"{len(ps)} points: largest error {100 * summary['max_abs_error']:.1f}%, "
                  f"geometric mean {100 * summary['gmean_error']:.1f}%")
    if args.fit_workers:
        fit_on = [p for p in ps if p["workers"] == args.fit_workers]
        held = [p for p in ps if p["workers"] != args.fit_workers]
        fitted = fit(fit_on)
        summary["fit"] = {"workers": args.fit_workers, "efficiency": fitted,
                          "fit_gmean_error": gmean_abs(errors(fit_on, fitted)),
                          "held_out_gmean_error": gmean_abs(errors(held, fitted)),
                          "held_out_max_abs_error": max(map(abs, errors(held, fitted)),
                                                        default=math.nan)}
        f = summary["fit"]
        console.print(
            f"fitted on {len(fit_on)} points of {args.fit_workers} workers: efficiencies "
            f"{fitted}, geometric-mean error {100 * f['fit_gmean_error']:.1f}%; {len(held)} "
            f"held-out points: {100 * f['held_out_gmean_error']:.1f}%, largest "
            f"{100 * f['held_out_max_abs_error']:.1f}%")
    if args.extrapolate:
        summary["extrapolation"] = extrapolate(ps)
    if args.save_points:
        args.save_points.write_text(json.dumps(ps, indent=None) + "\n")
    out = write_json(args.out_dir / "model_check.json", rows, summary=summary,
                     runs=[str(r) for r in args.runs])
    plot(rows, args.out_dir / "model_check.png")
    console.print(f"wrote {out} and {args.out_dir / 'model_check.png'}")
    return 0


def extrapolate(ps: list[dict]) -> list[dict]:
    """Predicted ms per scheme at the what-if's scale, from the smallest run's probe (its
    CPU rates the least shared: fewest ranks on the machine's cores)."""
    src = min(ps, key=lambda p: p["workers"])
    base = net_model(src["net"])
    nblocks = src["numel"] // 256
    rows = []
    for d in sorted({p["density"] for p in ps}, reverse=True):
        for rate in (10e9, 25e9, 100e9, 400e9):
            for n in (16, 64, 256, 1024):
                net = costmodel.NetModel.for_link(rate, n, base, 0, base_n=src["workers"])
                nnz = [round(d * nblocks)] * n
                t = costmodel.predict(net, src["numel"], 4, 256, nnz, None).seconds
                best = min((k for k in t if k != "dense"), key=t.__getitem__)
                rows.append({"density": d, "Gbit/s": rate / 1e9, "workers": n,
                             **{f"{k} ms": v * 1e3 for k, v in t.items()},
                             "union %": 100 * (1 - (1 - d) ** n), "best sparse": best,
                             "dense / best": t["dense"] / t[best]})
    print_table(rows, f"extrapolated: {src['numel']:,} float32, blocks independent, "
                      f"aggregation colocated; probe of the {src['workers']}-worker run",
                list(rows[0]))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 6))
    ax = fig.subplots()
    for j, m in enumerate(METHODS):
        for k, n in enumerate(sorted({r["workers"] for r in rows})):
            rs = [r for r in rows if r["method"] == m and r["workers"] == n]
            if rs:
                ax.scatter([r["measured ms"] for r in rs], [r["predicted ms"] for r in rs],
                           color=f"C{j}", marker="os^Dv"[k % 5], label=f"{m}, {n} workers")
    lo = min(min(r["measured ms"], r["predicted ms"]) for r in rows) / 1.5
    hi = max(max(r["measured ms"], r["predicted ms"]) for r in rows) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    for f in (0.8, 1.2):
        ax.plot([lo, hi], [f * lo, f * hi], "k:", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured ms", ylabel="predicted ms",
           title="link model against emulated hosts (dotted: +-20%)")
    ax.legend(fontsize=6)
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
