"""Sparse COO tensors reduced by rows (4 ranks), against Horovod's dense allreduce of their
dense equivalents in float64: duplicate rows, ranks without rows, hybrid and 2-D sparse
indices, every float dtype, Average and Sum, shape mismatch, and training with
nn.EmbeddingBag(sparse=True) through hvd_sparse.DistributedOptimizer."""
from __future__ import annotations

import copy
import dataclasses

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import close_to, start
from torch import nn

import hvd_sparse
from hvd_sparse import HvdSparseError, basics
from hvd_sparse.costmodel import NetModel

LAUNCHES = [Launch(np=4, timeout=300)]
ROWS = 5000
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def embedding_grad(step: int, dtype: torch.dtype, dim: int = 8, lookups: int = 600,
                   ) -> torch.Tensor:
    """An uncoalesced row gradient as nn.Embedding makes it: one row per lookup, hot rows
    repeated (Zipf-like ids); rank 2 has none at step 1."""
    g = torch.Generator().manual_seed(97 * hvd.rank() + step)
    n = 0 if (hvd.rank() == 2 and step == 1) else lookups
    ids = (torch.rand(n, generator=g) ** 3 * ROWS).long()
    vals = torch.randn(n, dim, generator=g).to(dtype)
    return torch.sparse_coo_tensor(ids.unsqueeze(0), vals, (ROWS, dim))


def bag_grad(dtype: torch.dtype, dim: int = 16, bags: int = 200, ids: int = 4
             ) -> torch.Tensor:
    """An EmbeddingBag's gradient as it comes (``mode="sum"``): every id of a bag carries the
    bag's row, so runs of equal value rows. Rank 2's is an Embedding's instead (a row per
    lookup, no runs), so ranks send both forms at once."""
    g = torch.Generator().manual_seed(13 * hvd.rank())
    lookups = (torch.rand(bags * ids, generator=g) * ROWS).long()
    pooled = torch.randn(bags, dim, generator=g).to(dtype)
    vals = pooled.repeat_interleave(ids, 0) if hvd.rank() != 2 else \
        torch.randn(bags * ids, dim, generator=g).to(dtype)
    return torch.sparse_coo_tensor(lookups.unsqueeze(0), vals, (ROWS, dim))


def check(t: torch.Tensor, name: str, op=hvd.Average, scheme: str | None = None) -> str:
    ref = hvd.allreduce(t.to_dense().double(), name=f"ref.{name}", op=op)
    out = hvd_sparse.allreduce(t, name=name, op=op, scheme=scheme)
    if not (out.is_sparse and out.is_coalesced()):
        return "result is not a coalesced sparse tensor"
    ran = hvd_sparse.metrics()[name]["scheme"]
    if ran != ("rows+omnireduce" if scheme == "omnireduce" else "rows"):
        return f"reduced by {ran}"
    return close_to(out.to_dense(), ref, t.dtype)


def train() -> str:
    """EmbeddingBag(sparse=True) + a linear layer, SGD: ours vs Horovod's dense reference; in
    one step one rank does no lookup (no gradient for the table)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.EmbeddingBag(ROWS, 16, mode="sum", sparse=True),
                           "top": nn.Linear(16, 1)})
    twin = copy.deepcopy(model)
    ref_opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=True)
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1),
                                          named_parameters=twin.named_parameters())
    for step in range(6):
        g = torch.Generator().manual_seed(31 * hvd.rank() + step)
        ids = (torch.rand(64, 5, generator=g) ** 3 * ROWS).long()
        y = torch.randn(64, 1, generator=g)
        skip = step == 3 and hvd.rank() == 1  # no lookups here: its peers still send rows
        for m, o in ((model, ref_opt), (twin, opt)):
            o.zero_grad()
            feats = torch.zeros(64, 16) if skip else m["emb"](ids)
            nn.functional.mse_loss(m["top"](feats), y).backward()
            if m is twin and not skip and not twin["emb"].weight.grad.is_sparse:
                return "the embedding gradient is not sparse"
            o.step()
        for (n, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                return f"step {step}: {n} differs by {(a - b).abs().max().item():g}"
    return ""


def mismatch(scheme: str | None = None) -> str:
    t = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2, 4 if hvd.rank() else 3),
                                (10, 4 if hvd.rank() else 3))
    try:
        hvd_sparse.allreduce(t, name=f"rows.mismatch.{scheme}", scheme=scheme)
    except HvdSparseError as e:
        if f"rows.mismatch.{scheme}" not in str(e):
            return f"error does not name the tensor: {e}"
        return ""
    return "no error for mismatched shapes"


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start(probe="off", timeout=20)


@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
def test_embedding_gradient(dtype, step):
    assert check(embedding_grad(step, dtype), f"emb.{dtype}.{step}") == ""


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
def test_bag_gradient_sends_each_bags_row_once(dtype):
    """Ranks whose gradient repeats each bag's row send it once, with the rows' ids: the sum
    is still the float64 one, and a rank receives fewer bytes than the summed rows (rank 2,
    which receives only bags, under 0.6 of them: a bag's row once, 4 ids)."""
    t = bag_grad(dtype)
    name = f"bag.{dtype}"
    assert check(t, name) == ""
    distinct = hvd.allgather(torch.tensor([t.coalesce()._nnz()])).tolist()
    row = 8 + 16 * t.element_size()
    summed = sum((d + 1) * row for r, d in enumerate(distinct) if r != hvd.rank())
    got = hvd_sparse.metrics()[name]["bytes_received"]
    assert got < (0.6 if hvd.rank() == 2 else 1.0) * summed, (got, summed)


def test_sum():
    assert check(embedding_grad(0, torch.float32), "emb.sum", hvd.Sum) == ""


def test_2d_indices():
    g = torch.Generator().manual_seed(hvd.rank())
    dense = torch.randn(40, 30, generator=g) * (torch.rand(40, 30, generator=g) < 0.05)
    assert check(dense.to_sparse(), "coo2d") == ""


def test_hybrid_3d():
    g = torch.Generator().manual_seed(100 + hvd.rank())
    t = torch.randn(6, 3, 2, generator=g).to_sparse(sparse_dim=1) * (hvd.rank() + 1)
    assert check(t, "hybrid") == ""


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
def test_embedding_gradient_aggregated(dtype):
    """scheme="omnireduce": the rows go to the job's aggregators, which send back the union."""
    for step in (0, 1):
        assert check(embedding_grad(step, dtype, dim=64), f"agg.{dtype}.{step}",
                     scheme="omnireduce") == ""


def test_hybrid_3d_aggregated():
    g = torch.Generator().manual_seed(200 + hvd.rank())
    t = torch.randn(50, 3, 2, generator=g).to_sparse(sparse_dim=1) * (hvd.rank() + 1)
    assert check(t, "agg.hybrid", hvd.Sum, scheme="omnireduce") == ""


def auto_calls(name: str, steps: int) -> list[dict]:
    """``steps`` calls of tensor ``name`` with scheme="auto", each checked against Horovod's
    dense allreduce in float64; each call's metrics() record."""
    calls = []
    for step in range(steps):
        t = embedding_grad(step, torch.float32, dim=64)
        ref = hvd.allreduce(t.to_dense().double(), name=f"ref.{name}.{step}", op=hvd.Sum)
        out = hvd_sparse.allreduce(t, name=name, op=hvd.Sum, scheme="auto")
        assert close_to(out.to_dense(), ref, torch.float32) == ""
        calls.append(hvd_sparse.metrics()[name])
    return calls


def test_auto_times_both_ways_then_every_rank_takes_one():
    """scheme="auto": two calls each way, then every rank takes the way the slowest rank's best
    times favour (aggregation only when 10% faster), and keeps it; every sum right."""
    ran = [m["scheme"] for m in auto_calls("rows.auto", 7)]
    decided = hvd.allgather_object(basics.state().context.rows_plans["rows.auto"].decided)
    assert all(d == decided[0] for d in decided) and set(decided[0]) == {"allgather",
                                                                         "omnireduce"}
    assert ran[:4] == ["rows", "rows+omnireduce"] * 2, ran
    faster = decided[0]["omnireduce"] < 0.9 * decided[0]["allgather"]
    assert ran[4:] == ["rows+omnireduce" if faster else "rows"] * 3, (ran, decided[0])


def test_auto_skips_aggregation_that_cannot_win():
    """On a link model where one aggregator host carries every rank's union (1 Gbit/s), the
    first call's union and bytes say aggregation cannot win: auto skips its aggregated calls
    on every rank, and every sum is right."""
    st = basics.state()
    saved = st.net
    st.net = NetModel.for_link(1e9, hvd.size(), dataclasses.replace(saved, source="probed"),
                               aggregators=1)
    try:
        calls = auto_calls("rows.skip", 6)
        for m in calls:  # where each call's time went: its stages, which fit in its wall time
            stages = m["stages_ms"]
            assert {"host rows", "rows", "host end"} <= set(stages), stages
            assert 0 < sum(stages.values()) <= m["seconds"] * 1e3 + 1.0, (stages, m["seconds"])
        ran = [m["scheme"] for m in calls]
        assert ran == ["rows"] * 6, ran
        assert all(hvd.allgather_object(st.rows_plans["rows.skip"].skipped))
    finally:
        st.net = saved


@pytest.mark.parametrize("scheme", [None, "omnireduce"])
def test_mismatch(scheme):
    assert mismatch(scheme) == ""


def test_train_embeddingbag():
    assert train() == ""
