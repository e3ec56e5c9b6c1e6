"""omnireduce with HVD_SPARSE_FIXED_POINT=1 (docs/PROTOCOL.md, "Fixed point") on 4 ranks.

Per dtype x density: the result is within the documented bound of the float64 sum (plus one
ulp of the dtype for the final rounding), equals the integer model built from every rank's
input (which shows it went through fixed point), and is bit-identical on every rank. NaN/Inf on
one rank: the dense fallback, equal to hvd.allreduce. A rank that breaks the exponent rule:
ERROR OVERFLOW, an error naming the tensor, or with fallback="dense" the dense result.
"""
from __future__ import annotations

import math
from fractions import Fraction

import horovod.torch as hvd
import numpy as np
import pytest
import torch
from driver import Launch
from ranktools import differing_ranks, digest, start

import hvd_sparse
from hvd_sparse import basics, fixedpoint

LAUNCHES = [Launch(np=4, env={"HVD_SPARSE_FIXED_POINT": "1", "HVD_SPARSE_TIMEOUT": "20"},
                   timeout=300)]
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


CASES = [(k, dtype, density) for k, (dtype, density) in
         enumerate((d, x) for d in DTYPES for x in DENSITIES)]


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start(probe="off", small_bytes=1024)
    assert basics.state().config.fixed_point, "HVD_SPARSE_FIXED_POINT=1 not read"


def test_every_dtype_and_density_is_a_case():
    assert len(CASES) == 15


@pytest.mark.parametrize("case", CASES, ids=[f"{str(d)[6:]}-{x:g}" for _, d, x in CASES])
def test_within_the_bound_and_the_integer_model_identical_on_every_rank(case):
    k, dtype, density = case
    rank, n = hvd.rank(), hvd.size()
    name = f"fixed/{str(dtype)[6:]}/{density:g}"
    t = sample(density, dtype, seed=100 * k + rank)
    op = hvd.Sum if k % 2 else hvd.Average
    xs = hvd.allgather(t.double().view(1, -1), name=f"inputs.{name}").numpy()
    out = hvd_sparse.allreduce(t, name=name, op=op, scheme="omnireduce")
    differ = differing_ranks(digest(out), name)
    rec = hvd_sparse.metrics()[name]
    assert rec["scheme"] == "omnireduce", f"went {rec['scheme']} ({rec.get('reason')})"
    assert differ == [], f"result differs from rank 0's on ranks {differ}"
    scale = 1.0 if op == hvd.Sum else 1.0 / n
    got, ref = out.double().numpy(), xs.sum(axis=0) * scale
    m = float(np.abs(xs).max())
    if m == 0:
        assert not got.any(), "non-zero result of zero inputs"
        return
    e = largest_exponent(m, n)
    bound = n * 2.0 ** -(e + 1) * scale  # the spec's bound on the integer sum
    err = np.abs(got - ref)
    over = err > bound + ulp(np.maximum(np.abs(got), np.abs(ref)), dtype)
    i = int(over.argmax())
    assert not over.any(), f"error {err[i]:g} at {i} over bound {bound:g} + ulp (ref {ref[i]:g})"
    q = np.rint(np.ldexp(xs, e)).astype(np.int64).sum(axis=0)  # ties to even
    model = round_to(np.ldexp(q.astype(np.float64), -e) * scale, dtype)
    bad = np.flatnonzero(got != model)
    assert bad.size == 0, f"{bad.size} values differ from the integer model, e.g. {bad[:3]}"


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_goes_dense_like_hvd_allreduce(bad):
    name = f"nonfinite/{bad}"
    t = sample(0.3, torch.float32, seed=7 + hvd.rank())
    if hvd.rank() == 1:
        t[[5, 70_000]] = bad
    ref = hvd.allreduce(t, name=f"ref.{name}", op=hvd.Sum)
    out = hvd_sparse.allreduce(t, name=name, op=hvd.Sum, scheme="omnireduce")
    rec = hvd_sparse.metrics()[name]
    assert (rec["scheme"], rec.get("reason")) == ("dense", "non-finite"), \
        f"not the dense fallback: {rec}"
    assert not math.isfinite(float(out[5])) and torch.equal(out.isnan(), ref.isnan()), \
        "NaN/Inf lost, or at other places than hvd.allreduce's"
    assert torch.equal(out.nan_to_num(), ref.nan_to_num()), "differs from hvd.allreduce"


@pytest.fixture
def rank0_breaks_the_rule(monkeypatch):
    """Rank 0 uses an exponent 4 larger than agreed: a sum leaves int32."""
    if hvd.rank() == 0:
        rule = fixedpoint.exponent
        monkeypatch.setattr(fixedpoint, "exponent", lambda m, k: rule(m, k) + 4)


def overflow(name: str) -> torch.Tensor:
    return hvd_sparse.allreduce(torch.full((NUMEL,), 3.0), name=name, op=hvd.Sum,
                                scheme="omnireduce")


def test_overflow_is_an_error_naming_the_tensor(rank0_breaks_the_rule):
    with pytest.raises(hvd_sparse.HvdSparseError) as e:
        overflow("overflow.error")
    assert "'overflow.error'" in str(e.value) and "fixed-point overflow" in str(e.value), \
        f"unclear error: {e.value}"


def test_overflow_with_fallback_goes_dense(rank0_breaks_the_rule):
    hvd_sparse.init(probe="off", small_bytes=1024, fallback="dense")
    out = overflow("overflow.fallback")
    rec = hvd_sparse.metrics()["overflow.fallback"]
    assert rec["scheme"] == "dense", f"not reduced dense: {rec}"
    assert torch.equal(out, torch.full((NUMEL,), 3.0 * hvd.size())), "wrong dense result"
