"""Reductions with a run file on (HVD_SPARSE_METRICS_FILE, tests/test_analyze.py): every scheme a
known number of times on tensors of known sparsity. The report lists, per call, the non-zero
blocks (or rows) this rank submitted, so the test can work out what each rank received."""
from __future__ import annotations

import os

import horovod.torch as hvd
import torch
from common import report, start

import hvd_sparse
from hvd_sparse import runfile

NUMEL = 256 * 1000 + 17  # a partial last block: segments still carry it whole
# name -> (scheme, calls, block density)
CALLS = {"ag": ("allgather", 3, 0.05), "zen": ("zen", 3, 0.1), "omni": ("omnireduce", 2, 0.05),
         "dense": ("dense", 2, 0.05), "auto": ("auto", 2, 0.01)}
ROWS, DIM = 4000, 8


def sample(name: str, step: int, density: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 100 + step * 10 + hvd.rank())
    nblocks = -(-NUMEL // 256)
    chosen = (torch.rand(nblocks, generator=g) < density).repeat_interleave(256)[:NUMEL]
    return torch.randn(NUMEL, generator=g) * chosen


def blocks_of(t: torch.Tensor) -> list[int]:
    padded = torch.cat([t, t.new_zeros(-t.numel() % 256)])
    return padded.view(-1, 256).ne(0).any(1).nonzero().view(-1).tolist()


def main() -> None:
    # A run file given as an init option, without {rank}: rank 0 alone writes it, at shutdown.
    start(probe="off", metrics_file=os.environ["ANALYZE_SOLO_FILE"])
    hvd_sparse.allreduce(sample("solo", 0, 0.1), name="solo", scheme="allgather")
    solo_recording = runfile._recorder is not None
    hvd_sparse.shutdown()
    hvd_sparse.init(probe="off")  # the environment's file, "{rank}": each rank its own, at exit
    calls: dict[str, list[list[int]]] = {}
    for step in range(3):
        for name, (scheme, count, density) in CALLS.items():
            if step < count:
                t = sample(name, step, density)
                calls.setdefault(name, []).append(blocks_of(t))
                hvd_sparse.allreduce(t, name=name, op=hvd.Sum, scheme=scheme)
        g = torch.Generator().manual_seed(7 * hvd.rank() + step)
        ids = (torch.rand(300, generator=g) ** 2 * ROWS).long()  # repeated rows
        emb = torch.sparse_coo_tensor(ids.unsqueeze(0), torch.randn(300, DIM, generator=g),
                                      (ROWS, DIM))
        calls.setdefault("emb", []).append(sorted(set(ids.tolist())))
        hvd_sparse.allreduce(emb, name="emb")
    report({"calls": calls, "metrics": hvd_sparse.metrics(), "numel": NUMEL, "dim": DIM,
            "solo_recording": solo_recording})


if __name__ == "__main__":
    main()
