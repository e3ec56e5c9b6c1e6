"""Dense: the front end's own allreduce, unchanged (the reference every other scheme must
match)."""
from __future__ import annotations

import torch

from ..engine import Stage
from ..job import Job


def run(job: Job) -> Stage:
    t = job.tensor.view(job.shape)  # full shape, so Horovod checks shapes across ranks
    # Horovod 0.28 has no bfloat16 allreduce: reduce in float32 and round once at the end.
    wire = t.float() if t.dtype == torch.bfloat16 else t
    out = yield "allreduce", job.comm.allreduce(
        wire, job.op_name("allreduce"), "average" if job.average else "sum", job.prescale,
        job.postscale, inplace=job.inplace and wire is t)
    n = job.size
    ring = int(2 * (n - 1) / n * wire.numel() * wire.element_size())  # a ring, modelled
    job.stats.scheme = "dense"
    job.stats.bytes_sent = job.stats.bytes_received = ring
    return t.copy_(out) if job.inplace and out is not t else out.to(t.dtype)
