"""DLRM-like tables trained data-parallel (DDP's native sparse path, hvd_sparse's DDP hook)
against model-parallel (TorchRec's DistributedModelParallel, the tables sharded by its
planner), on CPU over Gloo: which tool fits which model.

The model of bench_ddp.py (hvd_sparse/tools/lab/dlrm.py: 8 ``EmbeddingBag`` tables, 100k-500k
rows x 64 times --scale, sum pooling, bottom and top MLPs), batch 2048 per rank x 4 ids per bag,
SGD.
Every method starts from the same weights and trains on the same batches:

- ddp sparse: DDP, tables ``sparse=True``, no hook (Gloo's sparse allreduce: every rank's rows
  to every rank)
- ours rows: the same with ``hvd_sparse.ddp.hook`` (scheme "auto")
- torchrec: the tables in TorchRec's ``EmbeddingBagCollection`` under
  ``DistributedModelParallel``, sharded as its planner chooses for the CPU topology; SGD fused
  into the tables' backward; the MLPs under the DDP that DMP wraps them in (it sends pooled
  embeddings forward and their gradients back, and the MLPs' gradients, instead of rows)
- torchrec + ours: the same with ``hvd_sparse.ddp.hook`` on DMP's DDP of the MLPs (what the
  hook gives a TorchRec user: the dense part's gradients, which are not sparse)

Per method: the median over --steps of the slowest rank's step, MB each rank sent per step
(on $GLOO_SOCKET_IFNAME where it is set, as on the testbed; on loopback the lo counter over
the ranks, which is every rank's traffic), and the largest difference of any rank's losses
from ddp sparse's over the run (the same model, data and SGD: float rounding apart, a method
that trains something else shows here). Table to stdout, progress to stderr, JSON and PNG to
--out-dir. Needs TorchRec: scripts/setup/setup_torchrec.sh makes .venv-torchrec over .venv.

    scripts/setup/setup_torchrec.sh
    .venv-torchrec/bin/python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        scripts/bench/bench_torchrec.py [--ids hot]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import (
    DefaultDataParallelWrapper,
    DistributedModelParallel,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from hvd_sparse import ddp
from hvd_sparse.tools.lab.dlrm import Batch, Ids, RecModel, add_args, bag_label, workload
from hvd_sparse.tools.lab.report import print_table, save_png, write_json

METHODS = ("ddp sparse", "ours rows", "torchrec", "torchrec + ours")
REFERENCE = "ddp sparse"
LR = 0.05
NAN = float("nan")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p, scale=1.0)
    p.add_argument("--steps", type=int, default=5, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=4,
                   help="untimed steps first (ours: auto tries both ways for a sparse bucket "
                        "in its first 4 calls)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out-dir", type=Path, default=Path("bench_results/torchrec"))
    args = p.parse_args()
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    args.methods = [m for m in METHODS if m in args.methods.split(",")]
    return args


def progress(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def sent_bytes() -> float:
    """Bytes this rank's share of the interface counter says were sent so far."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    ranks = 1 if ifname else dist.get_world_size()  # lo carries every rank's traffic
    return float(Path(f"/sys/class/net/{ifname or 'lo'}/statistics/tx_bytes").read_text()) / ranks


class TorchRecModel(nn.Module):
    """RecModel's tables as one EmbeddingBagCollection (feature f<i> looks up table t<i>)."""

    def __init__(self, start: RecModel) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=t.embedding_dim,
                                       num_embeddings=t.num_embeddings,
                                       feature_names=[f"f{i}"], pooling=PoolingType.SUM)
                    for i, t in enumerate(start.tables)],
            device=torch.device("meta"))  # allocated by DMP, on the rank that holds the shard
        self.bottom = copy.deepcopy(start.bottom)
        self.top = copy.deepcopy(start.top)

    def forward(self, kjt: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
        pooled = self.ebc(kjt).to_dict()  # sharded, its keys come in the shards' order
        feats = [pooled[f"f{i}"] for i in range(len(pooled))] + [self.bottom(dense)]
        return self.top(torch.cat(feats, 1)).squeeze(1)


def to_kjt(ids: list[Ids]) -> KeyedJaggedTensor:
    """The tables' ids (fixed bags [batch, bag], or (ids, offsets)) as TorchRec's input."""
    values, lengths = [], []
    for i in ids:
        if isinstance(i, tuple):
            flat, offsets = i
            ends = torch.cat([offsets[1:], torch.tensor([flat.numel()])])
            values.append(flat)
            lengths.append((ends - offsets).to(torch.int32))
        else:
            values.append(i.reshape(-1))
            lengths.append(torch.full((i.shape[0],), i.shape[1], dtype=torch.int32))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(ids))], values=torch.cat(values),
        lengths=torch.cat(lengths))


class HookedWrapper(DefaultDataParallelWrapper):
    """DMP's DDP of the unsharded modules, with hvd_sparse's hook registered on it."""

    def __init__(self, state: ddp.State) -> None:
        super().__init__()
        self.state = state

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device
             ) -> None:
        super().wrap(dmp, env, device)
        dmp._dmp_wrapped_module.register_comm_hook(self.state, ddp.hook)


def build(method: str, start: RecModel):  # noqa: ANN201 - (module, optimizer, close, note)
    """The model as ``method`` trains it, its optimizer, what releases its state, a note."""
    ours = ddp.State(scheme="auto") if "ours" in method else None
    close = ours.close if ours is not None else (lambda: None)
    if not method.startswith("torchrec"):
        net = DDP(copy.deepcopy(start).set_sparse(True))
        if ours is not None:
            net.register_comm_hook(ours, ddp.hook)
        return net, torch.optim.SGD(net.parameters(), lr=LR), close, "-"
    model = TorchRecModel(start)
    _apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": LR})
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"),
        data_parallel_wrapper=HookedWrapper(ours) if ours is not None else None)
    # The tables' starting weights: each rank fills the shards it holds.
    state = dmp.state_dict()
    for i, t in enumerate(start.tables):
        key = next(k for k in state if k.endswith(f"embedding_bags.t{i}.weight"))
        for shard in state[key].local_shards():
            (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.detach().copy_(t.weight.detach()[r:r + nr, c:c + nc])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    plan = dmp.plan.plan.get("ebc", {})
    note = ", ".join(sorted({f"{p.sharding_type} {p.compute_kernel}" for p in plan.values()}))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), close, note


def run(method: str, start: RecModel, data: list[Batch], args: argparse.Namespace
        ) -> tuple[dict[str, object], list[float]]:
    net, opt, close, note = build(method, start)
    rec = method.startswith("torchrec")
    loss_fn = nn.BCEWithLogitsLoss()
    times, losses, sent0 = [], [], NAN
    for i, (ids, dense, y) in enumerate(data):
        if i == args.warmup:
            sent0 = sent_bytes()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(net(to_kjt(ids) if rec else ids, dense), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    sent = (sent_bytes() - sent0) / args.steps
    close()
    slow = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(slow, dist.ReduceOp.MAX)
    step = statistics.median(slow.tolist()) * 1e3
    progress(f"  {method}: median step {step:,.0f} ms (slowest rank)")
    return {"method": method, "step_ms": step, "MB sent/rank/step": sent / 1e6,
            "sharding": note}, losses


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # ranks share the cores
    rank, size = dist.get_rank(), dist.get_world_size()
    rows, data = workload(args, rank)
    torch.manual_seed(0)
    start = RecModel(rows, args.dim, sparse=True)
    progress(f"bench_torchrec: {size} ranks, {len(rows)} tables ({sum(rows):,} rows x "
             f"{args.dim}), {args.ids} ids, {len(args.methods)} methods x "
             f"{args.warmup}+{args.steps} steps")
    results, losses = [], {}
    for k, method in enumerate(args.methods):
        progress(f"[{k + 1}/{len(args.methods)}] {method}")
        res, losses[method] = run(method, start, data, args)
        results.append(res)
    ref_step = next((r["step_ms"] for r in results if r["method"] == REFERENCE), NAN)
    for r in results:
        d = NAN
        if REFERENCE in losses:
            diff = torch.tensor(max(abs(a - b) for a, b in zip(losses[r["method"]],
                                                                losses[REFERENCE], strict=True)))
            dist.all_reduce(diff, dist.ReduceOp.MAX)
            d = float(diff)
        r["max |Δloss| vs ddp sparse"] = d
        r["x vs ddp sparse"] = ref_step / r["step_ms"]
    if rank != 0:
        dist.destroy_process_group()
        return
    where = os.environ.get("GLOO_SOCKET_IFNAME", "loopback")
    rate = os.environ.get("HVD_SPARSE_LINK_RATE")  # set by `hvd-sparse testbed run`
    link = f", {int(rate) / 1e9:g} Gbit/s" if rate else ""
    caption = (f"{size} ranks ({where}{link}), {len(rows)} tables "
               f"({min(rows):,}-{max(rows):,} rows x {args.dim}), batch {args.batch}/rank x "
               f"{bag_label(args)} ids, {args.ids} ids; median of {args.steps} steps, slowest rank")
    cols = ["method", "step_ms", "MB sent/rank/step", "max |Δloss| vs ddp sparse",
            "x vs ddp sparse", "sharding"]
    print_table(results, "Data-parallel sparse sync against TorchRec's model-parallel tables",
                cols, caption=caption)
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    names = [r["method"] for r in results][::-1]
    by = {r["method"]: r for r in results}
    a1.barh(names, [by[n]["step_ms"] for n in names])
    a1.set_xlabel("step ms (median, slowest rank)")
    a2.barh(names, [by[n]["MB sent/rank/step"] for n in names], color="tab:orange")
    a2.set_xlabel("MB sent per rank per step")
    a2.set_yticks([])
    fig.suptitle(caption, fontsize=7, wrap=True)
    stem = f"torchrec-{args.ids}"
    print("wrote", write_json(args.out_dir / f"{stem}.json", results, args=vars(args),
                              ranks=size, network=where, link_rate=rate),
          save_png(fig, args.out_dir / f"{stem}.png"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
