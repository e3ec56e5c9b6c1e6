"""Horovod's elastic pattern, as Horovod's docs write it, for tests/test_elastic.py.

Run by ``horovodrun --gloo -np 4 --min-np 2 --max-np 4 --host-discovery-script ...`` over two
local hosts: ``hvd.elastic.TorchState(model=, optimizer=, batch=0)``, a training function under
``@hvd.elastic.run`` that commits every 4 batches, and one worker (rank ``--fail-rank``, by
default 3: the second local rank of the second host) that exits at batch 12, once: it first
tells the discovery script to drop its host (``dropped`` in the shared folder), which lists it
again a few seconds later, so the job goes on on the other host's two ranks and grows back to
four. Training goes on until ``--batches`` are done and 4 batches ran at the full size after
the job grew back.

Each rank that finishes writes ``result.<rank>.json``: the world it ended in, its parameters'
digest and whether every rank holds the same (the digests allgathered), the loss of a fixed
evaluation set before and after, the sizes it trained at, and, with a sparsifier, whether its
error-feedback memory was the last commit's each time the training function started (after a
restore it must have rolled back with the commit).

Optimizer: ``--optimizer horovod`` (``hvd.DistributedOptimizer``), ``compression``
(``hvd.DistributedOptimizer`` with ``hvd_sparse.Compression.sparse(scheme)``) or ``hvd_sparse``
(scheme ``--scheme``, sparsifier ``--sparsifier topk:<density>`` or ``exdyna:<density>``).
"""
from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import logging
import math
import os
import signal
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--optimizer", choices=("horovod", "compression", "hvd_sparse"),
               default="hvd_sparse")
p.add_argument("--scheme", default="auto")
p.add_argument("--sparsifier", default="")  # topk:0.05, exdyna:0.01
p.add_argument("--batches", type=int, default=24)
p.add_argument("--fail-at", type=int, default=12)
p.add_argument("--fail-rank", type=int, default=3)  # 0: rank 0 (it runs the job's aggregators)
p.add_argument("--crash", action="store_true")  # exit without Horovod's shutdown (a crash)
p.add_argument("--late", type=float, default=0.0)  # seconds the others wait in step() first
p.add_argument("--max-np", type=int, default=4)
p.add_argument("--shared", required=True)  # the folder the test and the discovery script share
args = p.parse_args()
shared = Path(args.shared)

logging.basicConfig(format="%(message)s")  # hvd_sparse's records (HVD_SPARSE_LOG_LEVEL=INFO)
# the test asks a hung job for its stacks: into a file, since the launcher that forwards the
# output may be what hangs
STACKS = open(shared / f"stacks.{os.getpid()}.txt", "w")  # noqa: SIM115 - open till exit
faulthandler.register(signal.SIGUSR1, file=STACKS, all_threads=True)
hvd.init()
if args.optimizer != "horovod":
    import hvd_sparse
    hvd_sparse.init(scheme=args.scheme)

ROWS, DIM, HIDDEN = 2000, 32, 1024  # fc.weight: 128 KiB, above what goes dense for its size


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.fc = nn.Linear(DIM, HIDDEN)
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(self.emb(ids)))).squeeze(1)


def batch(seed: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed teacher task: y depends on the ids alone (the same law on every rank)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS, (n, 4), generator=g)
    y = torch.sin(ids.double() * 0.37).sum(1).float() * 0.5
    return ids, y


torch.manual_seed(0)
model = Model()
EVAL = batch(10**6, 512)


def eval_loss() -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(EVAL[0]), EVAL[1]))


first_loss = eval_loss()  # the same fresh model on every rank (seed 0)
opt = torch.optim.SGD(model.parameters(), lr=0.003)
named = list(model.named_parameters())
sparsifier = None
if args.optimizer == "hvd_sparse":
    if args.sparsifier:
        kind, density = args.sparsifier.split(":")
        make = {"topk": hvd_sparse.TopK, "exdyna": hvd_sparse.ExDyna}[kind]
        sparsifier = make(float(density), min_numel=0)
    opt = hvd_sparse.DistributedOptimizer(opt, named_parameters=named, sparsifier=sparsifier,
                                          block_size=16 if sparsifier else None)
elif args.optimizer == "compression":  # dense gradients by hvd_sparse, the embedding's by Horovod
    opt = hvd.DistributedOptimizer(opt, named_parameters=named,
                                   compression=hvd_sparse.Compression.sparse(scheme=args.scheme))
else:
    opt = hvd.DistributedOptimizer(opt, named_parameters=named)


def memory_digest() -> str:
    """This rank's error-feedback memory (what the optimizer's state_dict carries of it)."""
    if sparsifier is None:
        return ""
    h = hashlib.sha256()
    for kind, bufs in sorted(sparsifier.memory.state_dict().items()):
        for name, t in sorted(bufs.items()):
            h.update(f"{kind}/{name}".encode() + t.contiguous().numpy().tobytes())
    return h.hexdigest()


# shrunk: the job ran on fewer ranks since the start; after: batches at the full size since
state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0, shrunk=False, after=0)
committed = memory_digest()  # what the state saved of the memory
rolled_back: list[bool] = []  # at each start of train: the memory is the last commit's
host = os.environ.get("HOROVOD_HOSTNAME", "")
sizes: list[int] = []
T0 = time.monotonic()


def log(what: str) -> None:
    print(f"elastic_train {time.monotonic() - T0:6.1f}s (at {time.time() % 1000:7.2f}) rank "
          f"{hvd.rank()}/{hvd.size()} ({host}): {what}", flush=True)


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    global committed
    log(f"trains from batch {state.batch}")
    rolled_back.append(memory_digest() == committed)
    while state.batch < args.batches or state.after < 4:
        # by default the second local rank of the second host (not rank 0's), once
        if (state.batch == args.fail_at and hvd.rank() == args.fail_rank
                and not (shared / "failed").exists()):
            (shared / "failed").touch()
            (shared / "dropped").write_text(host)  # the discovery script drops it for a while
            time.sleep(args.late)  # meanwhile the others submit this batch and wait for it
            log(f"exits at batch {state.batch}")
            if args.crash:  # the others see it at a timeout (Gloo's, the aggregators')
                os._exit(1)
            raise SystemExit(1)  # Horovod shuts down at exit: the others see it at once
        if hvd.size() < args.max_np:
            state.shrunk = True
            time.sleep(0.25)  # while shrunk: time for the other host to come back
        elif state.shrunk:
            state.after += 1
        ids, y = batch(state.batch * 1000 + hvd.rank())
        opt.zero_grad()
        nn.functional.mse_loss(model(ids), y).backward()
        opt.step()
        sizes.append(hvd.size())
        state.batch += 1
        if state.batch % 4 == 0:
            committed = memory_digest()
            state.commit()


log("starts")
train(state)
log("done")
digest = hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes()
                                 for t in model.state_dict().values())).hexdigest()
digests = hvd.allgather_object(digest)
last_loss = eval_loss()
result = {"rank": hvd.rank(), "size": hvd.size(), "batch": state.batch, "host": host,
          "digest": digest, "identical": len(set(digests)) == 1, "first_loss": first_loss,
          "last_loss": last_loss if math.isfinite(last_loss) else str(last_loss),
          "sizes": sorted(set(sizes)), "rolled_back": rolled_back}
if args.optimizer != "horovod":
    result["schemes"] = {n: m.get("scheme") for n, m in hvd_sparse.metrics().items()
                         if "scheme" in m}
(shared / f"result.{hvd.rank()}.json").write_text(json.dumps(result))
hvd.barrier()  # every rank wrote its result before any leaves (a success ends the job)
