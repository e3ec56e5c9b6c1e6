"""The reference and tested optimizer pairs of tests/parallel/test_horovod_optimizer.py.

The reference is Horovod's own optimizer with ``hvd.Compression.none`` on a float64 copy of
the model fed the same batches; the tested one goes through
``hvd.DistributedOptimizer(compression=hvd_sparse.Compression.sparse(scheme=S))`` or
``hvd_sparse.DistributedOptimizer(scheme=S)``; parameters must agree after every step. The
helpers return '' or the first difference.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import horovod.torch as hvd
import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from ranktools import close_to
from torch import nn

import hvd_sparse

SCHEMES = ["allgather", "zen", "omnireduce", "auto"]
BLOCK = 4  # codec block size: these tiny tensors still have several blocks, some all-zero
Make = Callable[..., torch.optim.Optimizer]  # (optimizer, named_parameters, **kw) -> wrapped


class Net(nn.Module):
    """Two heads: a loss on the first leaves fc3 without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.fc2(F.relu(self.fc1(x)))
        return a, self.fc3(F.relu(a))


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    return x * (torch.rand(5, 6, generator=g) < 0.5)  # zero features: all-zero gradient blocks


def reference(opt: torch.optim.Optimizer, named, **kw) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(opt, named_parameters=named, compression=hvd.Compression.none,
                                    **kw)


def maker(path: str, scheme: str) -> Make:
    if path == "compression":
        comp = hvd_sparse.Compression.sparse(scheme=scheme, block_size=BLOCK)
        return lambda opt, named, **kw: hvd.DistributedOptimizer(
            opt, named_parameters=named, compression=comp, **kw)
    return lambda opt, named, **kw: hvd_sparse.DistributedOptimizer(
        opt, named_parameters=named, scheme=scheme, block_size=BLOCK, **kw)


def differs(ref: nn.Module, test: nn.Module, when: str) -> str:
    for (n, a), b in zip(ref.named_parameters(), test.parameters(), strict=True):
        if not a.is_floating_point():  # frozen integer parameters
            why = "" if torch.equal(a, b) else "frozen parameter changed"
        else:
            why = close_to(b.detach(), a.detach(), torch.float64)
        if why != "":
            return f"{when}: {n}: {why}"
    return ""


def sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def pair(make: Make, opt_fn=sgd, module=Net, **kw):
    """The reference and the tested model, equal at start, with their optimizers; a callable
    ``groups`` is given the model and returns its parameter groups."""
    torch.manual_seed(0)
    ref = module().double()
    test = copy.deepcopy(ref)

    def wrap(m: nn.Module, fn: Make) -> torch.optim.Optimizer:
        extra = {**kw, "groups": kw["groups"](m)} if callable(kw.get("groups")) else kw
        return fn(opt_fn(m), m.named_parameters(), **extra)

    return ref, wrap(ref, reference), test, wrap(test, make)


def lockstep(ref: nn.Module, ref_opt: torch.optim.Optimizer, test: nn.Module,
             test_opt: torch.optim.Optimizer, steps: range,
             head: int = 1, clip: bool = False) -> str:
    """Steps the pair on the same batches, loss on output ``head``; '' or the first difference."""
    for step in steps:
        for m, opt in ((ref, ref_opt), (test, test_opt)):
            opt.zero_grad()
            m(batch(step))[head].pow(2).sum().backward()
            if clip:  # Horovod's pattern: reduce, clip the reduced gradients, then step
                opt.synchronize()
                nn.utils.clip_grad_norm_(m.parameters(), 0.1)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        if (err := differs(ref, test, f"step {step}")) != "":
            return err
    return ""


def train(make: Make, steps: int = 3, head: Callable[[int], int] = lambda rank: 1,
          clip: bool = False, **kw) -> str:
    """A fresh pair in lockstep; ``head`` picks each rank's loss head."""
    return lockstep(*pair(make, **kw), range(steps), head(hvd.rank()), clip)
