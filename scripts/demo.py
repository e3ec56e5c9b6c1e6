"""hvd-sparse demo: dense vs sparse gradient sync on a synthetic click-through model.

``make demo`` runs ``python scripts/demo.py``, which launches itself: as root on a machine
with network namespaces, on a testbed of 4 worker hosts and 1 aggregator host joined by
1 Gbit/s links (hvd-sparse testbed, Open MPI); elsewhere on loopback under horovodrun, with a
one-line reason. Under a launcher already it just runs::

    horovodrun -np 4 -H localhost:4 --gloo python scripts/demo.py

Every rank trains the same embedding + MLP model on its own shard of Zipf-distributed ids,
twice and back to back: first with Horovod's dense allreduce, then with hvd_sparse. The
embedding gradients are dense tensors (``sparse=False``) that are mostly zero because a batch
touches few rows; that is exactly what hvd_sparse exploits. Rank 0 reports sync/step times,
the scheme hvd_sparse picked per tensor, and checks that both runs reach the same losses and
parameters; the exit status is non-zero when they do not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

import hvd_sparse
from hvd_sparse import runfile
from hvd_sparse.tools.lab.demo_report import (
    LOSS_RTOL,
    PARAM_ATOL,
    PARAM_RTOL,
    fmt_bytes,
    plot,
    report,
)
from hvd_sparse.tools.workload import FIELDS, CTRModel, Shard, make_shard, vocab_sizes

EVAL_ROWS = 8192


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps per run")
    p.add_argument("--batch-size", type=int, default=512, help="examples per rank per step")
    p.add_argument("--dim", type=int, default=32, help="embedding dimension")
    p.add_argument("--scale", type=float, default=1.0, help="multiplier on vocabulary sizes")
    p.add_argument(
        "--scheme",
        choices=("auto", "dense", "allgather", "zen"),
        default="auto",
        help="hvd_sparse scheme for the sparse run",
    )
    p.add_argument("--block-size", type=int, default=256, help="hvd_sparse block size")
    p.add_argument(
        "--optimizer",
        choices=("horovod", "hvd_sparse"),
        default="horovod",
        help="sparse run: hvd.DistributedOptimizer + Compression.sparse, "
        "or hvd_sparse.DistributedOptimizer",
    )
    # SGD by default: its update is linear in the gradient, so float-rounding differences
    # between two reduction orders stay at rounding level. Adagrad's g / sqrt(sum g^2) blows
    # them up on near-zero gradients, and can fail the allclose check even dense vs dense.
    p.add_argument("--optim", choices=("sgd", "adagrad"), default="sgd")
    p.add_argument("--lr", type=float, default=None, help="default: 2.0 sgd, 0.05 adagrad")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps of each path before the timed runs"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_results/demo.json"))
    args = p.parse_args()
    if args.lr is None:
        args.lr = 0.05 if args.optim == "adagrad" else 2.0
    if args.steps < 1 or not 0 <= args.warmup <= args.steps:
        p.error("need --steps >= 1 and 0 <= --warmup <= --steps")
    return args


def build_model(args: argparse.Namespace, sizes: list[int]) -> CTRModel:
    torch.manual_seed(args.seed)
    model = CTRModel(sizes, args.dim)
    # Same seed already gives the same init everywhere; the broadcast makes it a guarantee.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


def base_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    if args.optim == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=args.lr)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class RunResult:
    name: str
    path: str  # how gradients are synchronized
    sync_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # per step, averaged over ranks
    eval_loss: float = math.nan  # after training, averaged over ranks
    bytes_per_step: float | None = None  # per rank; None where not measured
    bytes_note: str = ""
    rx_per_step: float | None = None  # bytes a worker host's link received (testbed only)
    link_util: float | None = None  # those bits over the run's time and the link rate
    tensors: list[dict[str, Any]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def stats(self) -> dict[str, float]:
        return {
            "sync_ms_median": statistics.median(self.sync_ms),
            "step_ms_median": statistics.median(self.step_ms),
            "final_loss": self.loss[-1],
            "eval_loss": self.eval_loss,
        }


def mean_over_ranks(values: list[float] | float, name: str) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return hvd.allreduce(t, op=hvd.Average, name=name)


def evaluate(model: CTRModel, shard: Shard, name: str) -> float:
    with torch.no_grad():
        loss = model.loss(shard.ids, shard.dense, shard.label)
    return float(mean_over_ranks(loss.item(), name))


def make_optimizer(kind: str, args: argparse.Namespace, model: nn.Module) -> Any:
    """The distributed optimizer of one path: "dense" or "sparse"."""
    named = list(model.named_parameters())
    base = base_optimizer(args, model)
    if kind == "dense":
        return hvd.DistributedOptimizer(
            base, named_parameters=named, compression=hvd.Compression.none
        )
    if args.optimizer == "horovod":
        compression = hvd_sparse.Compression.sparse(scheme=args.scheme, block_size=args.block_size)
        return hvd.DistributedOptimizer(base, named_parameters=named, compression=compression)
    return hvd_sparse.DistributedOptimizer(
        base, named_parameters=named, scheme=args.scheme, block_size=args.block_size
    )


def train_step(model: CTRModel, opt: Any, data: Shard, step: int,
               batch: int) -> tuple[float, float, float]:
    """One step; returns (local loss, sync ms, step ms)."""
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = model.loss(*data.batch(step, batch))
    loss.backward()
    # Reductions start from backward hooks; synchronize() waits for whatever is left.
    t1 = time.perf_counter()
    opt.synchronize()
    t2 = time.perf_counter()
    with opt.skip_synchronize():
        opt.step()
    t3 = time.perf_counter()
    return loss.item(), (t2 - t1) * 1e3, (t3 - t0) * 1e3


def warm_up(args: argparse.Namespace, sizes: list[int], data: Shard) -> None:
    """Untimed steps of both paths on throwaway models, so neither timed run pays for first
    touches the other then gets for free: allocator growth, Horovod's fusion buffer and
    response cache, Gloo connections, hvd_sparse's buffers."""
    for kind in ("dense", "sparse"):
        model = build_model(args, sizes)
        opt = make_optimizer(kind, args, model)
        for step in range(args.warmup):
            train_step(model, opt, data, step, args.batch_size)


def train(
    run: RunResult,
    args: argparse.Namespace,
    model: CTRModel,
    opt: Any,
    train_data: Shard,
    eval_data: Shard,
    progress: Progress,
    log: Callable[[str], None],
) -> None:
    task = progress.add_task(f"{run.name:>6}", total=args.steps, loss=math.nan, sync=math.nan)
    log_every = max(1, args.steps // 8)
    local_loss: list[float] = []
    hvd.barrier()  # start the clock with every rank at the same point
    rx0 = rx_bytes()
    for step in range(args.steps):
        loss, sync_ms, step_ms = train_step(model, opt, train_data, step, args.batch_size)
        local_loss.append(loss)
        run.sync_ms.append(sync_ms)
        run.step_ms.append(step_ms)
        progress.update(task, advance=1, loss=loss, sync=sync_ms)
        if (step + 1) % log_every == 0 or step + 1 == args.steps:
            log(
                f"{run.name:>6} step {step + 1:3d}/{args.steps}  loss {loss:.4f}  "
                f"sync {sync_ms:7.1f} ms  step {step_ms:7.1f} ms"
            )
    rx1 = rx_bytes()
    if rx0 is not None and rx1 is not None:  # on the testbed: what the links really carried
        rate = runfile.parse_rate(os.environ["HVD_SPARSE_LINK_RATE"])
        run.rx_per_step = float(mean_over_ranks((rx1 - rx0) / args.steps, f"demo.{run.name}.rx"))
        run.link_util = run.rx_per_step * 8 / (statistics.mean(run.step_ms) / 1e3) / rate
    run.loss = mean_over_ranks(local_loss, f"demo.{run.name}.loss").tolist()
    run.eval_loss = evaluate(model, eval_data, f"demo.{run.name}.eval")
    run.params = {k: v.detach().clone() for k, v in model.named_parameters()}


def rx_bytes() -> int | None:
    """Bytes this host's link has received, on the testbed (each rank is a host there)."""
    if "HVD_SPARSE_TESTBED" not in os.environ:
        return None
    try:
        return int(Path("/sys/class/net/eth0/statistics/rx_bytes").read_text())
    except OSError:
        return None


def param_for_metric(metric_name: str, param_names: list[str]) -> str | None:
    """Horovod's allreduce names contain the parameter name; take the longest that matches."""
    hits = [p for p in param_names if p in metric_name]
    return max(hits, key=len) if hits else None


def collect_sparse_metrics(run: RunResult, model: nn.Module) -> None:
    """Per-tensor records of the sparse run; hvd_sparse keeps each tensor's *last* call."""
    shapes = {k: list(v.shape) for k, v in model.named_parameters()}
    local_bytes = 0
    for metric_name, m in sorted(hvd_sparse.metrics().items()):
        param = param_for_metric(metric_name, list(shapes))
        local_bytes += int(m.get("bytes_sent", 0))
        run.tensors.append(
            {
                "metric_name": metric_name,
                "param": param,
                "shape": shapes.get(param) if param else None,
                **m,
            }
        )
    # Each rank's volume depends on its own data; report the mean over ranks.
    run.bytes_per_step = float(mean_over_ranks(float(local_bytes), "demo.bytes"))
    run.bytes_note = "hvd_sparse.metrics() bytes_sent of the last step, mean over ranks"


def compare(dense: RunResult, sparse: RunResult) -> dict[str, Any]:
    """Checks on this rank; the caller combines the verdicts of all ranks."""
    max_abs, max_rel, close = 0.0, 0.0, True
    worst = ""
    for k, a in dense.params.items():
        b = sparse.params[k]
        diff = (a - b).abs()
        if diff.numel() and diff.max().item() > max_abs:
            max_abs, worst = diff.max().item(), k
        max_rel = max(max_rel, (diff / a.abs().clamp_min(PARAM_ATOL)).max().item())
        close &= torch.allclose(b, a, rtol=PARAM_RTOL, atol=PARAM_ATOL)

    def rel(x: float, y: float) -> float:
        return abs(x - y) / max(abs(x), 1e-12)

    loss_rel = rel(dense.loss[-1], sparse.loss[-1])
    eval_rel = rel(dense.eval_loss, sparse.eval_loss)
    return {
        "final_loss_rel_diff": loss_rel,
        "eval_loss_rel_diff": eval_rel,
        "loss_ok": loss_rel < LOSS_RTOL and eval_rel < LOSS_RTOL,
        "params_max_abs_diff": max_abs,
        "params_max_rel_diff": max_rel,
        "params_worst_tensor": worst,
        "params_allclose": bool(close),
    }


# ---------------------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    # Four ranks share two cores: extra intra-op threads only fight each other (set before
    # hvd_sparse.init(), which times the collectives).
    torch.set_num_threads(1)
    hvd.init()
    hvd_sparse.init()
    rank = hvd.rank()

    # Only rank 0 talks, in 80 columns (or $COLUMNS): under horovodrun stdout is a pipe, so
    # rich draws no live bar and cannot ask the terminal its width.
    console = Console(quiet=rank != 0, width=int(os.environ.get("COLUMNS", "80")))

    def log(msg: str) -> None:
        # A live bar shows progress on a terminal; through a pipe, print a line now and then.
        if not console.is_terminal:
            console.print(msg)

    sizes = vocab_sizes(args.scale)
    train_data = make_shard(args.seed, rank, args.steps * args.batch_size, sizes, tag=0)
    eval_data = make_shard(args.seed, rank, EVAL_ROWS, sizes, tag=1)
    n_params = sum(sizes) * args.dim
    if rank == 0:
        console.print(
            f"hvd-sparse demo: {hvd.size()} ranks; {len(FIELDS)} embedding tables, "
            f"{sum(sizes):,} rows x {args.dim} = {fmt_bytes(n_params * 4)} of gradient; "
            f"batch {args.batch_size}/rank; {args.optim} (lr {args.lr}); {args.warmup} untimed "
            f"warm-up steps per path, then {args.steps} timed steps per run"
        )

    sparse_desc = (
        f"hvd + hvd_sparse.Compression.sparse({args.scheme})"
        if args.optimizer == "horovod"
        else f"hvd_sparse.DistributedOptimizer({args.scheme})"
    )
    runs = [
        RunResult("dense", "hvd + Compression.none"),
        RunResult("sparse", sparse_desc),
    ]
    eval0 = math.nan
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  sync {task.fields[sync]:7.1f} ms"),
        TimeElapsedColumn(),
        console=console,
        refresh_per_second=4,
    )
    try:
        warm_up(args, sizes, train_data)
        with progress:
            for run in runs:
                model = build_model(args, sizes)
                if run.name == "dense":
                    eval0 = evaluate(model, eval_data, "demo.eval0")
                opt = make_optimizer(run.name, args, model)
                hvd_sparse.reset_metrics()
                train(run, args, model, opt, train_data, eval_data, progress, log)
                if run.name == "dense":
                    # The ring model hvd_sparse's metrics use for its own dense scheme: each
                    # rank sends 2 (n - 1) / n of the gradient bytes.
                    payload = sum(p.numel() * p.element_size() for p in model.parameters())
                    run.bytes_per_step = 2 * (hvd.size() - 1) / hvd.size() * payload
                    run.bytes_note = "ring allreduce model, 2 (n - 1) / n x gradient bytes"
                else:
                    collect_sparse_metrics(run, model)
                del opt, model

        checks = compare(*runs)
        # Every rank compares its own copies; a failure anywhere fails the demo.
        bad = hvd.allreduce(
            torch.tensor([float(not checks["params_allclose"])]), op=hvd.Sum, name="demo.bad"
        )
        checks["params_allclose_all_ranks"] = bool(bad.item() == 0)
        checks["params_max_abs_diff"] = float(
            hvd.allreduce(
                torch.tensor([checks["params_max_abs_diff"]]), op=hvd.Max, name="demo.maxdiff"
            )
        )
        checks["ok"] = checks["loss_ok"] and checks["params_allclose_all_ranks"]

        if rank == 0:
            summary = report(console, args, runs, checks, eval0)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(summary, indent=2) + "\n")
            picture = args.out.with_suffix(".png")
            plot(runs, picture)
            verdict = (
                "[green]OK[/]: runs agree" if checks["ok"] else "[bold red]FAILED[/]: runs differ"
            )
            console.print(f"{verdict}; summary in {args.out}, picture in {picture}")
        return 0 if checks["ok"] else 1
    finally:
        hvd_sparse.shutdown()


def launch(argv: list[str]) -> int:
    """``make demo``: the demo on emulated hosts when this machine can host them, else on
    loopback. Either way the sparse run's calls go to bench_results/demo_run.json
    (``hvd-sparse analyze`` reads it)."""
    root = Path(__file__).resolve().parents[1]
    env = {"OMP_NUM_THREADS": "1",
           "HVD_SPARSE_METRICS_FILE": str(root / "bench_results" / "demo_run.json")}
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    try:
        from hvd_sparse.tools.testbed import launch as testbed
        from hvd_sparse.tools.testbed import lifecycle
        from hvd_sparse.tools.testbed.topology import Testbed

        lifecycle.down("hvdemo")  # what a killed demo may have left
        tb = lifecycle.up(Testbed("hvdemo", workers=4, aggregators=1, rate="1gbit", mtu=9000))
    except Exception as e:  # noqa: BLE001 - any reason to fall back is reported, not raised
        print(f"[demo] on loopback under horovodrun: no testbed here ({e})", flush=True)
        runner = shutil.which("horovodrun") or str(Path(sys.executable).parent / "horovodrun")
        return subprocess.call([runner, "-np", "4", "-H", "localhost:4", "--gloo", *cmd],
                               env={**os.environ, **env})
    print("[demo] on emulated hosts: 4 workers + 1 aggregator host, 1 Gbit/s links, MTU 9000 "
          "(hvd-sparse testbed; Open MPI)", flush=True)
    try:
        return testbed.run(tb, cmd, env=env).returncode
    finally:
        lifecycle.down("hvdemo")


if __name__ == "__main__":
    under_launcher = any(k in os.environ for k in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"))
    sys.exit(main() if under_launcher else launch(sys.argv[1:]))
