"""Fixed point for integer-summing aggregators (docs/PROTOCOL.md, "Fixed point").

A tensor travels as int32 ``q = round(x * 2^e)`` with one exponent ``e`` that every rank agrees
on: the largest for which ``nworkers`` values of magnitude ``M`` (the largest over all ranks)
cannot sum outside the int32 range. Schemes get it with ``agree``: one tiny max-allreduce.
"""
from __future__ import annotations

import math
from collections.abc import Generator
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import horovod.torch as hvd
import torch

if TYPE_CHECKING:
    from .engine import Job

INT32_MAX = 2**31 - 1


def _fits(max_abs: float, nworkers: int, e: int) -> bool:
    return Fraction(max_abs) * nworkers * Fraction(2) ** e <= INT32_MAX  # exact, any e


def exponent(max_abs: float, nworkers: int) -> int:
    """The largest ``e`` with ``nworkers * max_abs * 2^e <= 2^31 - 1`` (0 when ``max_abs`` is 0)."""
    max_abs = float(max_abs)  # numpy and torch scalars too
    if not (math.isfinite(max_abs) and max_abs >= 0) or nworkers < 1:
        raise ValueError(f"exponent: need a finite max_abs >= 0 and nworkers >= 1, got "
                         f"{max_abs!r}, {nworkers!r}")
    if max_abs == 0:
        return 0
    _, k = math.frexp(max_abs)  # max_abs in [2^(k-1), 2^k)
    e = 31 - k - (nworkers - 1).bit_length()  # within a step or two of the answer
    while _fits(max_abs, nworkers, e + 1):
        e += 1
    while not _fits(max_abs, nworkers, e):
        e -= 1
    return e


def error_bound(max_abs: float, nworkers: int) -> float:
    """Largest error of a sum of ``nworkers`` values each rounded to a multiple of ``2^-e``
    (half a step each); 0 when ``max_abs`` is 0: zeros are sent exactly."""
    if max_abs == 0:
        return 0.0
    return math.ldexp(nworkers, -(exponent(max_abs, nworkers) + 1))


def agree(job: Job, *extra: float) -> Generator[tuple[str, int], Any,
                                                 tuple[int | None, list[float]]]:
    """Yields one max-allreduce of [max |x| over finite values, 1 if any value is NaN/Inf,
    *extra]; returns the job's exponent, or None when some rank holds a non-finite value (the
    tensor must not go in fixed point: its NaN/Inf would be lost), and the maxima of ``extra``
    over the ranks (what else a scheme agrees on in the same message)."""
    t = job.tensor
    lo, hi = (float(v) for v in torch.aminmax(t)) if t.numel() else (0.0, 0.0)
    nonfinite = not (math.isfinite(lo) and math.isfinite(hi))  # aminmax propagates NaN
    local = max(hi, -lo)
    if nonfinite:  # rare: the exact finite maximum costs one more pass
        local = float(t.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max())
    vec = torch.tensor([local, 1.0 if nonfinite else 0.0, *extra], dtype=torch.float64)
    out = yield "scale", hvd.allreduce_async(vec, name=job.op_name("scale"), op=hvd.Max,
                                             process_set=job.process_set)
    maxima = out[2:].tolist()
    if out[1] > 0:
        return None, maxima
    return exponent(float(out[0]), job.size), maxima
