"""Decoding gathered segments (csrc/segment.h) into a sum, with errors that name the tensor."""
from __future__ import annotations

import torch

from . import _C, blocks
from .engine import Job
from .errors import HvdSparseError


def error(job: Job, e: Exception) -> HvdSparseError:
    return HvdSparseError(f"hvd_sparse: tensor {job.name!r}: {e}")


def _sums_in_place(job: Job) -> bool:
    """The sum is built in the input's own memory (the accumulator dtype is the tensor's)."""
    return job.inplace and job.tensor.dtype in (torch.float32, torch.float64)


def local_mask(job: Job) -> torch.Tensor:
    """The block mask of the job's tensor, computed once and shared by the stages.

    When the sum will be built in the tensor, the same pass turns -0 in all-zero blocks into +0:
    then the tensor is +0 outside its non-zero blocks and the decode need only rewrite the
    blocks the segments carry, which include those.
    """
    if job.mask is None:
        job.mask = _C.block_mask(job.tensor, job.block_size, _sums_in_place(job))
    job.stats.setdefault("nnz_local", int(job.mask.sum()))
    return job.mask


def decode_sum(job: Job, gathered: torch.Tensor, acc: torch.Tensor, part_is_rank: bool) -> None:
    """Validates one segment per rank, adds them in rank order into ``acc`` (from
    ``accumulator``) and applies the op's scale, touching only the blocks the segments carry."""
    t = job.tensor
    try:
        counts, nnz, union = _C.decode_sum(
            gathered, acc, job.block_size, job.meta, blocks.DTYPE_CODES[t.dtype], t.numel(),
            job.size, part_is_rank, overwrite=acc.data_ptr() == t.data_ptr(), scale=job.scale)
    except RuntimeError as e:
        raise error(job, e) from e
    nblocks = max(1, blocks.num_blocks(t.numel(), job.block_size))
    job.stats.update(nnz=list(nnz), union=union, block_density=sum(nnz) / len(nnz) / nblocks)


def accumulator(job: Job) -> torch.Tensor:
    """Sum buffer, zero outside the blocks the segments will carry. In place when the dtype
    allows: the tensor's own pages are warm, while a fresh buffer of a large tensor costs more in
    page faults than the whole sparse exchange; and it is already zero there (``local_mask``)."""
    t = job.tensor
    if _sums_in_place(job):
        return t
    return blocks.accumulator(t.numel(), t.dtype)


def finish(acc: torch.Tensor, job: Job) -> torch.Tensor:
    """Rounds the scaled sum once to the tensor's dtype."""
    if acc.data_ptr() == job.tensor.data_ptr():
        return acc
    return job.tensor.copy_(acc) if job.inplace else acc.to(job.tensor.dtype)
