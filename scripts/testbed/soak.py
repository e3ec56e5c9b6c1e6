"""Training under faults on the netns testbed: 4 ranks train the DLRM-like model
(hvd_sparse/tools/lab/dlrm.py) with the DDP hook while a thread of this driver cuts, degrades
and restores links and kills, stops and restarts the aggregator host
(hvd_sparse.tools.testbed.faults). Every bucket of every step is checked against a dense
float64 Gloo allreduce of the same local gradients.

    python scripts/testbed/soak.py --matrix                 # each fault once, per scheme (a table)
    python scripts/testbed/soak.py --minutes 5 --seed 1     # faults drawn at random for 5 minutes

``--matrix``: per scheme (dense, allgather, omnireduce with the testbed's aggregator host,
omnireduce with the job's own aggregators on the worker hosts, auto), one job with, one after
another, w1's link down 3 s, 20% loss on it for 5 s, 10% of its frames duplicated for 5 s and
20% reordered for 5 s (fallback "error": no help from a dense redo). The soak: one scheme
(omnireduce on the aggregator host, fallback "dense"), faults drawn with ``--seed`` from those
link faults on any worker and from the aggregator killed (restarted 5-15 s later, same address)
or stopped (SIGSTOP) for 10 s.

The check: each rank's hook wraps hvd_sparse.ddp.hook; before the bucket is reduced, a copy
of it (a sparse bucket made dense) is summed in float64 by ``dist.all_reduce`` on a Gloo group
of its own; after backward the hook's average must equal that sum / ranks within float32
rounding (rtol 1e-5): a wrong sum in any bucket of any step on any rank is counted. The
final parameters must be identical on every rank. A step that raises ends the run (counted);
no step for ``--hang`` seconds is a hang (the ranks are stopped, counted).

A step is everything one iteration does: forward, backward (the hook's reductions), the
optimizer's step, the reference reduction and its check, and the stop flag (a one-element
allreduce). The report: per fault, the steps it overlapped, the worst step and the stall (worst
step minus the median step of the run's fault-free steps), the time from its end to the first
step back under twice the median ("recovered"); table to stdout, JSON and a PNG timeline of
step times with the faults marked to --out-dir. Needs root. Exits 1 on any wrong sum, error,
hang or fault not recovered from.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from hvd_sparse.tools.lab.report import console, print_table, save_png, write_json
from hvd_sparse.tools.testbed import faults

ROOT = Path(__file__).resolve().parents[2]

# scheme label -> the hook state's options (the testbed's aggregator host comes by
# HVD_SPARSE_AGGREGATORS, which `testbed run` sets)
SCHEMES = {
    "dense": {"scheme": "dense"},
    "allgather": {"scheme": "allgather"},
    "omnireduce": {"scheme": "omnireduce"},
    "colocated": {"scheme": "omnireduce", "aggregators": "", "aggregator_layout": "colocated"},
    "auto": {"scheme": "auto"},
}
# the matrix's faults, one after another on w1 (a worker, not rank 0's host)
MATRIX = (("link_down", 3.0, 0.0), ("loss", 5.0, 0.2), ("dup", 5.0, 0.1), ("reorder", 5.0, 0.2))
RTOL, ATOL = 1e-5, 1e-6  # float32 rounding of a sum of 4 in another order (tests' TOL)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--matrix", action="store_true", help="each link fault once, per scheme")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="--matrix: which schemes")
    p.add_argument("--minutes", type=float, default=5.0, help="the soak's training time")
    p.add_argument("--seed", type=int, default=1, help="the soak's draw of faults")
    p.add_argument("--scheme", default="omnireduce", choices=list(SCHEMES),
                   help="the soak's scheme")
    p.add_argument("--kinds", default=",".join(faults.KINDS),
                   help="the soak's fault kinds to draw from")
    p.add_argument("--gap", type=float, default=8.0,
                   help="seconds between faults (the soak: 1x-2x this, drawn)")
    p.add_argument("--warmup", type=float, default=8.0,
                   help="seconds of training before the first fault")
    p.add_argument("--hang", type=float, default=120.0,
                   help="seconds without a step that count as a hang (the job is stopped)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="hvd_sparse's timeout (0: 30 s with --matrix, 10 s for the soak)")
    p.add_argument("--streams", type=int, default=0,
                   help="the hook state's streams (reductions at once; 0: its default)")
    p.add_argument("--scale", type=float, default=0.01, help="the DLRM tables' rows times this")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=512, help="per rank")
    p.add_argument("--bag", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="the testbed's links")
    p.add_argument("--name", default="hvsoak", help="testbed name")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench_results" / "faults")
    p.add_argument("--rank-side", help=argparse.SUPPRESS)  # as a rank: its output folder
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)  # the hook state's
    # a test of the check itself: rank 1 changes one value of its first bucket's result at
    # this step, after the hook (a wrong sum the check must count, once)
    p.add_argument("--corrupt", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.schemes = [s for s in args.schemes.split(",") if s]
    args.kinds = [k for k in args.kinds.split(",") if k]
    if unknown := (set(args.schemes) - set(SCHEMES)) | (set(args.kinds) - set(faults.KINDS)):
        p.error(f"unknown schemes or kinds {sorted(unknown)}")
    if not args.timeout:
        args.timeout = 30.0 if args.matrix else 10.0
    return args


# ---- a rank -----------------------------------------------------------------------------------

class Checked:
    """hvd_sparse.ddp.hook's state, with the reference reductions of the step's buckets."""

    def __init__(self, state: object, group: object, size: int) -> None:
        self.state, self.group, self.size = state, group, size
        self.pending: list[tuple] = []
        self.corrupt = False  # the next bucket's result is changed (--corrupt)

    def check(self) -> tuple[int, float]:
        """After backward: (buckets whose average is not the reference's, worst relative
        error); a bucket whose reduction failed is not counted (the step's error is)."""
        import torch
        wrong, worst = 0, 0.0
        pending, self.pending = self.pending, []
        for ref, work, fut in pending:
            work.wait()
            try:
                out = fut.value()
            except Exception:  # noqa: BLE001 - the step raised it
                continue
            out = (out.to_dense() if out.is_sparse else out).double().view(ref.shape)
            want = ref / self.size
            scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
            worst = max(worst, float((out - want).abs().max()) / scale if want.numel() else 0)
            if not torch.allclose(out, want, rtol=RTOL, atol=ATOL * scale):
                wrong += 1
        return wrong, worst


# No annotations: DDP checks a hook's annotations as objects.
def checked_hook(c, bucket):  # noqa: ANN001, ANN201
    import torch.distributed as dist

    from hvd_sparse import ddp
    buf = bucket.buffer()
    local = buf.detach().clone()  # the hook reduces a dense bucket in place
    ref = (local.coalesce().to_dense() if local.is_sparse else local).double()
    work = dist.all_reduce(ref, group=c.group, async_op=True)
    fut = ddp.hook(c.state, bucket)
    if c.corrupt:
        c.corrupt = False
        fut = fut.then(_corrupt)
    c.pending.append((ref, work, fut))
    return fut


def _corrupt(fut):  # noqa: ANN001, ANN202
    out = fut.value()
    (out._values() if out.is_sparse else out).view(-1)[0] += 1.0
    return out


def rank_side(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    import hvd_sparse
    from hvd_sparse import ddp
    from hvd_sparse.tools.lab.dlrm import RecModel, batches

    out = Path(args.rank_side)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.hang))
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    ref_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.hang))
    rows = [max(8, int(r * args.scale)) for r in
            (100_000, 150_000, 200_000, 250_000, 300_000, 350_000, 400_000, 500_000)]
    pool = batches(rank, rows, 8, args.batch, args.bag)
    torch.manual_seed(0)
    model = RecModel(rows, args.dim, sparse=True)
    net = DDP(model)
    options = json.loads(args.options)
    if args.streams:
        options["streams"] = args.streams
    state = ddp.State(probe="off", timeout=args.timeout, **options)
    checker = Checked(state, ref_group, size)
    net.register_comm_hook(checker, checked_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss()
    progress = out / "progress"
    record = open(out / f"rank{rank}.jsonl", "a", buffering=1)  # a line a step: kept if killed
    error = ""
    i = 0
    while True:
        ids, dense, y = pool[i % len(pool)]
        hvd_sparse.reset_metrics()
        checker.corrupt = rank == 1 and i == args.corrupt
        t0 = time.time()
        try:
            opt.zero_grad()
            loss = loss_fn(net(ids, dense), y)
            loss.backward()
            opt.step()
        except Exception as e:  # noqa: BLE001 - counted, ends the run
            error = f"step {i}: {type(e).__name__}: {str(e).split(chr(10) + 'At:')[0]}"[:1000]
        if error:
            # This rank's hook may have missed buckets: its reference group is out of step
            # with the others', so no further collective; the launcher stops the others.
            record.write(json.dumps({"rank": rank, "error": error, "t": time.time()}) + "\n")
            sys.stdout.flush()
            os._exit(1)
        wrong, worst = checker.check()
        schemes = sorted({str(v.get("scheme")) for k, v in hvd_sparse.metrics().items()
                          if k.startswith("ddp.")})
        flag = torch.tensor([1.0 if rank == 0 and (out / "stop").exists() else 0.0])
        dist.all_reduce(flag, group=ref_group)
        # the step's end: after the check and the flag, so that a stall in any of them counts
        t1 = time.time()
        record.write(json.dumps({"step": i, "t0": t0, "t1": t1, "wrong": wrong, "rel_err": worst,
                                 "loss": float(loss.detach()), "schemes": schemes}) + "\n")
        if rank == 0:
            with open(progress, "a") as f:
                f.write(f"{i} {t1}\n")
        if flag.item() > 0:
            break
        i += 1
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    digests: list = [None] * size
    dist.all_gather_object(digests, digest, group=ref_group)
    record.write(json.dumps({"rank": rank, "digest": digest,
                             "identical": len(set(digests)) == 1}) + "\n")
    record.close()
    state.close()
    dist.destroy_process_group()


def read_rank(path: Path) -> dict:
    """A rank's record (rank<r>.jsonl): its steps, its error ("" none), whether its parameters
    ended identical to the others' (None: it did not get there)."""
    rank = {"rank": int(path.stem[4:]), "steps": [], "error": "", "identical": None}
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if "step" in d:
            rank["steps"].append(d)
        else:
            rank.update({k: v for k, v in d.items() if k != "t"})
    return rank


# ---- the driver -------------------------------------------------------------------------------

def matrix_schedule(args: argparse.Namespace) -> list[faults.Fault]:
    out, at = [], 0.0
    for kind, duration, rate in MATRIX:
        out.append(faults.Fault(kind, at=at, duration=duration, host="w1", rate=rate))
        at += duration + args.gap
    return out


def soak_schedule(args: argparse.Namespace, workers: int) -> list[faults.Fault]:
    """Faults drawn with ``args.seed`` until ``args.minutes`` less the tail (a gap) is
    scheduled: kind uniformly from ``args.kinds``, the worker at random, rates and
    durations in the ranges of the matrix's."""
    rng = random.Random(args.seed)
    end = args.minutes * 60 - args.warmup - args.gap
    out, at = [], 0.0
    while True:
        kind = rng.choice(args.kinds)
        host = "a0" if kind in faults.AGGREGATOR else f"w{rng.randrange(workers)}"
        duration = {"link_down": rng.uniform(1, 4), "agg_kill": rng.uniform(5, 15),
                    "agg_stop": 10.0}.get(kind, rng.uniform(3, 6))
        rate = {"loss": rng.uniform(0.05, 0.2), "dup": rng.uniform(0.05, 0.2),
                "reorder": rng.uniform(0.05, 0.2)}.get(kind, 0.0)
        if at + duration > end:
            return out
        out.append(faults.Fault(kind, at=round(at, 1), duration=round(duration, 1), host=host,
                                rate=round(rate, 3)))
        at += duration + args.gap * rng.uniform(1, 2)


def run_job(tb: object, args: argparse.Namespace, scheme: str, schedule: list[faults.Fault],
            fallback: str) -> dict:
    """One training job on ``tb`` under ``schedule`` (started once the ranks have trained
    ``args.warmup`` seconds); stopped a gap after the last fault. The ranks' records, the
    faults as done, hangs, errors."""
    from hvd_sparse.tools.testbed import launch, links

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        progress, stop = out / "progress", out / "stop"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-side", str(out),
               "--options", json.dumps(SCHEMES[scheme]), "--timeout", str(args.timeout),
               "--hang", str(args.hang), "--streams", str(args.streams), "--scale",
               str(args.scale), "--dim", str(args.dim), "--batch", str(args.batch), "--bag",
               str(args.bag), "--corrupt", str(args.corrupt)]
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HVD_SPARSE_CACHE_DIR": tmp,
               "HVD_SPARSE_FALLBACK": fallback}
        result: dict = {}

        def job() -> None:
            try:
                proc = launch.run(tb, cmd, env=env, launcher="torch", capture=True,
                                  timeout=args.minutes * 60 * 4 + 600)
                result["rc"], result["output"] = proc.returncode, proc.stdout or ""
            except Exception as e:  # noqa: BLE001 - said in the report
                result["rc"], result["launch"] = -1, str(e)[-2000:]

        def last_step() -> tuple[int, float]:
            try:
                line = progress.read_text().splitlines()[-1].split()
                return int(line[0]), float(line[1])
            except (OSError, IndexError, ValueError):
                return -1, math.nan

        t = threading.Thread(target=job, daemon=True)
        t.start()
        inj = faults.Injector(tb.name, schedule)
        hang, started, seen, seen_at = "", math.nan, -1, time.monotonic()
        end_at, injecting = math.inf, False
        try:
            while t.is_alive():
                step, _ = last_step()
                now = time.monotonic()
                if step != seen:
                    seen, seen_at = step, now
                if step >= 0 and math.isnan(started):
                    started = time.time()
                elif not injecting and time.time() - started >= args.warmup:
                    inj.start()
                    injecting = True
                    last = max((f.at + f.duration for f in schedule), default=0.0)
                    end_at = now + last + args.gap
                if now > end_at and not stop.exists():
                    stop.touch()
                limit = args.hang + (300 if step < 0 else 0)  # the start: imports, joins
                if now - seen_at > limit:
                    hang = (f"no step for {now - seen_at:.0f} s after step {seen}"
                            f" (fault in force: {inj.current or 'none'})")
                    links.kill_processes([h.ns for h in tb.worker_hosts])
                    break
                time.sleep(0.2)
        finally:
            inj.stop()
            if inj.is_alive():
                inj.join(timeout=60)
            t.join(timeout=60)
        ranks = [read_rank(f) for f in sorted(out.glob("rank*.jsonl"))]
        return {"scheme": scheme, "rc": result.get("rc"), "launch": result.get("launch", ""),
                "output": result.get("output", ""),
                "hang": hang, "ranks": ranks, "faults": [f.as_dict() for f in inj.done],
                "injector_errors": inj.errors, "started": started}


def analyse(job: dict) -> tuple[list[dict], dict]:
    """Per fault a row (steps overlapped, worst step, stall, recovery, wrong sums) and the
    job's summary."""
    ranks = job["ranks"]
    n = min((len(r["steps"]) for r in ranks), default=0)
    steps = []
    for i in range(n):
        per = [r["steps"][i] for r in ranks]
        steps.append({"t0": min(s["t0"] for s in per), "t1": max(s["t1"] for s in per),
                      "wrong": sum(s["wrong"] for s in per),
                      "rel_err": max(s["rel_err"] for s in per),
                      "schemes": sorted({x for s in per for x in s["schemes"]})})
    for s in steps:
        s["dt"] = s["t1"] - s["t0"]
    fs = job["faults"]

    def during(s: dict, f: dict, tail: float) -> bool:
        return s["t1"] >= f["start"] and s["t0"] <= f["end"] + tail

    calm = [s["dt"] for s in steps if not any(during(s, f, 10.0) for f in fs)] or \
        [s["dt"] for s in steps]
    median = statistics.median(calm) if calm else math.nan
    rows = []
    for f in fs:
        after = [s for s in steps if s["t0"] >= f["end"] and s["dt"] < 2 * median]
        back = after[0]["t1"] - f["end"] if after else math.nan
        hit = [s for s in steps if during(s, f, back if math.isfinite(back) else 0.0)]
        worst = max((s["dt"] for s in hit), default=math.nan)
        schemes = sorted({x for s in hit for x in s["schemes"]})
        rows.append({"scheme": job["scheme"], "fault": f["kind"], "host": f["host"],
                     "rate": f["rate"], "at_s": f["start"] - job["started"],
                     "for_s": f["end"] - f["start"], "steps": len(hit),
                     "worst_step_s": worst, "stall_s": worst - median,
                     "recovered_s": back, "wrong": sum(s["wrong"] for s in hit),
                     "schemes": ",".join(schemes), "error": f["error"],
                     "outcome": "ok" if math.isfinite(back) and not f["error"] else
                     "not recovered" if not f["error"] else "injector failed"})
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if r["error"]]
    summary = {"scheme": job["scheme"], "steps": n, "median_step_s": median,
               "faults": len(fs), "recovered": sum(r["outcome"] == "ok" for r in rows),
               "wrong_sums": sum(s["wrong"] for s in steps),
               "worst_rel_err": max((s["rel_err"] for s in steps), default=math.nan),
               "hangs": int(bool(job["hang"])), "errors": len(errors),
               "worst_stall_s": max((r["stall_s"] for r in rows), default=math.nan),
               "identical": all(r.get("identical") for r in ranks) and len(ranks) > 0,
               "ranks": len(ranks), "rc": job["rc"], "hang": job["hang"],
               "error": "; ".join(errors) or job["launch"],
               "injector_errors": job["injector_errors"]}
    summary["ok"] = (summary["wrong_sums"] == 0 and not summary["hangs"]
                     and not summary["errors"] and summary["identical"] and job["rc"] == 0
                     and summary["recovered"] == summary["faults"])
    job["steps"] = steps
    return rows, summary


def plot(jobs: list[dict], path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    colours = {"link_down": "tab:red", "loss": "tab:orange", "dup": "tab:purple",
               "reorder": "tab:blue", "agg_kill": "black", "agg_stop": "tab:gray"}
    fig, axes = plt.subplots(len(jobs), 1, figsize=(10, 1.9 * len(jobs) + 0.6), squeeze=False,
                             sharex=True)
    for ax, job in zip(axes[:, 0], jobs, strict=True):
        t0 = job["started"]
        steps = job.get("steps", [])
        ax.hlines([s["dt"] for s in steps], [s["t0"] - t0 for s in steps],
                  [s["t1"] - t0 for s in steps], color="tab:green", lw=1.2)  # a step: t0..t1
        wrong = [(s["t1"] - t0, s["dt"]) for s in job.get("steps", []) if s["wrong"]]
        if wrong:
            ax.plot(*zip(*wrong, strict=True), "x", color="red", label="wrong sum")
        for f in job["faults"]:
            ax.axvspan(f["start"] - t0, f["end"] - t0, color=colours[f["kind"]], alpha=0.25)
            ax.text(f["start"] - t0, 1.0, f["kind"], transform=ax.get_xaxis_transform(),
                    fontsize=6, va="bottom", rotation=0)
        ax.set_yscale("log")
        ax.set_ylabel(f"{job['scheme']}\nstep s", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since training started (shaded: a fault in force)")
    fig.suptitle(title, fontsize=8)
    return save_png(fig, path)


COLS = ["scheme", "fault", "host", "rate", "at_s", "for_s", "steps", "worst_step_s", "stall_s",
        "recovered_s", "wrong", "schemes", "outcome"]
SUMMARY = ["scheme", "steps", "median_step_s", "faults", "recovered", "wrong_sums",
           "worst_rel_err", "hangs", "errors", "worst_stall_s", "identical", "ok"]


def drive(args: argparse.Namespace) -> int:
    from hvd_sparse.tools.testbed import lifecycle
    from hvd_sparse.tools.testbed.topology import Testbed

    jobs: list[dict] = []
    tb = lifecycle.up(Testbed(args.name, workers=4, aggregators=1, rate=args.rate, mtu=9000))
    try:
        if args.matrix:
            for scheme in args.schemes:
                console.rule(f"{scheme}: {', '.join(f.label() for f in matrix_schedule(args))}")
                jobs.append(run_job(tb, args, scheme, matrix_schedule(args), fallback="error"))
        else:
            schedule = soak_schedule(args, tb.workers)
            console.rule(f"soak: {args.minutes:g} min, seed {args.seed}, {args.scheme}, "
                         f"{len(schedule)} faults")
            jobs.append(run_job(tb, args, args.scheme, schedule, fallback="dense"))
    finally:
        lifecycle.down(args.name)
    rows, summaries = [], []
    for job in jobs:
        r, s = analyse(job)
        rows += r
        summaries.append(s)
    what = "matrix" if args.matrix else f"soak-{args.seed}"
    caption = (f"4 ranks on 4 emulated hosts + 1 aggregator host at {args.rate}, DDP hook, "
               f"DLRM-like tables x{args.scale:g} (dim {args.dim}, batch {args.batch}/rank); "
               "stall: worst step during a fault minus the median fault-free step")
    written = [write_json(args.out_dir / f"{what}.json", rows, summaries=summaries,
                          jobs=[{k: v for k, v in j.items() if k not in ("ranks", "output")}
                                for j in jobs], args=vars(args)),
               plot(jobs, args.out_dir / f"{what}.png", caption)]
    for job in jobs:  # the ranks' own output, for what went wrong
        log = args.out_dir / f"{what}-{job['scheme']}.log"
        log.write_text(job["output"])
        written.append(log)
    print_table(rows, f"Training under link and aggregator faults ({what})", COLS, caption)
    print_table(summaries, "Per job", SUMMARY)
    for s in summaries:
        for k in ("hang", "error", "injector_errors"):
            if s[k]:
                console.print(f"{s['scheme']}: {k}: {s[k]}", style="red", markup=False)
    print("wrote", *written)
    return 0 if all(s["ok"] for s in summaries) else 1


def main() -> int:
    args = parse_args()
    if args.rank_side:
        rank_side(args)
        return 0
    if os.geteuid() != 0:
        console.print("[red]soak.py needs root (network namespaces)[/]")
        return 1
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
