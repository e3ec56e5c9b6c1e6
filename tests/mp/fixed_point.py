"""omnireduce with HVD_SPARSE_FIXED_POINT=1 (docs/PROTOCOL.md, "Fixed point") on 4 ranks.

Per dtype x density: the result is within the documented bound of the float64 sum (plus one
ulp of the dtype for the final rounding), equals the integer model built from every rank's
input (which shows it went through fixed point), and its digest is reported for the
cross-rank comparison. NaN/Inf on one rank: the dense fallback, equal to hvd.allreduce. A
rank that breaks the exponent rule: ERROR OVERFLOW, an error naming the tensor, or with
fallback="dense" the dense result.
"""
from __future__ import annotations

import hashlib
import math
from fractions import Fraction

import horovod.torch as hvd
import numpy as np
import torch
from common import case, report, start

import hvd_sparse
from hvd_sparse import basics, fixedpoint

DTYPES = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}  # significant bits
MIN_EXP = {torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}  # least normal
DENSITIES = [0.0, 1e-4, 0.01, 0.3, 1.0]
NUMEL = 100_003  # a partial last block


def sample(density: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nblocks = -(-NUMEL // 256)
    chosen = torch.rand(nblocks, generator=g) < density
    chosen[int(torch.randint(nblocks, (1,), generator=g))] |= density > 0  # 1e-4: one block
    chosen = chosen.repeat_interleave(256)[:NUMEL]
    scale = 10.0 ** float(torch.randint(-3, 3, (1,), generator=g))  # magnitudes differ by rank
    return (torch.randn(NUMEL, generator=g) * scale * chosen).to(dtype)


def largest_exponent(m: float, n: int) -> int:
    """The rule of docs/PROTOCOL.md, by exact search: max e with n m 2^e <= 2^31 - 1."""
    e = math.floor(math.log2((2**31 - 1) / (n * m)))
    while Fraction(m) * n * Fraction(2) ** (e + 1) <= 2**31 - 1:
        e += 1
    while Fraction(m) * n * Fraction(2) ** e > 2**31 - 1:
        e -= 1
    return e


def ulp(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Spacing of the dtype's values at |v| (subnormals included)."""
    _, k = np.frexp(np.abs(v))  # |v| in [2^(k-1), 2^k)
    return np.ldexp(1.0, np.maximum(k, MIN_EXP[dtype] + 1) - DTYPES[dtype])


def round_to(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float64 rounded once to the dtype, nearest, ties to even (v / ulp is exact)."""
    u = ulp(v, dtype)
    return np.rint(v / u) * u


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    start(probe="off", small_bytes=1024)
    rank, n = hvd.rank(), hvd.size()
    assert basics.state().config.fixed_point, "HVD_SPARSE_FIXED_POINT=1 not read"
    results: dict[str, object] = {}
    for k, (dtype, density) in enumerate((d, x) for d in DTYPES for x in DENSITIES):
        name = f"fixed/{str(dtype)[6:]}/{density:g}"
        t = sample(density, dtype, seed=100 * k + rank)
        op = hvd.Sum if k % 2 else hvd.Average

        def check(t=t, name=name, op=op, dtype=dtype) -> str:
            xs = hvd.allgather(t.double().view(1, -1), name=f"inputs.{name}").numpy()
            out = hvd_sparse.allreduce(t, name=name, op=op, scheme="omnireduce")
            results[f"_digest/{name}"] = digest(out)
            rec = hvd_sparse.metrics()[name]
            if rec["scheme"] != "omnireduce":
                return f"went {rec['scheme']} ({rec.get('reason')})"
            scale = 1.0 if op == hvd.Sum else 1.0 / n
            got, ref = out.double().numpy(), xs.sum(axis=0) * scale
            m = float(np.abs(xs).max())
            if m == 0:
                return "" if not got.any() else "non-zero result of zero inputs"
            e = largest_exponent(m, n)
            bound = n * 2.0 ** -(e + 1) * scale  # the spec's bound on the integer sum
            err = np.abs(got - ref)
            over = err > bound + ulp(np.maximum(np.abs(got), np.abs(ref)), dtype)
            if over.any():
                i = int(over.argmax())
                return f"error {err[i]:g} at {i} over bound {bound:g} + ulp (ref {ref[i]:g})"
            q = np.rint(np.ldexp(xs, e)).astype(np.int64).sum(axis=0)  # ties to even
            model = round_to(np.ldexp(q.astype(np.float64), -e) * scale, dtype)
            bad = np.flatnonzero(got != model)
            return f"{bad.size} values differ from the integer model, e.g. {bad[:3]}" \
                if bad.size else ""

        case(results, name, check)

    def nonfinite(bad: float) -> str:
        name = f"nonfinite/{bad}"
        t = sample(0.3, torch.float32, seed=7 + rank)
        if rank == 1:
            t[[5, 70_000]] = bad
        ref = hvd.allreduce(t, name=f"ref.{name}", op=hvd.Sum)
        out = hvd_sparse.allreduce(t, name=name, op=hvd.Sum, scheme="omnireduce")
        rec = hvd_sparse.metrics()[name]
        if (rec["scheme"], rec.get("reason")) != ("dense", "non-finite"):
            return f"not the dense fallback: {rec}"
        if math.isfinite(float(out[5])) or not torch.equal(out.isnan(), ref.isnan()):
            return "NaN/Inf lost, or at other places than hvd.allreduce's"
        return "" if torch.equal(out.nan_to_num(), ref.nan_to_num()) else \
            "differs from hvd.allreduce"

    case(results, "nonfinite/nan", lambda: nonfinite(math.nan))
    case(results, "nonfinite/inf", lambda: nonfinite(math.inf))

    # Rank 0 breaks the rule (an exponent 4 larger than agreed): a sum leaves int32.
    rule = fixedpoint.exponent
    if rank == 0:
        fixedpoint.exponent = lambda m, k: rule(m, k) + 4

    def overflow(name: str) -> torch.Tensor:
        return hvd_sparse.allreduce(torch.full((NUMEL,), 3.0), name=name, op=hvd.Sum,
                                    scheme="omnireduce")

    def overflow_error() -> str:
        try:
            overflow("overflow.error")
            return "no error"
        except hvd_sparse.HvdSparseError as e:
            ok = "'overflow.error'" in str(e) and "fixed-point overflow" in str(e)
            return "" if ok else f"unclear error: {e}"

    case(results, "overflow/error", overflow_error)
    hvd_sparse.init(probe="off", small_bytes=1024, fallback="dense")

    def overflow_fallback() -> str:
        out = overflow("overflow.fallback")
        rec = hvd_sparse.metrics()["overflow.fallback"]
        if rec["scheme"] != "dense":
            return f"not reduced dense: {rec}"
        return "" if torch.equal(out, torch.full((NUMEL,), 3.0 * n)) else "wrong dense result"

    case(results, "overflow/fallback", overflow_fallback)
    fixedpoint.exponent = rule
    report(results)


if __name__ == "__main__":
    main()
