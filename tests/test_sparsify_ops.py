"""The sparsifiers' device operations (sparsifiers/ops.py: torch operations, what a GPU tensor
runs) against the C++ kernels of hvd_sparse._C, on CPU tensors: each operation, then whole
sparsifiers over several error-feedback steps. Both must select exactly the same units."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cuda_host import tensors

from hvd_sparse import _C, DGC, ExDyna, Threshold, TopK, device
from hvd_sparse.sparsifiers import ops


def torch_ops(f, *args):
    """``f(*args)`` on the device path: CPU tensors take the torch operations."""
    device.CPU_AS_DEVICE = True
    try:
        return f(*args)
    finally:
        device.CPU_AS_DEVICE = False


def finite(x: torch.Tensor) -> torch.Tensor:
    return x.nan_to_num(0.0, 0.0, 0.0)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (Inf compared as a value)."""
    keep_inf = (0.0, torch.inf, -torch.inf)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(*keep_inf),
                                                             b.nan_to_num(*keep_inf))


@settings(max_examples=100, deadline=None)
@given(case=tensors(), thr=st.sampled_from([0.0, 0.5, 1.7, 1e-45]), seed=st.integers(0, 2**40),
       m=st.integers(1, 3000))
def test_element_operations_match(case, thr, seed, m):
    x, _ = case
    assert torch_ops(ops.count_nonfinite, x) == _C.count_nonfinite(x)
    assert torch.equal(torch_ops(ops.select_abs_ge, x, thr), _C.select_abs_ge(x, thr))
    if x.numel():
        assert same(torch_ops(ops.sample_abs, x, m, seed), _C.sample_abs(x, m, seed))
        f = finite(x)
        for k in sorted({0, 1, f.numel() // 3, f.numel()}):
            assert torch.equal(torch_ops(ops.topk_abs, f, k, seed), _C.topk_abs(f, k, seed))


@pytest.mark.parametrize("n", [1, 7, 1 << 20, (1 << 24) - 3])
@pytest.mark.parametrize("seed", [0, 1, 12345, 2**62 + 11])
def test_sample_positions_are_the_cpp_generators(n, seed):
    """splitmix64 in wrapping int64 arithmetic, reduced as uint64: the C++ positions, exactly."""
    x = torch.arange(n, dtype=torch.float64)
    assert torch.equal(ops.positions(seed, 5000, n, x.device), _C.sample_abs(x, 5000, seed).long())


def test_topk_ties_are_taken_in_index_order():
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, 2.0, -2.0, 2.0, 0.0])
    for k in range(9):
        assert torch.equal(torch_ops(ops.topk_abs, x, k), _C.topk_abs(x, k))


@settings(max_examples=100, deadline=None)
@given(case=tensors(), seed=st.integers(0, 2**31), m=st.integers(1, 500),
       cut=st.floats(0.0, 1.0), thr=st.sampled_from([0.0, 0.05, 0.3, 2.0]))
def test_block_operations_match(case, seed, m, cut, thr):
    x, bs = case
    nblocks = -(-x.numel() // bs)
    if nblocks == 0:
        return
    b0 = int(cut * (nblocks - 1))
    got = torch_ops(ops.sample_block_scores, x, bs, b0, nblocks, m, seed)
    want = _C.sample_block_scores(x, bs, b0, nblocks, m, seed)
    assert same(got, want)
    idx, best, bad = torch_ops(ops.select_blocks, x, bs, b0, nblocks, thr)
    ref_idx, ref_best, ref_bad = _C.select_blocks(x, bs, b0, nblocks, thr)
    assert torch.equal(idx, ref_idx) and bad == ref_bad
    assert best == pytest.approx(ref_best, rel=1e-12)
    bounds = torch.tensor([0, b0, nblocks], dtype=torch.int64)
    counts, nnz, nonfinite = torch_ops(ops.partition_counts, x, bs, bounds)
    ref_counts, ref_nnz, ref_nonfinite = _C.partition_counts(x, bs, bounds)
    assert torch.equal(counts, ref_counts) and (nnz, nonfinite) == (ref_nnz, ref_nonfinite)


@settings(max_examples=100, deadline=None)
@given(case=tensors(), keep=st.floats(0.0, 1.0), seed=st.integers(0, 2**31),
       clear=st.booleans())
def test_memory_operations_match(case, keep, seed, clear):
    x, bs = case
    g = torch.from_numpy(np.random.default_rng(seed).standard_normal(x.numel())).to(x.dtype)
    units = -(-x.numel() // bs)
    idx = torch.from_numpy(np.flatnonzero(np.random.default_rng(seed).random(units) < keep))

    def both(f, *tensors_and_args):
        a = [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors_and_args]
        b = [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors_and_args]
        ra, rb = torch_ops(getattr(ops, f), *a), getattr(_C, f)(*b)
        assert ra == rb, f
        for ta, tb in zip(a, b, strict=True):
            if isinstance(ta, torch.Tensor):
                assert same(ta, tb), f

    both("accumulate_", x, g)
    both("momentum_accumulate_", g, x, g * 0.5, 0.9)
    both("zero_units_", x, idx, bs)
    src, dst = x.clone(), g.clone()
    ref_src, ref_dst = x.clone(), g.clone()
    torch_ops(ops.extract_, src, dst, idx, bs, clear)
    _C.extract_(ref_src, ref_dst, idx, bs, clear)
    for a, b in ((src, ref_src), (dst, ref_dst)):
        assert same(a, b)
    inplace, ref_inplace = x.clone(), x.clone()
    torch_ops(ops.extract_, inplace, inplace, idx, bs, False)
    _C.extract_(ref_inplace, ref_inplace, idx, bs, False)
    assert same(inplace, ref_inplace)


SPARSIFIERS = {
    "topk": lambda: TopK(0.01, rank=0, size=1),
    "threshold": lambda: Threshold(1.5, rank=0, size=1),
    "dgc": lambda: DGC(0.02, rank=0, size=1),
    "exdyna": lambda: ExDyna(0.01, rank=1, size=4),
    "exdyna-blocks": lambda: ExDyna(0.01, rank=1, size=4, per_element=False),
    "exdyna-warmup": lambda: ExDyna(0.01, warmup=3, rank=3, size=4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(SPARSIFIERS))
def test_sparsifiers_select_the_same_on_the_device_path(kind, dtype):
    """Six error-feedback steps of each sparsifier (observing a reduced gradient between them,
    with a NaN on one step) give the same gradients and memory on both paths."""
    on_device, native = SPARSIFIERS[kind](), SPARSIFIERS[kind]()
    rng = np.random.default_rng(7)
    for step in range(6):
        g = torch.from_numpy(rng.standard_normal(200_003) * (rng.random(200_003) < 0.5)).to(dtype)
        if step == 3:
            g[17] = float("nan")
        got, want = torch_ops(on_device, "w", g.clone(), 4), native("w", g.clone(), 4)
        assert same(got, want), \
            f"step {step}"
        reduced = want * 3
        torch_ops(on_device.observe, "w", reduced, 4)
        native.observe("w", reduced, 4)
    for name, buf in native.memory.__dict__.items():
        if isinstance(buf, dict):
            assert all(torch.equal(buf[k], getattr(on_device.memory, name)[k]) for k in buf), name
