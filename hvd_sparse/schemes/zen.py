"""Zen's balanced parallelism: hash-partition non-zero blocks, alltoall, reduce, allgather.

Each non-zero block goes to the rank that owns its partition (a data-independent hash of the
block index, so no coordination and no hot spots); that rank sums what it received and the
partition sums are allgathered, as an index list or a bitmap over the partition's positions,
whichever is smaller. Lossless: sort-merge, no hash table to overflow or collide.
"""
from __future__ import annotations

from .. import blocks
from .._C import zen_encode, zen_reduce
from ..engine import Stage
from ..job import Job
from .common import decode_sum, error, local_mask, output


def run(job: Job) -> Stage:
    t, bs, n = job.tensor, job.block_size, job.size
    buf, splits = zen_encode(t, bs, n, job.meta, local_mask(job))
    recv, _ = yield "alltoall", job.comm.alltoall(buf, splits, job.op_name("alltoall"))
    try:
        part = zen_reduce(recv, bs, job.meta, blocks.DTYPE_CODES[t.dtype], t.numel(), n,
                          job.rank, n, job.stats.nnz_local)
    except RuntimeError as e:
        raise error(job, e) from e
    gathered = yield "allgather", job.comm.allgather(part, job.op_name("allgather"))
    out = output(job)
    decode_sum(job, gathered, out, part_is_rank=True)
    # the other ranks' segments of this partition, then the other partitions' sums
    job.stats.scheme = "zen"
    job.stats.bytes_sent = int(sum(splits) - splits[job.rank] + gathered.numel() * (n - 1) / n)
    job.stats.bytes_received = recv.numel() - splits[job.rank] + gathered.numel() - part.numel()
    return out
