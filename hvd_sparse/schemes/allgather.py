"""Allgather: every rank gathers every rank's non-zero blocks and sums them locally.

One block index per block (not per element, as Horovod's COO path sends); segments are summed
in rank order, so every rank computes bit-identical results.
"""
from __future__ import annotations

from .._C import encode
from ..engine import Stage
from ..job import Job
from .common import decode_sum, local_mask, output


def run(job: Job) -> Stage:
    t, bs, n = job.tensor, job.block_size, job.size
    seg = encode(t, bs, job.meta, local_mask(job))
    gathered = yield "allgather", job.comm.allgather(seg, job.op_name("allgather"))
    out = output(job)
    decode_sum(job, gathered, out, part_is_rank=False)
    # Ring allgather: each rank forwards all but one of the n segments, and receives the others'.
    job.stats.scheme = "allgather"
    job.stats.bytes_sent = int(gathered.numel() * (n - 1) / n)
    job.stats.bytes_received = gathered.numel() - seg.numel()
    return out
