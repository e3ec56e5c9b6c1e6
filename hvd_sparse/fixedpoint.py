"""Fixed point for integer-summing aggregators (docs/PROTOCOL.md, "Fixed point").

A tensor travels as int32 ``q = round(x * 2^e)`` with one exponent ``e`` that every rank agrees
on: the largest for which ``nworkers`` values of magnitude ``M`` (the largest over all ranks)
cannot sum outside the int32 range. Schemes agree on ``M`` with one tiny max-allreduce
(schemes/common.py ``agree``). Pure arithmetic: no torch, no Horovod.
"""
from __future__ import annotations

import math
from fractions import Fraction

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
