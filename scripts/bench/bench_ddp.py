"""Embedding-heavy training step under PyTorch DDP (Gloo, CPU): DDP's own paths and hooks
against hvd_sparse's DDP hook.

The DLRM-like model of bench_embedding.py (hvd_sparse/tools/lab/dlrm.py: 8 ``nn.EmbeddingBag``
tables, 100k-500k rows x 64 times --scale, bottom and top MLPs), batch 2048 per rank x 4 ids per
bag, SGD. Every method trains the same model from the same start on the same batches, one after
another in one run:

- ddp dense: tables ``sparse=False``, no hook (DDP's bucketed allreduce)
- ddp sparse: tables ``sparse=True``, no hook (DDP's sparse path: Gloo's sparse allreduce, an
  allgather of every rank's rows)
- fp16 hook: dense tables, ``default_hooks.fp16_compress_hook`` (lossy)
- powersgd r1, r4: dense tables, ``powerSGD_hook`` of rank 1 and 4 from step --warmup on (lossy;
  one bucket at a time: see OneBucketAtATime)
- ours rows: tables ``sparse=True``, ``hvd_sparse.ddp.hook`` with scheme "auto" (sparse
  buckets go by rows)
- ours rows agg: the same with scheme "omnireduce" (the rows summed at the aggregators)
- ours rows allgather: the same with scheme "allgather" (no trial of aggregation: against
  "ours rows" over the first steps, with --warmup 0, what auto's trial costs)
- ours rows bf16: "ours rows" with the rows' values as bfloat16 on the wire (``wire="bf16"``;
  lossy: summed in float32, rounded to bfloat16 once)
- ours blocks: dense tables, ``hvd_sparse.ddp.hook`` with scheme "auto" (blocks of the bucket)
- local dense / local sparse: no DDP, no communication: the step's compute alone, which tells
  how much of each method's step is exposed communication

Per method: the median over --steps of the slowest rank's step (forward + backward, which
waits for DDP's reductions, + the optimizer's step); "exposed sync": the step minus the local
step of the same table kind; MB each rank sent per step (measured on $GLOO_SOCKET_IFNAME when
it is set, as on the testbed; ours: also hvd_sparse.metrics()) and "exposed / wire", the
exposed sync over those bytes' time at $HVD_SPARSE_LINK_RATE; "steps_s", the timed steps
together; for ours, the schemes it ran and, in the JSON and on stderr, the last step's
buckets by stage (``stages_ms``); and the largest difference of the final parameters from ddp
dense's (lossless methods must agree to float rounding).
Table to stdout, progress to stderr, JSON and PNG to --out-dir.

    .venv/bin/torchrun --standalone --nproc-per-node=4 scripts/bench/bench_ddp.py [--ids hot]
    hvd-sparse testbed run --launcher torch -- python scripts/bench/bench_ddp.py --ids hot
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import hvd_sparse
from hvd_sparse import ddp
from hvd_sparse.tools.lab.dlrm import Batch, RecModel, add_args, bag_label, workload
from hvd_sparse.tools.lab.report import print_table, save_png, write_json

# method -> (tables sparse, communication: "ddp", "fp16", "powersgd1", "powersgd4",
# "ours:SCHEME",
# "local" for none)
METHODS: dict[str, tuple[bool, str]] = {
    "ddp dense": (False, "ddp"),
    "ddp sparse": (True, "ddp"),
    "fp16 hook": (False, "fp16"),
    "powersgd r1": (False, "powersgd1"),
    "powersgd r4": (False, "powersgd4"),
    "ours rows": (True, "ours:auto"),
    "ours rows agg": (True, "ours:omnireduce"),
    "ours rows allgather": (True, "ours:allgather"),
    "ours rows bf16": (True, "ours:auto:bf16"),  # rows as bfloat16 on the wire (lossy)
    "ours blocks": (False, "ours:auto"),
    "local dense": (False, "local"),
    "local sparse": (True, "local"),
}
REFERENCE = "ddp dense"
LOSSLESS = ("ddp sparse", "ours rows", "ours rows agg", "ours rows allgather", "ours blocks")
TOLERANCE = 1e-5  # float rounding of sums in another order over a few steps
NAN = float("nan")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p, scale=0.25)
    p.add_argument("--steps", type=int, default=5, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=4,
                   help="untimed steps first (DDP rebuilds its buckets after the first; "
                        "PowerSGD compresses from this step on; ours: auto tries both ways "
                        "for a sparse bucket in its first 4 calls)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    p.add_argument("--probe", default="auto", choices=("auto", "force", "off"),
                   help="hvd_sparse's network probe (auto: cached per network)")
    p.add_argument("--fuse-mb", type=float, default=1.0,
                   help="ours: sparse buckets whose last results together stay under this are "
                        "reduced as one (hvd_sparse.ddp.State's fuse_mb)")
    p.add_argument("--streams", type=int, default=2,
                   help="ours: buckets reduced at once (hvd_sparse.ddp.State's streams)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out-dir", type=Path, default=Path("bench_results/ddp"))
    args = p.parse_args()
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    args.methods = [m for m in METHODS if m in args.methods.split(",")]
    args.warmup = max(args.warmup, 1)
    return args


def progress(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def tx_bytes() -> float:
    """What this host sent on the interface Gloo uses (NaN where it is not named: on one
    host, loopback carries every rank's traffic and more)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        return float(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())
    except (OSError, TypeError, ValueError):
        return NAN


class OneBucketAtATime:
    """PowerSGD's hook issues its P and Q allreduces from Gloo's completion callbacks and waits
    for them there: with several buckets in flight the ranks issue them in different orders,
    or Gloo's worker threads all wait, and the job hangs (here: 15 minutes without CPU time at
    6 buckets). A bucket's hook waits until the one before is reduced."""

    def __init__(self, state: powerSGD_hook.PowerSGDState) -> None:
        self.state = state
        self.last: torch.futures.Future | None = None


# No annotations: DDP checks a hook's annotations as objects, and this module's are strings.
def one_bucket_at_a_time(s, bucket):  # noqa: ANN001, ANN201
    if s.last is not None:
        s.last.wait()
    s.last = powerSGD_hook.powerSGD_hook(s.state, bucket)
    return s.last


def wrap(method: str, model: nn.Module, args: argparse.Namespace
         ) -> tuple[nn.Module, Callable[[], None]]:
    """The model as the method trains it, and what releases the method's state."""
    comm = METHODS[method][1]
    if comm == "local":
        return model, lambda: None
    m = DDP(model, bucket_cap_mb=args.bucket_mb)
    if comm == "fp16":
        m.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif comm.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(comm[-1]),
            start_powerSGD_iter=max(2, args.warmup))
        m.register_comm_hook(OneBucketAtATime(state), one_bucket_at_a_time)
    elif comm.startswith("ours"):
        # Collective: every rank makes it here, in the same order of methods.
        _, scheme, *wire = comm.split(":")
        ours = ddp.State(scheme=scheme, probe=args.probe, streams=args.streams,
                         fuse_mb=args.fuse_mb, wire=wire[0] if wire else "")
        m.register_comm_hook(ours, ddp.hook)
        return m, ours.close
    return m, lambda: None


def run(method: str, model: nn.Module, data: list[Batch], args: argparse.Namespace
        ) -> dict[str, object]:
    sparse, comm = METHODS[method]
    model.set_sparse(sparse)
    net, close = wrap(method, model, args)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss()
    times: list[list[float]] = []  # per timed step: step, forward+backward, update
    sent0 = NAN
    for i, (ids, dense, y) in enumerate(data):
        if i == len(data) - 1:
            hvd_sparse.reset_metrics()  # the buckets' figures below: the last step's
        if i == args.warmup:
            sent0 = tx_bytes()
            progress(f"  {method}: {args.warmup} warm-up step(s) done")
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(net(ids, dense), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= args.warmup:
            times.append([t2 - t0, t1 - t0, t2 - t1])
    sent = (tx_bytes() - sent0) / args.steps
    close()
    # The slowest rank's time of each step, after the loop: no extra collective inside it.
    slow = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slow, dist.ReduceOp.MAX)
    ms = lambda col: statistics.median(slow[:, col].tolist()) * 1e3  # noqa: E731
    res: dict[str, object] = {"step_ms": ms(0), "fwd+bwd_ms": ms(1), "update_ms": ms(2),
                              "MB sent/step": sent / 1e6,
                              "steps_s": float(slow[:, 0].sum())}  # all timed steps
    res.update({"ours exchange_ms": NAN, "ours MB sent": NAN, "schemes": "-"})
    if comm.startswith("ours"):
        buckets = {k: v for k, v in hvd_sparse.metrics().items() if k.startswith("ddp.")}
        # the last step's reductions, on the hook's streams
        res["ours exchange_ms"] = sum(v.get("seconds", 0.0) for v in buckets.values()) * 1e3
        res["ours MB sent"] = sum(v.get("bytes_sent", 0) for v in buckets.values()) / 1e6
        res["schemes"] = ",".join(sorted({str(v.get("scheme")) for v in buckets.values()}))
        res["buckets"] = {k: {f: v.get(f) for f in ("scheme", "seconds", "bytes_sent",
                                                   "rows_local", "union", "block_density")}
                          for k, v in sorted(buckets.items())}  # the JSON's, not the table's
        stages: dict[str, float] = {}  # the last step's time by stage, over its buckets
        for v in buckets.values():
            for stage, t in v.get("stages_ms", {}).items():
                stages[stage] = stages.get(stage, 0.0) + t
        res["stages_ms"] = {k: round(t, 1) for k, t in sorted(stages.items())}
        progress(f"  {method}: last step's buckets by stage, ms: {res['stages_ms']}")
    progress(f"  {method}: {args.steps} timed step(s), median {res['step_ms']:,.0f} ms "
             "(slowest rank)")
    return res


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # ranks share the cores
    rank, size = dist.get_rank(), dist.get_world_size()
    rows, data = workload(args, rank)
    torch.manual_seed(0)
    start = RecModel(rows, args.dim, sparse=False)
    progress(f"bench_ddp: {size} ranks, {len(rows)} tables ({sum(rows):,} rows x {args.dim}, "
             f"{sum(rows) * args.dim * 4 / 2**20:,.0f} MiB), {args.ids} ids, "
             f"{len(args.methods)} methods x {args.warmup}+{args.steps} steps")
    results, finals = [], {}
    for k, method in enumerate(args.methods):
        progress(f"[{k + 1}/{len(args.methods)}] {method}")
        model = copy.deepcopy(start)
        res = run(method, model, data, args)
        finals[method] = {n: p.detach().clone() for n, p in model.state_dict().items()}
        results.append({"method": method, **res})
        del model
    ref = finals.get(REFERENCE)
    native = next((r["step_ms"] for r in results if r["method"] == "ddp sparse"), NAN)
    local = {sparse: next((r["step_ms"] for r in results
                           if METHODS[r["method"]] == (sparse, "local")), NAN)
             for sparse in (False, True)}
    rate = os.environ.get("HVD_SPARSE_LINK_RATE")
    for r in results:
        sparse, comm = METHODS[r["method"]]
        d = max_diff(finals[r["method"]], ref) if ref is not None and comm != "local" else NAN
        r["max |Δ| vs ddp dense"] = d
        r["lossless"] = (d <= TOLERANCE) if r["method"] in LOSSLESS and ref is not None else "-"
        r["exposed sync_ms"] = r["step_ms"] - local[sparse] if comm != "local" else NAN
        # the wire time of what the rank sent, at the link's rate (known on the testbed)
        wire_ms = r["MB sent/step"] * 8e9 / float(rate) if rate else NAN
        r["exposed / wire"] = r["exposed sync_ms"] / wire_ms if wire_ms else NAN
        r["x vs ddp sparse"] = native / r["step_ms"]
    if rank != 0:
        dist.destroy_process_group()
        return
    where = os.environ.get("GLOO_SOCKET_IFNAME", "loopback")
    caption = (f"{size} ranks ({where}{f', {int(rate) / 1e9:g} Gbit/s' if rate else ''}), "
               f"{len(rows)} tables ({min(rows):,}-{max(rows):,} rows x {args.dim}), batch "
               f"{args.batch}/rank x {bag_label(args)} ids, {args.ids} ids; median of {args.steps} "
               "steps, slowest rank")
    cols = ["method", "step_ms", "fwd+bwd_ms", "update_ms", "exposed sync_ms", "MB sent/step",
            "exposed / wire", "steps_s", "ours MB sent", "schemes", "max |Δ| vs ddp dense",
            "lossless", "x vs ddp sparse"]
    print_table(results, "Embedding-heavy training step under DDP", cols, caption=caption)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [r["method"] for r in results][::-1]
    by = {r["method"]: r for r in results}
    ax.barh(names, [by[n]["step_ms"] for n in names], label="step")
    ax.barh(names, [by[n]["exposed sync_ms"] for n in names], label="exposed sync")
    ax.set_xlabel("ms (median, slowest rank)")
    ax.set_title(caption, fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    stem = f"ddp-{args.ids}"
    print("wrote", write_json(args.out_dir / f"{stem}.json", results, args=vars(args),
                              ranks=size, network=where, link_rate=rate),
          save_png(fig, args.out_dir / f"{stem}.png"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
