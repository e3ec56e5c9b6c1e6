"""A dense model under DDP whose gradients are sparsified to 1% (top-k with error feedback)
before the hvd-sparse hook averages them.

    torchrun --nproc_per_node 2 examples/ddp_sparsifier.py --steps 300

``TopK(density)`` keeps the largest ``density`` of each parameter's gradient on each rank; what
it leaves out is kept in its error-feedback memory and added to the next step's gradient, so
nothing is lost, only delayed. Tensors too small to pay for it (biases, layers under 16,384
elements) go out whole. Element-wise selection wants a small codec block (``block_size``), or
each selected element would carry a whole 256-element block with it. The last line printed by
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--density", type=float, default=0.01)
    args = p.parse_args()

    # One rank per GPU where there are GPUs (NCCL for DDP's own group), the CPU otherwise.
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, ...
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                        nn.Linear(256, 1))
    teacher = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 1))
    net, teacher = net.to(device), teacher.to(device)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    # the sparsifier's memory is kept per parameter: name them (and a checkpoint can resume it)
    state = hvd_sparse.ddp.State(sparsifier=hvd_sparse.TopK(args.density), block_size=4,
                                 named_parameters=net.named_parameters(), scheme="allgather")
    model.register_comm_hook(state, hvd_sparse.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
        x = torch.randn(128, 64, generator=g).to(device)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        if dist.get_rank() == 0 and step % 50 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)

    sparsified = {name: m["achieved_density"] for name, m in hvd_sparse.metrics().items()
                  if "achieved_density" in m}
    digest = hashlib.sha1(b"".join(p.detach().cpu().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if dist.get_rank() == 0:
        print(json.dumps({"example": "ddp_sparsifier", "ranks": dist.get_world_size(),
                          "first_loss": losses[0], "last_loss": losses[-1],
                          "density": args.density, "achieved_density": sparsified,
                          "same_parameters_on_every_rank": len(set(digests)) == 1}), flush=True)
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
