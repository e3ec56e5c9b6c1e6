"""The same embedding model under PyTorch DDP, its gradients averaged by the hvd-sparse hook.

    torchrun --nproc_per_node 2 examples/ddp_embedding.py --steps 200

No Horovod: ``hvd_sparse.ddp.State`` makes its own Gloo groups beside DDP's and joins (or
starts) the aggregators; ``hvd_sparse.ddp.hook`` reduces each of DDP's buckets: the sparse
table's by its rows, the dense ones by the scheme the cost model picks. The last line printed by
rank 0 is a JSON summary that tests/test_examples.py checks.
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

ROWS, DIM = 50_000, 16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids)).squeeze(1)


def batch(step: int, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    hot = torch.randint(0, 100, (256, 2), generator=g)
    cold = torch.randint(0, ROWS, (256, 6), generator=g)
    ids = torch.cat([hot, cold], 1)
    return ids, teacher[hot].sum(1)  # the hot ids decide the label; the rest is noise


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--scheme", default="auto")
    args = p.parse_args()

    # One rank per GPU where there are GPUs (NCCL for DDP's own group), the CPU otherwise.
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, ...
    torch.manual_seed(0)
    # DDP broadcasts rank 0's parameters at construction
    model = DDP(Model().to(device), device_ids=[device.index] if cuda else None)
    # Collective: every rank builds the state, in the same order as its other collectives.
    state = hvd_sparse.ddp.State(scheme=args.scheme)
    model.register_comm_hook(state, hvd_sparse.ddp.hook)
    teacher = torch.randn(ROWS, generator=torch.Generator().manual_seed(7))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    losses = []
    for step in range(args.steps):
        ids, y = (t.to(device) for t in batch(step, teacher))
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()  # the hook's reductions run while backward goes on; DDP waits for them
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        if dist.get_rank() == 0 and step % 50 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)

    digest = hashlib.sha1(b"".join(p.detach().cpu().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if dist.get_rank() == 0:
        print(json.dumps({"example": "ddp_embedding", "ranks": dist.get_world_size(),
                          "first_loss": losses[0], "last_loss": losses[-1],
                          "schemes": sorted({m["scheme"] for m in hvd_sparse.metrics().values()}),
                          "same_parameters_on_every_rank": len(set(digests)) == 1}), flush=True)
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
