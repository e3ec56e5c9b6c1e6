"""Training under faults on the netns testbed: 4 ranks train the DLRM-like model
(hvd_sparse/tools/lab/dlrm.py) with the DDP hook while a thread of this driver cuts, degrades
and restores links and kills, stops and restarts the aggregator host
(hvd_sparse.tools.testbed.faults). Every bucket of every step is checked against a dense
float64 Gloo allreduce of the same local gradients. ``--front horovod``: the same under
Horovod elastic, where a worker may also be lost (below).

    python scripts/testbed/soak.py --matrix                 # each fault once, per scheme (a table)
    python scripts/testbed/soak.py --minutes 5 --seed 1     # faults drawn at random for 5 minutes
    python scripts/testbed/soak.py --front horovod --minutes 5 --seed 1 --first worker_lost

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

``--front horovod``: the ranks are workers of a Horovod elastic job (``horovodrun --gloo -np 4
--min-np 2`` through ``launch.run_elastic``: horovodrun in w0's namespace, an ssh shim into the
others'), written as Horovod's elastic docs write one: ``hvd_sparse.DistributedOptimizer``,
``hvd.elastic.TorchState(model=, optimizer=, step=0)``, a training function under
``@hvd.elastic.run`` committing every ``--commit-every`` steps. The fault kinds add
``worker_lost``: every process of a worker host other than w0 killed (SIGKILL) and the host off
the discovery list for 3-6 s, then listed again; the ranks left restore the last commit and go
on, and the job grows back to 4 when Horovod takes the host back (the next fault waits
``--regrow`` seconds more). ``--first worker_lost`` makes it the first fault. The check: each
rank copies its own gradients as backward makes them (a hook registered before the
optimizer's); after the optimizer's synchronize every reduced gradient must equal the mean of
every rank's copy (allgathered, summed in float64) within float32 rounding. A step's time runs
from the end of the step before, so that a reset and the steps it redoes count; a lost worker
is recovered at the first step back at 4 ranks under twice the median. The report adds the
resets (and what raised each), the least size, and the world size over time in the PNG.
Horovod's Gloo timeout is ``--gloo-timeout`` (the ranks left see a killed worker at it).
"""
from __future__ import annotations

import argparse
import collections
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
    p.add_argument("--front", choices=("ddp", "horovod"), default="ddp",
                   help="ddp: the DDP hook under torch.distributed; horovod: "
                        "hvd_sparse.DistributedOptimizer in a Horovod elastic job (horovodrun)")
    p.add_argument("--kinds", default="",
                   help="the soak's fault kinds to draw from (default: the link and aggregator "
                        "faults, and worker_lost with --front horovod)")
    p.add_argument("--first", default="",
                   help="the soak's first fault is of this kind (the others drawn)")
    p.add_argument("--regrow", type=float, default=30.0,
                   help="seconds more after a worker_lost before the next fault (its host's "
                        "new worker starts and the job grows back)")
    p.add_argument("--gloo-timeout", type=float, default=15.0,
                   help="--front horovod: Horovod's Gloo timeout (HOROVOD_GLOO_TIMEOUT_SECONDS): "
                        "the ranks left see a killed worker at it")
    p.add_argument("--commit-every", type=int, default=4,
                   help="--front horovod: steps between the elastic state's commits")
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
    kinds = faults.LINK + faults.AGGREGATOR + (faults.ELASTIC if args.front == "horovod" else ())
    args.kinds = [k for k in args.kinds.split(",") if k] or list(kinds)
    if unknown := ((set(args.schemes) - set(SCHEMES)) | (set(args.kinds) - set(kinds))
                   | ({args.first} - set(kinds) - {""})):
        p.error(f"unknown schemes or kinds {sorted(unknown)} (--front {args.front}: "
                f"{', '.join(kinds)})")
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


def rank_side_horovod(args: argparse.Namespace) -> None:
    """A worker of the Horovod elastic job: Horovod's elastic pattern as its docs write it
    (``hvd.elastic.TorchState(model=, optimizer=)``, a training function under
    ``@hvd.elastic.run`` committing every ``--commit-every`` steps) with
    ``hvd_sparse.DistributedOptimizer``, and the check after the optimizer's synchronize."""
    import horovod.torch as hvd
    import torch
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
    from torch import nn

    import hvd_sparse
    from hvd_sparse.tools.lab.dlrm import RecModel, batches

    out = Path(args.rank_side)
    host = os.environ.get("HOROVOD_HOSTNAME", "?")
    record = open(out / f"proc-{host}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
    hvd.init()
    torch.set_num_threads(1)
    hvd_sparse.init(probe="off", timeout=args.timeout, **json.loads(args.options))
    rows = [max(8, int(r * args.scale)) for r in
            (100_000, 150_000, 200_000, 250_000, 300_000, 350_000, 400_000, 500_000)]
    torch.manual_seed(0)
    model = RecModel(rows, args.dim, sparse=True)
    # this rank's own gradients of the step, before any reduction: hooks run in the order
    # they were registered, so these copies are taken before the optimizer's hook sends them
    raw: dict = {}
    for prm in model.parameters():
        prm.register_post_accumulate_grad_hook(
            lambda q: raw.__setitem__(q, q.grad.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = hvd_sparse.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    loss_fn = nn.BCEWithLogitsLoss()
    tables = list(model.tables.parameters())
    others = [q for q in model.parameters() if all(q is not t for t in tables)]
    offsets = [0]
    for n in rows:
        offsets.append(offsets[-1] + n)
    pools: dict[int, list] = {}
    planted = [False]

    def check(size: int) -> tuple[int, float]:
        """(parameters whose reduced gradient is not the float64 mean of the ranks' own,
        the worst relative difference): every rank's raw gradients allgathered, summed in
        float64 in rank order."""
        wrong, worst = 0, 0.0

        def compare(got: torch.Tensor, want: torch.Tensor) -> None:
            nonlocal wrong, worst
            scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
            worst = max(worst, float((got - want).abs().max()) / scale if want.numel() else 0)
            if not torch.allclose(got, want, rtol=RTOL, atol=ATOL * scale):
                wrong += 1

        flat = torch.cat([raw[q].reshape(-1) for q in others])
        ref = hvd.allgather(flat.unsqueeze(0), name="soak.ref.dense").double().sum(0) / size
        at = 0
        for q in others:
            compare(q.grad.double().reshape(-1), ref[at:at + q.numel()])
            at += q.numel()
        mine = [raw[t].coalesce() for t in tables]
        idx = torch.cat([g.indices()[0] + off for g, off in zip(mine, offsets, strict=False)])
        vals = torch.cat([g.values() for g in mine])
        all_idx = hvd.allgather(idx, name="soak.ref.rows")
        all_vals = hvd.allgather(vals, name="soak.ref.values")
        dense = torch.zeros(offsets[-1], args.dim, dtype=torch.float64)
        dense.index_add_(0, all_idx, all_vals.double())
        dense /= size
        for t, lo, hi in zip(tables, offsets, offsets[1:], strict=False):
            g = t.grad.coalesce().to_dense() if t.grad.is_sparse else t.grad
            compare(g.double(), dense[lo:hi])
        return wrong, worst

    def write(d: dict) -> None:
        record.write(json.dumps({**d, "pid": os.getpid(), "host": host}) + "\n")

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        rank, size = hvd.rank(), hvd.size()
        write({"event": "start", "rank": rank, "size": size, "step": state.step,
               "t": time.time()})
        pool = pools.setdefault(rank, batches(rank, rows, 8, args.batch, args.bag))
        try:
            steps(state, rank, size, pool)
        except (HorovodInternalError, HostsUpdatedInterrupt) as e:
            # what made hvd.elastic.run restore and reset (said in the report), then
            # raised on to it
            write({"event": "reset", "rank": rank, "step": state.step, "t": time.time(),
                   "why": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                          [:300]})
            raise

    def steps(state: hvd.elastic.TorchState, rank: int, size: int, pool: list) -> None:
        while True:
            ids, dense, y = pool[state.step % len(pool)]
            hvd_sparse.reset_metrics()
            t0 = time.time()
            raw.clear()
            opt.zero_grad()
            loss = loss_fn(model(ids, dense), y)
            loss.backward()
            opt.synchronize()
            if rank == 1 and state.step == args.corrupt and not planted[0]:
                planted[0] = True  # a wrong sum the check must count, once
                others[0].grad.view(-1)[0] += 1.0
            wrong, worst = check(size)
            with opt.skip_synchronize():
                opt.step()
            schemes = sorted({str(m["scheme"]) for m in hvd_sparse.metrics().values()
                              if "scheme" in m})
            stop = 1.0 if rank == 0 and (out / "stop").exists() else 0.0
            told = hvd.allgather(torch.tensor([[wrong, worst, stop]], dtype=torch.float64),
                                 name="soak.told")
            t1 = time.time()
            if rank == 0:
                write({"step": state.step, "rank": 0, "size": size, "t0": t0, "t1": t1,
                       "wrong": int(told[:, 0].sum()), "rel_err": float(told[:, 1].max()),
                       "loss": float(loss.detach()), "schemes": schemes})
                with open(out / "progress", "a") as f:
                    f.write(f"{state.step} {t1}\n")
            state.step += 1
            if told[:, 2].max() > 0:
                return
            if state.step % args.commit_every == 0:
                state.commit()

    try:
        train(state)
        digest = hashlib.sha256(b"".join(q.detach().numpy().tobytes()
                                         for q in model.parameters())).hexdigest()
        digests = hvd.allgather_object(digest)
        write({"event": "end", "rank": hvd.rank(), "size": hvd.size(), "digest": digest,
               "identical": len(set(digests)) == 1, "t": time.time()})
        hvd.barrier()  # every rank wrote its result before any leaves (a success ends the job)
    except Exception as e:  # noqa: BLE001 - counted: Horovod would drop this worker quietly
        write({"event": "error", "error": f"{type(e).__name__}: {e}"[:1000], "t": time.time()})
        record.close()
        sys.stdout.flush()
        os._exit(1)
    record.close()


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


def read_proc(path: Path) -> dict:
    """A Horovod worker process's record (proc-<host>-<pid>.jsonl): its lines (steps as rank
    0, starts of the training function, its end or error)."""
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            continue
    return {"name": path.stem, "lines": lines}


# ---- the driver -------------------------------------------------------------------------------

def matrix_schedule(args: argparse.Namespace) -> list[faults.Fault]:
    out, at = [], 0.0
    for kind, duration, rate in MATRIX:
        out.append(faults.Fault(kind, at=at, duration=duration, host="w1", rate=rate))
        at += duration + args.gap
    return out


def soak_schedule(args: argparse.Namespace, workers: int) -> list[faults.Fault]:
    """Faults drawn with ``args.seed`` until ``args.minutes`` less a gap is scheduled (the
    run's tail, a gap and the timeout, comes after): kind uniformly from ``args.kinds``, the
    worker at random, rates and durations in the ranges of the matrix's."""
    rng = random.Random(args.seed)
    end = args.minutes * 60 - args.warmup - args.gap
    out, at = [], 0.0
    while True:
        kind = args.first if args.first and not out else rng.choice(args.kinds)
        host = ("a0" if kind in faults.AGGREGATOR else
                f"w{rng.randrange(1, workers)}" if kind in faults.ELASTIC else
                f"w{rng.randrange(workers)}")
        duration = {"link_down": rng.uniform(1, 4), "agg_kill": rng.uniform(5, 15),
                    "agg_stop": 10.0}.get(kind, rng.uniform(3, 6))
        rate = {"loss": rng.uniform(0.05, 0.2), "dup": rng.uniform(0.05, 0.2),
                "reorder": rng.uniform(0.05, 0.2)}.get(kind, 0.0)
        if at + duration > end:
            return out
        out.append(faults.Fault(kind, at=round(at, 1), duration=round(duration, 1), host=host,
                                rate=round(rate, 3)))
        at += duration + args.gap * rng.uniform(1, 2)
        if kind in faults.ELASTIC:  # the host's new worker starts (imports, joins) meanwhile
            at += args.regrow


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
               str(args.bag), "--corrupt", str(args.corrupt), "--front", args.front,
               "--commit-every", str(args.commit_every)]
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HVD_SPARSE_CACHE_DIR": tmp,
               "HVD_SPARSE_FALLBACK": fallback}
        result: dict = {}
        limit = args.minutes * 60 * 4 + 600

        def job() -> None:
            try:
                if args.front == "horovod":
                    launch.list_hosts(tb)  # every worker host; worker_lost changes it
                    proc = launch.run_elastic(
                        tb, cmd, env={**env, "HOROVOD_GLOO_TIMEOUT_SECONDS":
                                      f"{args.gloo_timeout:g}",
                                      "HVD_SPARSE_LOG_LEVEL": "INFO"},  # joins, regroups
                        capture=True, timeout=limit, min_np=2)
                else:
                    proc = launch.run(tb, cmd, env=env, launcher="torch", capture=True,
                                      timeout=limit)
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
                    last = max((f.at + f.duration + (args.regrow if f.kind in faults.ELASTIC
                                                     else 0.0) for f in schedule), default=0.0)
                    # the tail: a reduction the last fault held runs to the timeout, then
                    # the job must show a step back to normal
                    end_at = now + last + args.gap + args.timeout
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
        procs = [read_proc(f) for f in sorted(out.glob("proc-*.jsonl"))]
        return {"scheme": scheme, "rc": result.get("rc"), "launch": result.get("launch", ""),
                "front": args.front, "procs": procs, "size": tb.workers,
                "output": result.get("output", ""),
                "hang": hang, "ranks": ranks, "faults": [f.as_dict() for f in inj.done],
                "injector_errors": inj.errors, "started": started}


def ddp_steps(job: dict) -> list[dict]:
    """The DDP job's steps: per step the earliest start and the latest end over the ranks, the
    wrong sums of all ranks, the schemes used."""
    ranks = job["ranks"]
    n = min((len(r["steps"]) for r in ranks), default=0)
    steps = []
    for i in range(n):
        per = [r["steps"][i] for r in ranks]
        steps.append({"t0": min(s["t0"] for s in per), "t1": max(s["t1"] for s in per),
                      "wrong": sum(s["wrong"] for s in per),
                      "rel_err": max(s["rel_err"] for s in per), "size": len(ranks),
                      "schemes": sorted({x for s in per for x in s["schemes"]})})
    return steps


def horovod_steps(job: dict) -> list[dict]:
    """The elastic job's steps as rank 0 saw them, in time order, each from the end of the one
    before (so that a reset, its restore and the steps it redid count in the next step's time);
    the wrong sums of all ranks (rank 0 gathered them), the job's size at the step."""
    lines = sorted((d for p in job["procs"] for d in p["lines"] if "t1" in d and
                    d.get("rank") == 0), key=lambda d: d["t1"])
    steps, prev = [], None
    for d in lines:
        steps.append({"t0": d["t0"] if prev is None else prev, "t1": d["t1"],
                      "wrong": d["wrong"], "rel_err": d["rel_err"], "size": d["size"],
                      "step": d["step"], "schemes": d["schemes"]})
        prev = d["t1"]
    return steps


def horovod_ranks(job: dict) -> tuple[list[str], list[dict], int]:
    """The elastic job's workers: (errors, the ends of the last membership's workers, resets
    of the training function on rank 0)."""
    errors, ends, starts = [], [], 0
    for p in job["procs"]:
        for d in p["lines"]:
            if d.get("event") == "error":
                errors.append(f"{p['name']}: {d['error']}")
            elif d.get("event") == "end":
                ends.append(d)
            elif d.get("event") == "start" and d.get("rank") == 0:
                starts += 1
    return errors, ends, max(0, starts - 1)


def reset_causes(job: dict) -> dict[str, int]:
    """Why rank 0's training function started again: the exceptions, counted by what they
    said (their type and first words)."""
    return dict(collections.Counter(d["why"][:120] for p in job["procs"] for d in p["lines"]
                                    if d.get("event") == "reset" and d.get("rank") == 0))


def analyse(job: dict) -> tuple[list[dict], dict]:
    """Per fault a row (steps overlapped, worst step, stall, recovery, wrong sums) and the
    job's summary."""
    horovod = job.get("front") == "horovod"
    steps = horovod_steps(job) if horovod else ddp_steps(job)
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
        # back: a step under twice the median, and for a lost worker at the full size again
        after = [s for s in steps if s["t0"] >= f["end"] and s["dt"] < 2 * median and
                 (f["kind"] not in faults.ELASTIC or s["size"] == job["size"])]
        back = after[0]["t1"] - f["end"] if after else math.nan
        hit = [s for s in steps if during(s, f, back if math.isfinite(back) else 0.0)]
        worst = max((s["dt"] for s in hit), default=math.nan)
        schemes = sorted({x for s in hit for x in s["schemes"]})
        rows.append({"scheme": job["scheme"], "fault": f["kind"], "host": f["host"],
                     "rate": f["rate"], "at_s": f["start"] - job["started"],
                     "for_s": f["end"] - f["start"], "steps": len(hit),
                     "worst_step_s": worst, "stall_s": worst - median,
                     "recovered_s": back, "wrong": sum(s["wrong"] for s in hit),
                     "least_size": min((s["size"] for s in hit), default=0),
                     "schemes": ",".join(schemes), "error": f["error"],
                     "outcome": "ok" if math.isfinite(back) and not f["error"] else
                     "not recovered" if not f["error"] else "injector failed"})
    if horovod:
        errors, ends, resets = horovod_ranks(job)
        identical = len(ends) == job["size"] and all(e["identical"] for e in ends)
        finished = len(ends)
    else:
        errors = [f"rank {r['rank']}: {r['error']}" for r in job["ranks"] if r["error"]]
        identical = all(r.get("identical") for r in job["ranks"]) and len(job["ranks"]) > 0
        finished, resets = len(job["ranks"]), 0
    summary = {"front": job.get("front", "ddp"), "scheme": job["scheme"], "steps": len(steps),
               "median_step_s": median, "faults": len(fs),
               "recovered": sum(r["outcome"] == "ok" for r in rows),
               "wrong_sums": sum(s["wrong"] for s in steps),
               "worst_rel_err": max((s["rel_err"] for s in steps), default=math.nan),
               "hangs": int(bool(job["hang"])), "errors": len(errors), "resets": resets,
               "least_size": min((s["size"] for s in steps), default=0),
               "worst_stall_s": max((r["stall_s"] for r in rows), default=math.nan),
               "identical": identical, "ranks": finished, "rc": job["rc"], "hang": job["hang"],
               "error": "; ".join(errors) or job["launch"],
               "injector_errors": job["injector_errors"]}
    if horovod:
        summary["reset_causes"] = reset_causes(job)
    summary["ok"] = (summary["wrong_sums"] == 0 and not summary["hangs"]
                     and not summary["errors"] and summary["identical"] and job["rc"] == 0
                     and summary["recovered"] == summary["faults"])
    job["steps"] = steps
    return rows, summary


def plot(jobs: list[dict], path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    colours = {"link_down": "tab:red", "loss": "tab:orange", "dup": "tab:purple",
               "reorder": "tab:blue", "agg_kill": "black", "agg_stop": "tab:gray",
               "worker_lost": "tab:brown"}
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
        if job.get("front") == "horovod":  # the world size over time
            size = ax.twinx()
            size.step([s["t1"] - t0 for s in steps], [s["size"] for s in steps], where="pre",
                      color="tab:olive", lw=0.8)
            size.set_ylim(0, job["size"] + 0.5)
            size.set_ylabel("ranks", fontsize=8, color="tab:olive")
    axes[-1, 0].set_xlabel("seconds since training started (shaded: a fault in force)")
    fig.suptitle(title, fontsize=8)
    return save_png(fig, path)


COLS = ["scheme", "fault", "host", "rate", "at_s", "for_s", "steps", "worst_step_s", "stall_s",
        "recovered_s", "wrong", "schemes", "outcome"]
SUMMARY = ["front", "scheme", "steps", "median_step_s", "faults", "recovered", "wrong_sums",
           "worst_rel_err", "hangs", "errors", "resets", "least_size", "worst_stall_s",
           "identical", "ok"]


def drive(args: argparse.Namespace) -> int:
    from hvd_sparse.tools.testbed import lifecycle
    from hvd_sparse.tools.testbed.topology import Testbed

    jobs: list[dict] = []
    # an elastic job's size changes: the aggregator takes a job of any size
    tb = lifecycle.up(Testbed(args.name, workers=4, aggregators=1, rate=args.rate, mtu=9000,
                              aggregator_workers=0 if args.front == "horovod" else -1))
    try:
        if args.matrix:
            for scheme in args.schemes:
                console.rule(f"{scheme}: {', '.join(f.label() for f in matrix_schedule(args))}")
                jobs.append(run_job(tb, args, scheme, matrix_schedule(args), fallback="error"))
        else:
            schedule = soak_schedule(args, tb.workers)
            console.rule(f"soak: {args.front}, {args.minutes:g} min, seed {args.seed}, "
                         f"{args.scheme}, {len(schedule)} faults")
            jobs.append(run_job(tb, args, args.scheme, schedule, fallback="dense"))
    finally:
        lifecycle.down(args.name)
    rows, summaries = [], []
    for job in jobs:
        r, s = analyse(job)
        rows += r
        summaries.append(s)
    horovod = args.front == "horovod"
    what = "matrix" if args.matrix else f"soak-{'horovod-' if horovod else ''}{args.seed}"
    front = ("hvd_sparse.DistributedOptimizer, Horovod elastic (horovodrun, min 2 ranks)"
             if horovod else "DDP hook")
    caption = (f"4 ranks on 4 emulated hosts + 1 aggregator host at {args.rate}, {front}, "
               f"DLRM-like tables x{args.scale:g} (dim {args.dim}, batch {args.batch}/rank); "
               "stall: worst step during a fault minus the median fault-free step")
    written = [write_json(args.out_dir / f"{what}.json", rows, summaries=summaries,
                          jobs=[{k: v for k, v in j.items() if k not in
                                 ("ranks", "procs", "output")} for j in jobs], args=vars(args)),
               plot(jobs, args.out_dir / f"{what}.png", caption)]
    for job in jobs:  # the ranks' own output, for what went wrong
        log = args.out_dir / f"{what}-{job['scheme']}.log"
        log.write_text(job["output"])
        written.append(log)
    print_table(rows, f"Training under {'worker, ' if horovod else ''}link and aggregator "
                f"faults ({what})", COLS + (["least_size"] if horovod else []), caption)
    print_table(summaries, "Per job", SUMMARY)
    for s in summaries:
        if s.get("reset_causes"):
            console.print(f"{s['scheme']}: resets: {s['reset_causes']}", markup=False)
        for k in ("hang", "error", "injector_errors"):
            if s[k]:
                console.print(f"{s['scheme']}: {k}: {s[k]}", style="red", markup=False)
    print("wrote", *written)
    return 0 if all(s["ok"] for s in summaries) else 1


def main() -> int:
    args = parse_args()
    if args.rank_side:
        (rank_side_horovod if args.front == "horovod" else rank_side)(args)
        return 0
    if os.geteuid() != 0:
        console.print("[red]soak.py needs root (network namespaces)[/]")
        return 1
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
