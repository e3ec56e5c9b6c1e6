"""A Wide&Deep click model under PyTorch DDP, its gradients averaged by the hvd-sparse hook.

    torchrun --nproc_per_node 2 examples/ddp_wide_deep.py --steps 200
    torchrun --nproc_per_node 2 examples/ddp_wide_deep.py --table-dtype bfloat16

Written as Wide&Deep, FM and DeepFM models usually are: a first-order ("wide") table of width 1
beside a deep table, both ``nn.EmbeddingBag(sparse=True)``, over several categorical fields.
The hook reduces both tables by their rows (whatever their width and dtype) and the MLP's
dense bucket by the scheme the cost model picks. ``--table-dtype bfloat16`` keeps the tables in
16 bits (half their memory and their rows' bytes on the wire), the MLP in float32. The last line
printed by rank 0 is a JSON summary that tests/test_examples.py checks.
"""
import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import hvd_sparse

FIELDS, IDS_PER_FIELD, DIM = 4, 25_000, 8


class WideDeep(nn.Module):
    def __init__(self, table_dtype: torch.dtype) -> None:
        super().__init__()
        rows = FIELDS * IDS_PER_FIELD  # one table for every field, each field its own ids
        self.wide = nn.EmbeddingBag(rows, 1, mode="sum", sparse=True, dtype=table_dtype)
        self.deep = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True, dtype=table_dtype)
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))
        nn.init.zeros_(self.wide.weight)  # a linear model's start
        nn.init.normal_(self.deep.weight, std=0.01)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        wide = self.wide(ids).squeeze(1).float()
        return wide + self.mlp(self.deep(ids).float()).squeeze(1)  # click logits


def batch(step: int, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's clicks: per field a Zipf-like id (popular ids shared by the ranks), clicked
    with the probability the teacher's weights of the ids give."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    ids = (torch.rand(512, FIELDS, generator=g) ** 3 * IDS_PER_FIELD).long()
    ids += torch.arange(FIELDS) * IDS_PER_FIELD
    clicked = torch.rand(512, generator=g) < torch.sigmoid(teacher[ids].sum(1))
    return ids, clicked.float()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--scheme", default="auto")
    p.add_argument("--table-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()

    # One rank per GPU where there are GPUs (NCCL for DDP's own group), the CPU otherwise.
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, ...
    torch.manual_seed(0)
    model = DDP(WideDeep(getattr(torch, args.table_dtype)).to(device),
                device_ids=[device.index] if cuda else None)
    # Collective: every rank builds the state, in the same order as its other collectives.
    state = hvd_sparse.ddp.State(scheme=args.scheme)
    model.register_comm_hook(state, hvd_sparse.ddp.hook)
    teacher = 2 * torch.randn(FIELDS * IDS_PER_FIELD, generator=torch.Generator().manual_seed(7))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)  # takes the tables' sparse gradients

    losses = []
    for step in range(args.steps):
        ids, clicked = (t.to(device) for t in batch(step, teacher))
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(ids), clicked)
        loss.backward()  # the hook's reductions run while backward goes on; DDP waits for them
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        if dist.get_rank() == 0 and step % 50 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)

    digest = hashlib.sha1(b"".join(p.detach().cpu().view(-1).view(torch.uint8).numpy().tobytes()
                                   for p in model.parameters())).hexdigest()
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if dist.get_rank() == 0:
        print(json.dumps({"example": "ddp_wide_deep", "ranks": dist.get_world_size(),
                          "table_dtype": args.table_dtype,
                          "first_loss": losses[0], "last_loss": losses[-1],
                          "schemes": sorted({m["scheme"] for m in hvd_sparse.metrics().values()}),
                          "same_parameters_on_every_rank": len(set(digests)) == 1}), flush=True)
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
