"""An embedding model trained with Horovod, its sparse gradients synchronized by hvd-sparse.

    horovodrun -np 2 python examples/horovod_embedding.py --steps 200

Each rank draws its own batches of ids for a click-through-like model: a sparse EmbeddingBag
table and a small MLP. ``hvd_sparse.DistributedOptimizer`` stands in for
``hvd.DistributedOptimizer``: the table's gradient goes by its rows (only the rows some rank
touched cross the network), the MLP's by whatever the cost model picks. The last line printed by
rank 0 is a JSON summary (losses, the schemes that ran, whether every rank holds the same
parameters) that tests/test_examples.py checks.
"""
import argparse
import hashlib
import json

import horovod.torch as hvd
import torch
from torch import nn

import hvd_sparse

ROWS, DIM = 50_000, 16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # sparse=True: backward produces a sparse COO gradient holding only the rows looked up
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids)).squeeze(1)


def batch(step: int, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch: 256 bags of 8 ids, 2 of 100 hot ones and 6 of the whole table; the
    label is a fixed function of the hot ids, so there is something to learn."""
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    hot = torch.randint(0, 100, (256, 2), generator=g)
    cold = torch.randint(0, ROWS, (256, 6), generator=g)
    ids = torch.cat([hot, cold], 1)
    return ids, teacher[hot].sum(1)  # the hot ids decide the label; the rest is noise


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--scheme", default="auto", help="auto, allgather, omnireduce, ...")
    args = p.parse_args()

    hvd.init()
    # One rank per GPU where there are GPUs (a CPU-only Horovod build will do: hvd-sparse
    # reduces through host memory), the CPU otherwise.
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Options are keywords here or HVD_SPARSE_* variables (docs: Configuration). With no
    # aggregators configured, rank 0 starts the job's own for the omnireduce scheme.
    hvd_sparse.init(scheme=args.scheme)
    torch.manual_seed(0)  # the same initial model on every rank (or broadcast it, as below)
    model = Model().to(device)
    teacher = torch.randn(ROWS, generator=torch.Generator().manual_seed(7))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = hvd_sparse.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    losses = []
    for step in range(args.steps):
        ids, y = (t.to(device) for t in batch(step, teacher))
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(ids), y)
        loss.backward()
        opt.step()  # waits for the reductions started during backward, then steps
        # the mean loss over the ranks (a dense allreduce of one number)
        losses.append(float(hvd.allreduce(loss.detach().cpu(), name="loss")))
        if hvd.rank() == 0 and step % 50 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)

    digest = hashlib.sha1(b"".join(p.detach().cpu().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()
    same = len(set(hvd.allgather_object(digest))) == 1
    if hvd.rank() == 0:
        print(json.dumps({"example": "horovod_embedding", "ranks": hvd.size(),
                          "first_loss": losses[0], "last_loss": losses[-1],
                          "schemes": sorted({m["scheme"] for m in hvd_sparse.metrics().values()}),
                          "same_parameters_on_every_rank": same}), flush=True)
    hvd_sparse.shutdown()


if __name__ == "__main__":
    main()
