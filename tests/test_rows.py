"""The row-sum kernel behind the "rows" scheme (csrc/rows.cpp) against a float64 reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sparse import _C
from hvd_sparse.schemes import rows

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
    assert rounded_alike(out_vals, ref[want] * scale,
                         magnitude(rows[keep], vals[keep], nrows)[want] * scale, dtype)


def magnitude(rows: torch.Tensor, vals: torch.Tensor, nrows: int) -> torch.Tensor:
    """Per row, the sum of its terms' absolute values: what a sum's rounding error scales with
    (a row of 95 terms that cancel to 0.46 carries the rounding of partial sums near 10)."""
    out = torch.zeros(nrows, *vals.shape[1:], dtype=torch.float64)
    return out.index_add_(0, rows, vals.double().abs())


def rounded_alike(got: torch.Tensor, expect: torch.Tensor, mag: torch.Tensor,
                  dtype: torch.dtype) -> bool:
    """``got`` equals the float64 ``expect`` to the dtype's rounding of a sum of terms whose
    absolute values add up to ``mag``."""
    return torch.allclose(got.double(), expect, rtol=TOL[dtype],
                          atol=TOL[dtype] * max([1.0, *mag.abs().flatten().tolist()]))


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


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), nvals=st.integers(1, 40), nrows=st.integers(1, 60),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_uses_sums_the_value_row_each_row_names(n, nvals, nrows, dtype, seed):
    """``uses``: row i adds value row uses[i] (an EmbeddingBag's gradient sent with each bag's
    row once), like expanding the values first."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-1, nrows, (n,), generator=g)
    vals = torch.randn(nvals, 3, generator=g).to(dtype)
    uses = torch.randint(0, nvals, (n,), generator=g)
    out_rows, out_vals = _C.sum_rows(rows, vals, nrows, 0.5, uses)
    keep = rows >= 0
    ref = torch.zeros(nrows, 3, dtype=torch.float64)
    ref.index_add_(0, rows[keep], vals[uses[keep]].double())
    want = torch.unique(rows[keep])
    assert torch.equal(out_rows, want)
    assert rounded_alike(out_vals, ref[want] * 0.5,
                         magnitude(rows[keep], vals[uses[keep]], nrows)[want] * 0.5, dtype)


@pytest.mark.parametrize("uses", [torch.tensor([0, 2]), torch.tensor([-1, 0]),
                                  torch.tensor([0])])
def test_uses_out_of_range_or_short_raise(uses):
    with pytest.raises(RuntimeError, match="uses"):
        _C.sum_rows(torch.tensor([1, 3]), torch.zeros(2, 3), 7, 1.0, uses)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), nvals=st.integers(1, 40), cuts=st.lists(st.integers(0, 40)),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_values_in_parts_sum_as_float64(n, nvals, cuts, dtype, seed):
    """Value rows in parts (each rank's, where an allgather left them; empty parts too), read
    through ``uses`` or one per row: the float64 reference of the joined rows, and the same
    bits as the joined rows give."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-1, 50, (n,), generator=g)
    vals = torch.randn(nvals, 2, 3, generator=g).to(dtype)
    uses = torch.randint(0, nvals, (n,), generator=g)
    at = sorted({0, nvals, *(c for c in cuts if c <= nvals)})
    parts = [vals[a:b] for a, b in zip(at, at[1:], strict=False)] + [vals[:0]]
    out_rows, out_vals = _C.sum_rows(rows, parts, 50, 0.5, uses)
    keep = rows >= 0
    ref = torch.zeros(50, 2, 3, dtype=torch.float64)
    ref.index_add_(0, rows[keep], vals[uses[keep]].double())
    want = torch.unique(rows[keep])
    assert torch.equal(out_rows, want)
    assert rounded_alike(out_vals, ref[want] * 0.5,
                         magnitude(rows[keep], vals[uses[keep]], 50)[want] * 0.5, dtype)
    assert torch.equal(out_vals.view(-1).view(torch.uint8),
                       _C.sum_rows(rows, vals, 50, 0.5, uses)[1].view(-1).view(torch.uint8))
    if nvals == n:
        assert torch.equal(_C.sum_rows(rows, parts, 50)[1], _C.sum_rows(rows, vals, 50)[1])


@pytest.mark.parametrize("parts", [[], [torch.zeros(2, 3), torch.zeros(1, 3).double()],
                                   [torch.zeros(2, 3), torch.zeros(1, 4)],
                                   [torch.zeros(2, 3), torch.zeros(3, 2).t()]])
def test_parts_of_other_kinds_raise(parts):
    with pytest.raises(RuntimeError, match="values"):
        _C.sum_rows(torch.tensor([1, 3, 4]), parts, 7)


H = -7  # the header row the ranks' parts start with
GATHERED = torch.tensor([H, 5, 6, 7, H, 8, 9])  # two ranks: 3 rows, then 2


@pytest.mark.parametrize("runs", [[2, 1, 1], [1, 4, 0], [0, 0], [0], [1, 3, 0, 2], [-1, 0],
                                  [2**62, 0], [3, 2**62, 2**62, 3, 0],
                                  [3, 2**63 - 1, 2**63 - 1, 5, 0]])
def test_malformed_runs_raise_naming_the_rank(runs):
    """What the ranks send (their runs) must add up to their rows, one list per rank."""
    with pytest.raises(RuntimeError, match="rank [01] sent malformed runs|do not match"):
        _C.gathered_uses(GATHERED, H, torch.tensor(runs), 5, 2)


@pytest.mark.parametrize("rows_", [[H, 5, 6, 7, -8, 8, 9], [H, 5, 6, 7, 4, 8, 9],
                                   [H, 5, H, 7, H, 8, 9], [5, H, 6, 7, H, 8, 9]])
def test_headers_that_differ_or_miscount_are_a_mismatch(rows_):
    with pytest.raises(RuntimeError, match="mismatch across ranks"):
        _C.gathered_uses(torch.tensor(rows_), H, torch.tensor([0, 0]), 7, 2)


def test_runs_expand_to_each_ranks_value_rows():
    # rank 0: 3 rows from 2 value rows (runs 2, 1); rank 1: 2 rows, a value each
    uses = _C.gathered_uses(GATHERED, H, torch.tensor([2, 2, 1, 0]), 6, 2)
    assert uses.tolist() == [0, 1, 1, 2, 3, 4, 5]
    assert _C.gathered_uses(GATHERED, H, torch.tensor([0, 0]), 7, 2) is None  # a value each


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), bits=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_sorts_rows_of_any_table_size(n, bits, seed):
    """Rows are sorted 11 bits a pass: tables of up to 2^40 rows (several passes, each of which
    must keep equal rows in input order) against torch.unique and float64 index_add."""
    g = torch.Generator().manual_seed(seed)
    nrows = 2**bits
    rows = torch.randint(0, nrows, (n,), generator=g)
    rows[n // 2:] = rows[:n - n // 2].clone()  # rows repeated, far apart
    vals = torch.randn(n, 3, generator=g, dtype=torch.float64)
    out_rows, out_vals = _C.sum_rows(rows, vals, nrows)
    want, where = torch.unique(rows, return_inverse=True)
    ref = torch.zeros(len(want), 3, dtype=torch.float64).index_add_(0, where, vals)
    assert torch.equal(out_rows, want)
    assert torch.allclose(out_vals, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 700, 5000])
def test_rows_grouped_by_bitmap_or_by_sort_alike(n):
    """Rows are grouped by a bitmap of the table where it is small beside the rows (up to 64 x
    (2n + 1024) rows), else sorted: on both sides of that bound, and at the edges of the
    bitmap's words (rows 0, 63, 64, the last), the same rows and float64 sums as the
    reference, equal rows added in input order."""
    g = torch.Generator().manual_seed(n)
    bound = 64 * (2 * n + 1024)
    for nrows in (bound, bound + 1, 65, 64):
        rows = torch.randint(0, nrows, (n,), generator=g)
        edges = torch.tensor([0, min(63, nrows - 1), min(64, nrows - 1), nrows - 1])
        rows = torch.cat([rows, edges, edges.flip(0)])
        vals = torch.randn(len(rows), 2, generator=g, dtype=torch.float64)
        out_rows, out_vals = _C.sum_rows(rows, vals, nrows)
        want, where = torch.unique(rows, return_inverse=True)
        ref = torch.zeros(len(want), 2, dtype=torch.float64).index_add_(0, where, vals)
        assert torch.equal(out_rows, want), nrows
        assert torch.allclose(out_vals, ref, rtol=1e-12, atol=1e-12), nrows
        assert _C.count_rows(rows, nrows) == len(want)
    big, one = torch.tensor([[1e8]]), torch.tensor([[1.0]])
    for order, want_sum in (([big, one, -big], 0.0), ([big, -big, one], 1.0)):
        _, out = _C.sum_rows(torch.tensor([63, 5, 63, 63]),
                             torch.cat([order[0], one, *order[1:]]), 64)
        assert out[1].item() == want_sum


def test_equal_rows_stay_in_input_order_across_passes():
    # a row past 2^22 takes three passes; each keeps 1e8, 1, -1e8 in the order given
    big, one = torch.tensor([[1e8]]), torch.tensor([[1.0]])
    row = 2**35 + 2**17 + 5
    for order, want in (([big, one, -big], 0.0), ([big, -big, one], 1.0)):
        _, out = _C.sum_rows(torch.tensor([row, 7, row, row]),
                             torch.cat([order[0], one, *order[1:]]), 2**36)
        assert out[1].item() == want


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200), width=st.integers(1, 5), distinct=st.integers(1, 4),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_row_runs_start_where_a_row_differs_from_the_last(n, width, distinct, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(distinct, width, generator=g).to(dtype)
    vals = pool[torch.randint(0, distinct, (n,), generator=g)]
    want = [i for i in range(n) if i == 0 or not torch.equal(vals[i], vals[i - 1])]
    assert _C.row_runs(vals).tolist() == want


def test_row_runs_compare_bits():
    # -0.0 == 0.0 and NaN != NaN as floats; as rows sent once per run, their bits decide
    vals = torch.tensor([[0.0], [-0.0], [float("nan")], [float("nan")], [1.0]])
    assert _C.row_runs(vals).tolist() == [0, 1, 2, 4]


def test_aggregation_tried_only_where_its_bytes_could_win():
    """auto's gate on the aggregated trial (rows.may_win), on a 1 Gbit/s link model of 4
    ranks: with colocated aggregators, ranks holding the same rows move half the allgather's
    bytes through the busiest link (worth a try); disjoint rows, or one aggregator host that
    carries every rank's union, cannot win."""
    from hvd_sparse.costmodel import NetModel

    base = NetModel((1e-4, 1e-9), (1e-4, 1e-9), (1e-4, 1e-9), 2e9, 4e9, source="probed",
                    omnireduce=(1e-4, 1e-6, 1e-9))
    colocated = NetModel.for_link(1e9, 4, base, aggregators=0)
    one_host = NetModel.for_link(1e9, 4, base, aggregators=1)
    d, row = 10_000, 256
    shared, disjoint = 4 * d * row, 4 * d * row  # bytes gathered: each rank's d rows
    assert rows.may_win(colocated, 4, d, shared, row)
    assert not rows.may_win(colocated, 4, 4 * d, disjoint, row)
    assert not rows.may_win(one_host, 4, d, shared, row)
    assert rows.may_win(NetModel.default((1024, 8)), 4, 4 * d, disjoint, row)  # no model
