"""Auto: per tensor, the scheme the cost model predicts fastest, decided alike on every rank.

Ranks first allgather a tiny stats row (non-zero block count and a fingerprint of the tensor),
so every rank feeds the same numbers to the same model and takes the same branch; the rows also
catch shape or dtype mismatches across ranks. Small tensors go dense without the extra round.
"""
from __future__ import annotations

import logging

import horovod.torch as hvd
import torch

from .. import blocks, costmodel
from ..engine import Job, Stage
from ..errors import HvdSparseError
from ..segments import local_mask
from . import allgather, dense, omnireduce, switch, zen

log = logging.getLogger("hvd_sparse")
_RUN = {"dense": dense.run, "allgather": allgather.run, "zen": zen.run,
        "omnireduce": omnireduce.run, "switch": switch.run}
_union_ratio: dict[str, float] = {}  # name -> observed union / sum of per-rank non-zero blocks


def run(job: Job) -> Stage:
    ctx = job.ctx
    t = job.tensor
    if t.numel() * t.element_size() < ctx.config.small_bytes:
        job.stats["reason"] = "small"
        return (yield from dense.run(job))
    nnz_local = int(local_mask(job).sum())
    row = torch.tensor([[nnz_local, t.numel(), blocks.DTYPE_CODES[t.dtype], job.meta]])
    rows = yield "stats", hvd.allgather_async(row, name=job.op_name("stats"),
                                              process_set=job.process_set)
    for r, other in enumerate(rows.tolist()):
        if other[1:] != row[0, 1:].tolist():
            raise HvdSparseError(
                f"hvd_sparse: tensor {job.name!r}: tensor mismatch across ranks: rank {r} has "
                f"numel={other[1]} dtype-code={other[2]}, this rank has numel={t.numel()} "
                f"dtype={t.dtype} (or the shapes differ)")
    nnz = rows[:, 0].tolist()
    ratio = _union_ratio.get(job.name)
    predicted = costmodel.predict(ctx.net, t.numel(), t.element_size(), job.block_size, nnz,
                                  None if ratio is None else ratio * sum(nnz))
    if not omnireduce.covers(job.process_set):
        predicted.seconds.pop("omnireduce", None)
    if switch.unsupported(job, ctx.switch):
        predicted.seconds.pop("switch", None)
    choice = costmodel.choose(predicted)
    job.stats.update(predicted_ms={k: round(v * 1e3, 3) for k, v in predicted.seconds.items()},
                     block_density=sum(nnz) / len(nnz) / max(1, blocks.num_blocks(
                         t.numel(), job.block_size)))
    log.debug("hvd_sparse: %s -> %s (predicted ms %s)", job.name, choice, job.stats["predicted_ms"])
    out = yield from _RUN[choice](job)
    # The decision's own allgather: n - 1 rows in, as many out (ring).
    row_bytes = (len(nnz) - 1) * row.nbytes
    for key in ("bytes_sent", "bytes_received"):
        job.stats[key] = job.stats.get(key, 0) + row_bytes
    if choice != "dense" and sum(nnz) > 0:
        _union_ratio[job.name] = job.stats["union"] / sum(nnz)
    return out
