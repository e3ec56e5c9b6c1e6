"""Auto: per tensor, the scheme the cost model predicts fastest, decided alike on every rank.

Ranks first allgather a tiny stats row (non-zero block count and a fingerprint of the tensor),
so every rank feeds the same numbers to the same model and takes the same branch; the rows also
catch shape or dtype mismatches across ranks. (Small tensors never get here: they go dense.)
A tensor that keeps going dense stops asking (``STEADY``) but for a look every
``LOOK_AGAIN`` calls.
"""
from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

import torch

from .. import blocks, costmodel
from ..comm import Pending
from ..errors import HvdSparseError
from ..job import Context, Job
from . import switch
from .common import local_mask

log = logging.getLogger("hvd_sparse")
ROW_BYTES = 4 * 8  # the stats row: 4 int64
# A tensor sent dense STEADY calls in a row goes dense without asking the ranks (the stats
# allgather: a collective's latency each call, for a bucket of dense layers every step) until
# every LOOK_AGAIN-th call, which asks again. Dense is the baseline auto never loses to, so
# what this can cost is a sparse gain missed for LOOK_AGAIN calls.
STEADY, LOOK_AGAIN = 3, 20


def choose(job: Job) -> Generator[tuple[str, Pending], Any, str]:
    """Yields the stats allgather; returns the scheme to run: "dense" or a sparse one. Alike
    on every rank: so is the streak of dense choices it keeps (``STEADY``)."""
    ctx, t = job.ctx, job.tensor
    key = _key(job)
    if steady_dense(ctx, key):
        return "dense"
    streak = ctx.dense_streak.get(key, 0)
    row = torch.tensor([[int(local_mask(job).sum()), t.numel(), blocks.DTYPE_CODES[t.dtype],
                         job.meta]])
    rows = yield "stats", job.comm.allgather(row, job.op_name("stats"))
    for r, other in enumerate(rows.tolist()):
        if other[1:] != row[0, 1:].tolist():
            raise HvdSparseError(
                f"hvd_sparse: tensor {job.name!r}: tensor mismatch across ranks: rank {r} has "
                f"numel={other[1]} dtype-code={other[2]}, this rank has numel={t.numel()} "
                f"dtype={t.dtype} (or the shapes differ)")
    nnz = job.stats.nnz = rows[:, 0].tolist()
    ratio = ctx.union_ratio.get(key)
    # a staged device tensor of the DDP hook: dense where it is, by the model's group
    route = ctx.routes.get(job.stats.staged) if job.stats.staged else None
    predicted = costmodel.predict(ctx.net, t.numel(), t.element_size(), job.block_size, nnz,
                                  None if ratio is None else ratio * sum(nnz), route)
    if not job.comm.is_global:
        predicted.seconds.pop("omnireduce", None)
    if switch.unsupported(job, ctx.switch):
        predicted.seconds.pop("switch", None)
    choice = costmodel.choose(predicted)
    job.stats.predicted_ms = {k: round(v * 1e3, 3) for k, v in predicted.seconds.items()}
    job.stats.block_density = sum(nnz) / len(nnz) / max(1, blocks.num_blocks(t.numel(),
                                                                             job.block_size))
    log.debug("hvd_sparse: %s -> %s (predicted ms %s)", job.name, choice, job.stats.predicted_ms)
    ctx.dense_streak[key] = streak + 1 if choice == "dense" else 0
    return choice


def steady_dense(ctx: Context, key: tuple[str, tuple[int, ...]]) -> bool:
    """Whether the tensor ``key`` (name, ranks) goes dense this call without asking the ranks
    (``STEADY``), counted as such; alike on every rank. The DDP hook asks it before choosing
    the collectives (a bucket that goes dense is its model's group's)."""
    streak = ctx.dense_streak.get(key, 0)
    if streak >= STEADY and streak % LOOK_AGAIN:
        ctx.dense_streak[key] = streak + 1
        return True
    return False


def learn(job: Job, choice: str, nnz: list[int]) -> None:
    """After the chosen scheme ran: its bytes with the decision's own (ring allgather of one
    stats row per rank), and the union it saw, for the next prediction of this tensor."""
    if not nnz:  # went dense without asking the ranks (``STEADY``)
        return
    s = job.stats
    s.bytes_sent += (len(nnz) - 1) * ROW_BYTES
    s.bytes_received = (s.bytes_received or 0) + (len(nnz) - 1) * ROW_BYTES
    if choice != "dense" and sum(nnz) > 0 and s.union is not None:
        job.ctx.union_ratio[_key(job)] = s.union / sum(nnz)


def _key(job: Job) -> tuple[str, tuple[int, ...]]:
    """What auto learns of a tensor is kept by name and ranks: a name reduced over several
    process sets is learnt apart in each, so every rank of a reduction goes by the same."""
    return key(job.name, job.comm.ranks)


def key(name: str, ranks: list[int]) -> tuple[str, tuple[int, ...]]:
    """The key ``_key`` gives the reduction of ``name`` over ``ranks``."""
    return name, tuple(ranks)
