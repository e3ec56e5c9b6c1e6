"""Decoding gathered segments (csrc/segment.h) into a sum, with errors that name the tensor."""
from __future__ import annotations

import torch

from . import _C, blocks
from .engine import Job
from .errors import HvdSparseError


def error(job: Job, e: Exception) -> HvdSparseError:
    return HvdSparseError(f"hvd_sparse: tensor {job.name!r}: {e}")


def local_mask(job: Job) -> torch.Tensor:
    """The block mask of the job's tensor, computed once and shared by the stages."""
    if job.mask is None:
        job.mask = _C.block_mask(job.tensor, job.block_size)
    job.stats.setdefault("nnz_local", int(job.mask.sum()))
    return job.mask


def decode_sum(job: Job, gathered: torch.Tensor, acc: torch.Tensor, part_is_rank: bool) -> None:
    """Validates one segment per rank and adds them, in rank order, into ``acc``."""
    t = job.tensor
    try:
        counts, nnz, union = _C.decode_sum(
            gathered, acc, job.block_size, job.meta, blocks.DTYPE_CODES[t.dtype], t.numel(),
            job.size, part_is_rank)
    except RuntimeError as e:
        raise error(job, e) from e
    nblocks = max(1, blocks.num_blocks(t.numel(), job.block_size))
    job.stats.update(nnz=list(nnz), union=union, block_density=sum(nnz) / len(nnz) / nblocks)


def accumulator(job: Job) -> torch.Tensor:
    """Zeroed sum buffer. In place when the dtype allows: the tensor's own pages are warm, while
    a fresh buffer of a large tensor costs more in page faults than the whole sparse exchange."""
    t = job.tensor
    if job.inplace and t.dtype in (torch.float32, torch.float64):
        return t.zero_()
    return blocks.accumulator(t.numel(), t.dtype)


def finish(acc: torch.Tensor, job: Job) -> torch.Tensor:
    """Scales the summed accumulator for the op and rounds it once to the tensor's dtype."""
    if job.scale != 1.0:
        acc.mul_(job.scale)
    if acc.data_ptr() == job.tensor.data_ptr():
        return acc
    return job.tensor.copy_(acc) if job.inplace else acc.to(job.tensor.dtype)
