"""Dense: Horovod's own allreduce, unchanged (the reference every other scheme must match)."""
from __future__ import annotations

import horovod.torch as hvd
import torch

from ..engine import Stage
from ..job import Job


def run(job: Job) -> Stage:
    t = job.tensor.view(job.shape)  # full shape, so Horovod checks shapes across ranks
    # Horovod 0.28 has no bfloat16 allreduce: reduce in float32 and round once at the end.
    wire = t.float() if t.dtype == torch.bfloat16 else t
    start = hvd.allreduce_async_ if job.inplace and wire is t else hvd.allreduce_async
    out = yield "allreduce", start(
        wire, name=job.op_name("allreduce"), op=job.op,
        prescale_factor=job.prescale, postscale_factor=job.postscale,
        process_set=job.process_set)
    n = job.size
    ring = int(2 * (n - 1) / n * wire.numel() * wire.element_size())  # Horovod's ring, modelled
    job.stats.scheme = "dense"
    job.stats.bytes_sent = job.stats.bytes_received = ring
    return t.copy_(out) if job.inplace and out is not t else out.to(t.dtype)
