"""DDP with the hvd-sparse hook under torchrun, restartable: checkpoints as PyTorch's DDP
tutorial writes them, with the hook's own state beside them.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    torchrun --nproc_per_node 2 --max-restarts 3 examples/ddp_checkpoint.py --ckpt ckpt/

(The variable works around torch's restart bug: docs/fault-tolerance.md.)

Every ``--every`` steps each rank saves what only it holds (the hook's ``State.state_dict()``:
its sparsifier's error-feedback memory, what ``auto`` learnt), then rank 0 saves the model and
the optimizer, which DDP keeps alike on every rank. When a rank fails, torchrun restarts every
rank from the top of the script (``--max-restarts``); each loads the last checkpoint and goes
on: the run ends bitwise where one without the failure ends (under ``auto``, whose timed
choices may differ between two runs, within rounding). Restarted with another number of
ranks, the job goes on from the model and the optimizer, and the hook's state starts afresh
(its memory belonged to ranks that are no more; ``auto`` learns the new ranks again).

``--fail-step S --fail-rank R`` makes rank R exit at step S of the first attempt (tests). Rank 0
prints a JSON summary last (tests/test_ddp_restart.py reads it).
"""
import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import hvd_sparse

ROWS, DIM = 20_000, 16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        nn.init.normal_(self.emb.weight, std=0.1)
        self.mlp = nn.Sequential(nn.Linear(DIM, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids)).squeeze(1)


TEACHER = torch.randn(100, generator=torch.Generator().manual_seed(7))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch on ``rank``, drawn anew on every attempt: the hot ids decide the
    label, the rest is noise."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    hot = torch.randint(0, 100, (128, 2), generator=g)
    ids = torch.cat([hot, torch.randint(0, ROWS, (128, 2), generator=g)], 1)
    return ids, TEACHER[hot].sum(1)


EVAL = batch(10**6, 0)


def eval_loss(net: nn.Module, device: torch.device) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(net(EVAL[0].to(device)), EVAL[1].to(device)).item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--ckpt", required=True, help="the checkpoint folder, shared by the ranks")
    p.add_argument("--scheme", default="auto")
    p.add_argument("--topk", type=float, default=0.0, help="a TopK sparsifier of this density")
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=1)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = Path(args.ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    net = Model().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sparsifier = hvd_sparse.TopK(args.topk, min_numel=0) if args.topk else None
    state = hvd_sparse.ddp.State(scheme=args.scheme, sparsifier=sparsifier,
                                 named_parameters=net.named_parameters())

    start, resumed_from = 0, None
    last = ckpt / "model.pt"
    if last.exists():  # every rank reads rank 0's model and optimizer, and its own hook state
        saved = torch.load(last, map_location=device)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = resumed_from = saved["step"]
        mine = ckpt / f"hook.{saved['step']}.{rank}.pt"
        if saved["world"] == world and mine.exists():
            state.load_state_dict(torch.load(mine))
    start_loss = eval_loss(net, device)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    model.register_comm_hook(state, hvd_sparse.ddp.hook)

    for step in range(start, args.steps):
        if attempt == 0 and step == args.fail_step and rank == args.fail_rank:
            os._exit(1)  # a crash: torchrun restarts every rank
        ids, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(ids.to(device)), y.to(device)).backward()
        opt.step()
        if (step + 1) % args.every == 0:
            torch.save(state.state_dict(), ckpt / f"hook.{step + 1}.{rank}.pt")
            dist.barrier()  # every rank's hook state is on disk before the model names it
            if rank == 0:  # written whole, then renamed: a crash never leaves half of it
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                            "step": step + 1, "world": world}, ckpt / "model.tmp")
                os.replace(ckpt / "model.tmp", last)
            dist.barrier()

    digest = hashlib.sha256(b"".join(t.detach().cpu().contiguous().numpy().tobytes()
                                     for t in net.state_dict().values())).hexdigest()
    digests: list = [None] * world
    dist.all_gather_object(digests, digest)
    if rank == 0:
        print(json.dumps({"digest": digest, "identical": len(set(digests)) == 1,
                          "attempt": attempt, "resumed_from": resumed_from, "world": world,
                          "start_loss": start_loss, "end_loss": eval_loss(net, device)}),
              flush=True)
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
