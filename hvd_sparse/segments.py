"""Decoding gathered segments (csrc/segment.h) into a sum, with errors that name the tensor."""
from __future__ import annotations

import torch

from . import _C, blocks
from .engine import Job
from .errors import HvdSparseError


def error(job: Job, e: Exception) -> HvdSparseError:
    return HvdSparseError(f"hvd_sparse: tensor {job.name!r}: {e}")


def local_mask(job: Job) -> torch.Tensor:
    """The block mask of the job's tensor, computed once and shared by the stages.

    In place, the same pass turns -0 in all-zero blocks into +0: then the tensor is +0 outside
    its non-zero blocks and the result need only rewrite the blocks some rank sent, which
    include those (see ``output``).
    """
    if job.mask is None:
        job.mask = _C.block_mask(job.tensor, job.block_size, job.inplace)
    job.stats.setdefault("nnz_local", int(job.mask.sum()))
    return job.mask


def decode_sum(job: Job, gathered: torch.Tensor, out: torch.Tensor, part_is_rank: bool) -> None:
    """Validates one segment per rank and writes their sum (added in rank order, scaled, rounded
    once) into ``out`` (from ``output``), touching only the blocks the segments carry."""
    t = job.tensor
    try:
        counts, nnz, union = _C.decode_sum(
            gathered, out, job.block_size, job.meta, blocks.DTYPE_CODES[t.dtype], t.numel(),
            job.size, part_is_rank, scale=job.scale)
    except RuntimeError as e:
        raise error(job, e) from e
    nblocks = max(1, blocks.num_blocks(t.numel(), job.block_size))
    job.stats.update(nnz=list(nnz), union=union, block_density=sum(nnz) / len(nnz) / nblocks)


def output(job: Job) -> torch.Tensor:
    """Where the result is written, +0 outside the blocks some rank sends: in place the tensor
    itself (see ``local_mask``), else fresh zeros, of which only the written pages cost anything
    (``blocks.zeros``)."""
    t = job.tensor
    return t if job.inplace else blocks.zeros(t.numel(), t.dtype)
