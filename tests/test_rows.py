"""The row-sum kernel behind the "rows" scheme (csrc/rows.cpp) against a float64 reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sparse import _C

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 400), nrows=st.integers(1, 60), width=st.integers(1, 9),
       dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1.0, 0.25, 3.0]),
       seed=st.integers(0, 2**31))
def test_sums_each_distinct_row_like_float64_index_add(n, nrows, width, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-2, nrows, (n,), generator=g)  # negatives are header rows: skipped
    vals = torch.randn(n, width, generator=g).to(dtype)
    out_rows, out_vals = _C.sum_rows(rows, vals, nrows, scale)
    keep = rows >= 0
    ref = torch.zeros(nrows, width, dtype=torch.float64)
    ref.index_add_(0, rows[keep], vals[keep].double())
    want = torch.unique(rows[keep])
    assert torch.equal(out_rows, want)
    assert out_vals.dtype == dtype and out_vals.shape == (len(want), width)
    expect = ref[want] * scale
    assert torch.allclose(out_vals.double(), expect, rtol=TOL[dtype],
                          atol=TOL[dtype] * max([1.0, *expect.abs().flatten().tolist()]))


def test_adds_equal_rows_in_the_order_given():
    # float32 addition is not associative: rows must be added in input (rank) order, so every
    # rank gets the same bits. 1e8 + 1 rounds back to 1e8 in float32.
    big, one = torch.tensor([[1e8]]), torch.tensor([[1.0]])
    for order, want in (([big, one, -big], 0.0), ([big, -big, one], 1.0)):
        _, out = _C.sum_rows(torch.tensor([4, 4, 4]), torch.cat(order), 5)
        assert out.item() == want


def test_hybrid_values_and_nan_propagate():
    vals = torch.zeros(3, 2, 2)
    vals[1, 0, 1] = float("nan")
    r, v = _C.sum_rows(torch.tensor([2, 2, 0]), vals, 3)
    assert r.tolist() == [0, 2] and v.shape == (2, 2, 2) and bool(v[1, 0, 1].isnan())


@pytest.mark.parametrize("bad", [torch.tensor([0, 7]), torch.tensor([9])])
def test_rows_out_of_range_raise(bad):
    with pytest.raises(RuntimeError, match="out of range"):
        _C.sum_rows(bad, torch.zeros(len(bad), 3), 7)
