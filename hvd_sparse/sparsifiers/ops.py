"""The sparsifiers' per-element operations, on the tensor's own device.

CPU tensors take ``hvd_sparse._C`` (C++, threaded). Tensors on an accelerator take torch
operations on that device (and ``_cuda``'s threshold kernel where built), so the error-feedback
memory stays in device memory and only scalars (a threshold, a count) reach the host. Both give
the same results: the same pseudo-random samples (splitmix64, computed on the device), top-k ties
taken in index order, block scores summed in float64. tests/test_sparsify_ops.py holds the torch
versions to the C++ ones on CPU tensors (``device.CPU_AS_DEVICE`` sends CPU tensors here too).

Selections are ascending int64 indices of units: elements, or blocks of ``unit`` elements.
"""
from __future__ import annotations

import torch

from .. import device
from .._C import (
    accumulate_ as _accumulate,
)
from .._C import (
    count_nonfinite as _count_nonfinite,
)
from .._C import (
    extract_ as _extract,
)
from .._C import (
    momentum_accumulate_ as _momentum_accumulate,
)
from .._C import (
    partition_counts as _partition_counts,
)
from .._C import (
    sample_abs as _sample_abs,
)
from .._C import (
    sample_block_scores as _sample_block_scores,
)
from .._C import (
    select_abs_ge as _select_abs_ge,
)
from .._C import (
    select_blocks as _select_blocks,
)
from .._C import (
    topk_abs as _topk_abs,
)
from .._C import (
    zero_units_ as _zero_units,
)


def _native(t: torch.Tensor) -> bool:
    return not device.on_device(t)


def count_nonfinite(t: torch.Tensor) -> int:
    if _native(t):
        return _count_nonfinite(t)
    return int((~torch.isfinite(t)).sum())


def accumulate_(acc: torch.Tensor, g: torch.Tensor) -> int:
    """acc += g; returns how many elements of acc are then not finite."""
    if _native(acc):
        return _accumulate(acc, g)
    return count_nonfinite(acc.add_(g))


def momentum_accumulate_(u: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         momentum: float) -> int:
    """u = momentum * u + g; v += u (DGC's momentum correction); the non-finite count of v."""
    if _native(u):
        return _momentum_accumulate(u, v, g, momentum)
    u.mul_(momentum).add_(g)
    return count_nonfinite(v.add_(u))


def _unit_mask(numel: int, idx: torch.Tensor, unit: int, dev: torch.device) -> torch.Tensor:
    mask = torch.zeros(-(-numel // unit), dtype=torch.bool, device=dev)
    mask[idx.to(dev)] = True
    return mask.repeat_interleave(unit)[:numel] if unit > 1 else mask


def extract_(src: torch.Tensor, dst: torch.Tensor, idx: torch.Tensor, unit: int,
             clear: bool) -> None:
    """dst = src's selected units, zeros elsewhere; with ``clear`` those units of src are
    zeroed (what stays in src is the residual). dst may be src."""
    if _native(src):
        return _extract(src, dst, idx, unit, clear)
    keep = _unit_mask(src.numel(), idx, unit, src.device)
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)
        if clear:
            src.masked_fill_(keep, 0)
    dst.masked_fill_(~keep, 0)


def zero_units_(t: torch.Tensor, idx: torch.Tensor, unit: int) -> None:
    """Zeroes the selected units of t (DGC's momentum factor masking)."""
    if _native(t):
        return _zero_units(t, idx, unit)
    t.masked_fill_(_unit_mask(t.numel(), idx, unit, t.device), 0)


def select_abs_ge(x: torch.Tensor, thr: float) -> torch.Tensor:
    """Ascending indices of the elements with |x| >= thr (thr rounded to x's dtype)."""
    if _native(x):
        return _select_abs_ge(x, thr)
    return device.select_ge(x, thr)


def topk_abs(x: torch.Tensor, k: int, seed: int = 0) -> torch.Tensor:
    """Ascending indices of the k largest |x|, ties at the k-th taken in index order (exact:
    ``seed`` only steers the C++ version's sampling)."""
    if _native(x):
        return _topk_abs(x, k, seed)
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    a = x.abs()
    kth = torch.topk(a, k, sorted=False).values.min()
    chosen = a > kth
    ties = (a == kth).nonzero().view(-1)[: k - int(chosen.sum())]
    chosen[ties] = True
    return chosen.nonzero().view(-1)


# splitmix64 in int64 arithmetic (wrapping, as uint64 would): the C++ generator, bit for bit.
def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:  # logical shift right
    return (x >> s) & ((1 << (64 - s)) - 1)


def positions(seed: int, m: int, n: int, dev: torch.device) -> torch.Tensor:
    """mix(seed + i) mod n for i < m, uint64 arithmetic: the C++ sampler's positions."""
    x = torch.arange(m, dtype=torch.int64, device=dev) + seed + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    r = x.remainder(n)  # of the signed value; a negative one is 2**64 less than its uint64
    return torch.where(x < 0, (r + (1 << 64) % n) % n, r)


def sample_abs(x: torch.Tensor, m: int, seed: int) -> torch.Tensor:
    """|x| at m pseudo-random positions (with replacement), as float32."""
    if _native(x):
        return _sample_abs(x, m, seed)
    if x.numel() == 0 or m <= 0:
        raise ValueError("sample_abs: empty tensor or sample")
    return x[positions(seed, m, x.numel(), x.device)].abs().float()


def _scores(x: torch.Tensor, bs: int, blocks: torch.Tensor) -> torch.Tensor:
    """Mean |x| (summed in float64) of the given blocks; the tail block is shorter."""
    sums = device.torch_blocks(x, bs).index_select(0, blocks).abs().double().sum(1)
    last = (x.numel() - 1) // bs
    lens = torch.where(blocks == last, x.numel() - last * bs, bs)
    return sums / lens


def sample_block_scores(x: torch.Tensor, bs: int, b0: int, b1: int, m: int,
                        seed: int) -> torch.Tensor:
    """Mean |x| of m pseudo-random blocks in [b0, b1), as float32."""
    if _native(x):
        return _sample_block_scores(x, bs, b0, b1, m, seed)
    if bs <= 0 or b0 >= b1 or m <= 0:
        raise ValueError("sample_block_scores: empty range or sample")
    return _scores(x, bs, b0 + positions(seed, m, b1 - b0, x.device)).float()


def select_blocks(x: torch.Tensor, bs: int, b0: int, b1: int,
                  thr: float) -> tuple[torch.Tensor, float, int]:
    """(ascending blocks in [b0, b1) whose mean |x| >= thr, the largest finite score, the number
    of blocks whose score is not finite)."""
    if _native(x):
        return _select_blocks(x, bs, b0, b1, thr)
    if b0 >= b1:
        return torch.empty(0, dtype=torch.int64, device=x.device), 0.0, 0
    score = _scores(x, bs, torch.arange(b0, b1, device=x.device))
    finite = torch.isfinite(score)
    best = float(torch.where(finite, score, 0.0).max())
    idx = ((score >= thr) & finite).nonzero().view(-1) + b0
    return idx, best, int((~finite).sum())


def partition_counts(x: torch.Tensor, bs: int,
                     bounds: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(non-zero blocks per partition [bounds[p], bounds[p+1]) as a CPU int64 tensor, non-zero
    elements of x, non-finite elements of x)."""
    if _native(x):
        return _partition_counts(x, bs, bounds)
    nblocks = -(-x.numel() // bs)
    b = bounds.tolist()
    if len(b) < 2 or b[0] != 0 or b[-1] != nblocks or b != sorted(b):
        raise ValueError(f"partition_counts: bounds {b} must ascend from 0 to {nblocks}")
    nonzero = (device.torch_blocks(x, bs) != 0).any(1)
    upto = torch.cat([nonzero.new_zeros(1, dtype=torch.int64), nonzero.cumsum(0)])
    at = bounds.to(x.device)
    counts = (upto[at[1:]] - upto[at[:-1]]).cpu()
    return counts, int((x != 0).sum()), count_nonfinite(x)
