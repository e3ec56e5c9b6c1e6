"""Rows: sparse COO gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``) reduced from
their rows, never densified.

Each rank first sums its gradient's repeated rows (an embedding gradient holds one row per
lookup; Horovod's sparse path ships every one of them), then the distinct rows and their values
are allgathered and every rank sums them in rank order (csrc/rows.cpp): the same coalesced
sparse result everywhere, at a cost proportional to the rows touched, not to the table. One
header row per rank carries a fingerprint of the tensor's shape and dtype, so ranks that
disagree raise instead of adding unrelated rows. A COO tensor with several sparse dimensions is
reduced over its linearized indices.
"""
from __future__ import annotations

import math

import torch

from .._C import sum_rows
from ..engine import Stage
from ..errors import HvdSparseError
from ..job import Job
from .common import error

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def supported(t: torch.Tensor) -> bool:
    return t.is_sparse and t.dtype in FLOATS and t.device.type == "cpu"


def run(job: Job) -> Stage:
    g = job.tensor
    k = g.sparse_dim()
    nrows = math.prod(g.shape[:k])
    idx, vals = g._indices(), g._values().contiguous()
    line = idx[0] if k == 1 else _linear(idx, g.shape[:k])
    rows, vals = sum_rows(line.contiguous(), vals, nrows)
    header = torch.tensor([-1 - job.meta])  # negative: never a row; sum_rows skips it
    vals = torch.cat([vals.new_zeros((1, *vals.shape[1:])), vals])
    # The allgather only moves values: bfloat16 (which Horovod 0.28 lacks) travels as its bits.
    bf16 = vals.dtype == torch.bfloat16
    all_rows, all_vals = yield "rows", job.comm.allgather_many(
        [torch.cat([header, rows]), vals.view(torch.int16) if bf16 else vals],
        job.op_name("rows"))
    if bf16:
        all_vals = all_vals.view(torch.bfloat16)
    headers = all_rows[all_rows < 0]
    if headers.numel() != job.size or bool((headers != header).any()):
        raise HvdSparseError(f"hvd_sparse: tensor {job.name!r}: tensor mismatch across ranks: "
                             "the ranks' sparse gradients differ in shape or dtype")
    try:
        out_rows, out_vals = sum_rows(all_rows, all_vals, nrows, job.scale)
    except RuntimeError as e:
        raise error(job, e) from e
    n = job.size
    gathered = all_rows.numel() * all_rows.element_size() + all_vals.nbytes
    own = (rows.numel() + 1) * rows.element_size() + vals.nbytes  # header rows included
    s = job.stats
    s.scheme = "rows"
    s.nnz_local, s.rows_local, s.union = int(idx.shape[1]), int(rows.numel()), int(out_rows.numel())
    s.bytes_sent, s.bytes_received = int(gathered * (n - 1) / n), gathered - own
    indices = out_rows.unsqueeze(0) if k == 1 else _unravel(out_rows, g.shape[:k])
    return torch.sparse_coo_tensor(indices, out_vals, g.shape, is_coalesced=True,
                                   check_invariants=False)  # sorted and distinct by construction


def _linear(idx: torch.Tensor, dims: torch.Size) -> torch.Tensor:
    strides = torch.tensor([math.prod(dims[d + 1:]) for d in range(len(dims))])
    return (idx * strides.unsqueeze(1)).sum(0)


def _unravel(line: torch.Tensor, dims: torch.Size) -> torch.Tensor:
    out = []
    for d in reversed(dims):
        out.append(line % d)
        line = line // d
    return torch.stack(out[::-1])
