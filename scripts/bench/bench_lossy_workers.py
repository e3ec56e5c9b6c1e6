"""Omnireduce with some workers losing packets: N in-process workers, local aggregators.

    .venv/bin/python scripts/bench/bench_lossy_workers.py [--workers 8] [--drops 0,0.05,0.2]
                                                     [--lossy 0,4] [--reps 3] [--aggregators 1]
                                                     [--result-drop 0]

Each worker submits its own 30%-dense float32 tensor (6,000 blocks of 64, own pattern); the
workers in --lossy drop each DATA packet they send with the given probability (the engine's
``drop_rate``), the others lose nothing. Loss makes the workers' windows differ, which is what
left rounds of a slot unanswered for the whole timeout when the window gated every round
(csrc/omni/worker/engine.h). --result-drop: the aggregators drop that share of the RESULTs
they send (their --drop-rate-out), as a busy link to the workers does. Per drop rate: time of
each reduction (all workers done), the retransmissions and window cuts summed over workers, and
whether it timed out (--timeout s).
Every result is checked against the float64 sum. Writes <out-dir>/lossy_workers.{json,png}.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from hvd_sparse import _C
from hvd_sparse.aggregator import LocalAggregators
from hvd_sparse.tools.lab.report import plt, print_table, save_png, write_json

BS, BLOCKS, DENSITY = 64, 6000, 0.3


def inputs(n: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        keep = np.repeat(rng.random(BLOCKS) < DENSITY, BS)
        out.append(torch.from_numpy((rng.standard_normal(BLOCKS * BS) * keep).astype(np.float32)))
    return out


def reduce_once(addrs, n: int, token: int, drop: float, lossy: set[int], timeout: float,
                ins: list[torch.Tensor], ref: np.ndarray) -> dict:
    ws = [_C.OmniWorker(addrs, token, r, n, payload_bytes=1024, slots_per_aggregator=64,
                        seed=r + 1, timeout=timeout, drop_rate=drop if r in lossy else 0.0)
          for r in range(n)]
    try:
        for w in ws:
            w.register(15.0)
        outs = [torch.zeros_like(x) for x in ins]
        t0 = time.perf_counter()
        tickets = [w.submit(7, ins[r], outs[r], BS, 7, None, "t", 1.0) for r, w in enumerate(ws)]
        for r, w in enumerate(ws):
            w.wait(tickets[r], timeout + 30)
        seconds = time.perf_counter() - t0
        failed = ""
        for r, w in enumerate(ws):
            try:
                w.finish(tickets[r])
            except RuntimeError as e:
                failed = failed or str(e)
        if not failed:
            for r, o in enumerate(outs):
                err = np.abs(o.double().numpy() - ref).max()
                assert err < 1e-4, f"rank {r}: off the float64 sum by {err}"
        counters = [w.stats() for w in ws]  # the workers' own: a failed one has no finish()
        return {"s": seconds, "retransmits": sum(c["retransmits"] for c in counters),
                "window cuts": sum(a["window_cuts"] for c in counters for a in c["aggregators"]),
                "timed out": bool(failed)}
    finally:
        for w in ws:
            w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--drops", default="0,0.05,0.2")
    ap.add_argument("--lossy", default="0,4", help="ranks that drop packets")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--aggregators", type=int, default=1, help="local aggregator processes")
    ap.add_argument("--result-drop", type=float, default=0.0,
                    help="share of RESULTs the aggregators drop")
    ap.add_argument("--out-dir", default="bench_results")
    args = ap.parse_args()
    n, lossy = args.workers, {int(r) for r in args.lossy.split(",") if r}
    ins = inputs(n)
    ref = sum(x.double().numpy() for x in ins)
    aggs = LocalAggregators(args.aggregators, n, "127.0.0.1",
                            args=["--drop-rate-out", str(args.result_drop)])
    rows, token = [], 100
    try:
        for drop in map(float, args.drops.split(",")):
            runs = []
            for rep in range(args.reps):
                token += 1
                runs.append(reduce_once([("127.0.0.1", p) for p in aggs.ports], n, token, drop,
                                        lossy, args.timeout, ins, ref))
                print(f"drop {drop} rep {rep + 1}/{args.reps}: {runs[-1]['s']:.2f} s", flush=True)
            rows.append({"drop": drop, "median s": statistics.median(r["s"] for r in runs),
                         "runs s": " ".join(f"{r['s']:.2f}" for r in runs),
                         "retransmits": statistics.median(r["retransmits"] for r in runs),
                         "window cuts": statistics.median(r["window cuts"] for r in runs),
                         "timed out": sum(r["timed out"] for r in runs)})
    finally:
        aggs.stop()
    print_table(rows, f"omnireduce, {n} workers, {args.aggregators} aggregator(s) dropping "
                      f"{args.result_drop:g} of RESULTs, ranks {sorted(lossy)} lossy, "
                      f"{BLOCKS} blocks of {BS} at {DENSITY:.0%}, median of {args.reps}")
    out = Path(args.out_dir)
    write_json(out / "lossy_workers.json", rows, workers=n, lossy=sorted(lossy))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(r["drop"]) for r in rows], [r["median s"] for r in rows])
    ax.axhline(args.timeout, color="red", ls="--", label=f"timeout ({args.timeout:.0f} s)")
    ax.set_xlabel(f"drop rate of ranks {sorted(lossy)}")
    ax.set_ylabel("s per reduction (median)")
    ax.set_title(f"omnireduce, {n} workers, lossy peers")
    ax.legend()
    print(f"wrote {save_png(fig, out / 'lossy_workers.png')}")


if __name__ == "__main__":
    main()
