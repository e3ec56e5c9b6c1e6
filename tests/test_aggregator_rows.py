"""Rows through the aggregators (OmniWorker.submit_rows, the aggregated path of the "rows"
scheme): each worker sends only its rows, packed, and gets back the union of every worker's
rows with their sums, ordered by row; checked against the float64 sum of the dense tables,
rounded once, and bit for bit alike on every worker."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from aggregator_helpers import WAIT, assert_result, bits, reference

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def table_rows(rng: np.random.Generator, nrows: int, width: int, count: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` distinct rows, hot ones (low ids) likely shared with the other workers."""
    ids = np.unique((rng.random(count) ** 3 * nrows).astype(np.int64))
    vals = torch.from_numpy(rng.standard_normal((ids.size, width))).to(dtype)
    return torch.from_numpy(ids), vals


def dense(rows: torch.Tensor, vals: torch.Tensor, nrows: int) -> torch.Tensor:
    out = torch.zeros(nrows, vals.shape[1], dtype=vals.dtype)
    out[rows] = vals
    return out


def reduce_rows(ws, ins, nrows: int, tensor_id: int, scale: float = 1.0,
                max_slots: int = 0) -> list[dict]:
    tickets = [w.submit_rows(tensor_id, r, v, nrows, 7, f"rows{tensor_id}", scale, None,
                             max_slots)
               for w, (r, v) in zip(ws, ins, strict=True)]
    for w, t in zip(ws, tickets, strict=True):
        assert w.wait(t, WAIT), f"tensor {tensor_id} did not finish"
    return [w.finish(t) for w, t in zip(ws, tickets, strict=True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
def test_union_of_rows_matches_float64_reference(aggs, make_workers, dtype):
    n, nrows, width = 3, 20000, 64
    ws = make_workers([aggs(n), aggs(n)], n, payload_bytes=4096, slots_per_aggregator=8)
    rng = np.random.default_rng(7)
    ins = [table_rows(rng, nrows, width, 1500, dtype) for _ in range(n)]
    # a worker without rows still takes part (empty tensors: no storage at all)
    ins[2] = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, width, dtype=dtype))
    results = reduce_rows(ws, ins, nrows, 40, scale=0.5)
    ref = reference([dense(r, v, nrows) for r, v in ins], 0.5)
    union = torch.unique(torch.cat([r for r, _ in ins]))
    for k, res in enumerate(results):
        assert torch.equal(res["rows"], union), f"worker {k}: not the union, in order"
        assert res["values"].dtype == dtype and res["union"] == union.numel()
        assert_result(dense(res["rows"], res["values"], nrows), ref, f"worker {k}")
        assert bits(res["values"]) == bits(results[0]["values"]), f"worker {k} differs"
    # each sent its own rows, not the table: far fewer bytes than the table's
    table_bytes = nrows * width * ins[0][1].element_size()
    assert results[0]["bytes_sent"] < table_bytes / 4, results[0]
    # the same rows laid out over 3 slots (of the 16 the engine would take): the same sums,
    # in fewer packets
    fewer = reduce_rows(ws, ins, nrows, 41, scale=0.5, max_slots=3)
    assert fewer[0]["nslots"] == 3 < results[0]["nslots"], (fewer[0], results[0])
    assert fewer[0]["packets"] < results[0]["packets"], (fewer[0], results[0])
    for k, res in enumerate(fewer):
        assert torch.equal(res["rows"], union)
        assert bits(res["values"]) == bits(results[0]["values"]), f"worker {k} differs"


def test_rows_out_of_order_or_range_are_refused(aggs, make_workers):
    (w,) = make_workers([aggs(1)], 1)
    vals = torch.ones(2, 8)
    for rows in ([3, 1], [2, 2], [-1, 4], [1, 100]):
        with pytest.raises(RuntimeError, match="ascending and below 100"):
            w.submit_rows(1, torch.tensor(rows), vals, 100, 7)
    with pytest.raises(RuntimeError, match="a row per entry"):
        w.submit_rows(1, torch.tensor([1, 2, 3]), vals, 100, 7)


def test_tables_that_differ_across_workers_fail_by_name(aggs, make_workers):
    """One worker's table has other dimensions: the aggregator refuses the tensor and every
    worker's error names it, rather than summing unrelated rows."""
    n = 2
    ws = make_workers([aggs(n)], n, timeout=5.0)
    ins = [(torch.tensor([1, 5]), torch.ones(2, 16)), (torch.tensor([1, 5]), torch.ones(2, 16))]
    tickets = [ws[0].submit_rows(50, *ins[0], 1000, 7, "emb.table"),
               ws[1].submit_rows(50, *ins[1], 999, 7, "emb.table")]
    for w, t in zip(ws, tickets, strict=True):
        assert w.wait(t, WAIT)
    for w, t in zip(ws, tickets, strict=True):
        with pytest.raises(RuntimeError, match="emb.table"):
            w.finish(t)
