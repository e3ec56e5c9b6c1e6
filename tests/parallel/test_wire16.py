"""bfloat16 on the wire (option ``wire="bf16"``, issue 52): float32 and float64 tensors travel
as bfloat16 values, are summed in float32 by the codecs and the aggregators, and come back
rounded to bfloat16 once, widened to the input's dtype, identical on every rank.

Reference: every rank's values rounded to bfloat16 (what each one sends), summed in float64
and rounded to bfloat16 once; a result may differ from it by one bfloat16 step where the
summation itself rounds (the dense allreduce of Horovod and Gloo sums bfloat16 in bfloat16, as
``Compression.fp16`` does; with 2 ranks that is one rounding too). Each scheme, dense and
sparse tensors (rows), in place and out of place, float32 and float64; and the bytes: half of
the same reduction's in float32.
"""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import differing_ranks, digest, start

import hvd_sparse

LAUNCHES = [Launch(np=2, timeout=240, env={"HVD_SPARSE_SMALL_BYTES": "0"}),
            Launch(np=3, timeout=300, env={"HVD_SPARSE_SMALL_BYTES": "0"}, extended=True)]
SCHEMES = ["allgather", "zen", "omnireduce", "dense", "auto"]


@pytest.fixture(scope="module", autouse=True)
def started():
    start(probe="off", wire="bf16")


def sample(seed: int, dtype: torch.dtype, numel: int = 40_000) -> torch.Tensor:
    """This rank's tensor: 10% of its 256-blocks non-zero, values over several decades."""
    g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
    keep = (torch.rand(-(-numel // 256), generator=g) < 0.1).repeat_interleave(256)[:numel]
    scale = 10.0 ** torch.randint(-3, 4, (numel,), generator=g)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale * keep).to(dtype)


def reference(t: torch.Tensor, name: str) -> torch.Tensor:
    """Every rank's bfloat16 values summed exactly, averaged, rounded to bfloat16 once."""
    every = hvd.allgather(t.to(torch.bfloat16).double().unsqueeze(0), name=f"ref.{name}")
    return (every.sum(0) / hvd.size()).to(torch.bfloat16)


def within_a_step(got: torch.Tensor, want16: torch.Tensor,
                  scale: torch.Tensor | None = None) -> str:
    """"" where ``got`` is ``want16`` or one bfloat16 step from it, element by element (a step
    of ``scale`` where that is larger: what a rank rounds before it sends)."""
    got, want = got.reshape(-1).double(), want16.reshape(-1).double()
    size = want.abs() if scale is None else torch.maximum(want.abs(), scale.reshape(-1))
    step = (size * 2.0 ** -7).clamp_min(torch.finfo(torch.bfloat16).tiny)
    bad = ((got - want).abs() > step * 1.0001).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        return f"{bad.numel()} elements off, e.g. [{i}]: {float(got[i])} vs {float(want[i])}"
    return ""


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_dense_tensors_travel_as_bfloat16(scheme: str, dtype: torch.dtype) -> None:
    errs = []
    for how in ("out", "in"):
        name = f"w16.{scheme}.{dtype}.{how}"
        t = sample(SCHEMES.index(scheme), dtype)
        want = reference(t, name)
        got = (hvd_sparse.allreduce(t, name=name, scheme=scheme) if how == "out" else
               hvd_sparse.allreduce_(x := t.clone(), name=name, scheme=scheme))
        if how == "in" and got.data_ptr() != x.data_ptr():
            errs.append(f"{how}: not written in place")
        if got.dtype != dtype or got.shape != t.shape:
            errs.append(f"{how}: {got.dtype} {tuple(got.shape)}")
        if (why := within_a_step(got, want)) != "":
            errs.append(f"{how}: {why}")
        if differing_ranks(digest(got), name):
            errs.append(f"{how}: ranks differ")
        m = hvd_sparse.metrics()[name]
        if m.get("wire") != "bfloat16":
            errs.append(f"{how}: metrics say wire {m.get('wire')}")
    assert not errs, "; ".join(errs)


def test_sparse_rows_travel_as_bfloat16() -> None:
    g = torch.Generator().manual_seed(7 + hvd.rank())
    ids = torch.randint(0, 3000, (1, 500), generator=g)
    vals = torch.randn(500, 16, generator=g)
    t = torch.sparse_coo_tensor(ids, vals, (3000, 16))
    # each value (duplicates too) as bfloat16: every rank's, summed exactly, rounded once; a
    # rank may round its rows' sums once more before sending them (a step of their size)
    mine = torch.sparse_coo_tensor(ids, vals.to(torch.bfloat16).double(), (3000, 16))
    every = hvd.allgather(mine.to_dense().unsqueeze(0), name="ref.w16.rows")
    want = (every.sum(0) / hvd.size()).to(torch.bfloat16)
    got = hvd_sparse.allreduce(t, name="w16.rows")
    assert got.is_sparse and got.dtype == torch.float32
    scale = every.abs().sum(0) / hvd.size()
    assert (why := within_a_step(got.to_dense(), want, scale)) == "", why
    assert not differing_ranks(digest(got.to_dense()), "w16.rows")
    assert hvd_sparse.metrics()["w16.rows"].get("wire") == "bfloat16"


def test_half_the_bytes() -> None:
    """The same allgather, float32 on the wire against bfloat16: values are most of the bytes
    (block indices the rest), so about half."""
    t = sample(11, torch.float32, numel=200_000)
    hvd_sparse.allreduce(t, name="w16.bytes16", scheme="allgather")
    sixteen = hvd_sparse.metrics()["w16.bytes16"]["bytes_sent"]
    state = hvd_sparse.basics.state()
    cfg = state.config
    try:
        state.config = type(cfg)(**{**cfg.__dict__, "wire": ""})
        hvd_sparse.allreduce(t, name="w16.bytes32", scheme="allgather")
    finally:
        state.config = cfg
    m32 = hvd_sparse.metrics()["w16.bytes32"]
    assert "wire" not in m32
    assert 0.45 < sixteen / m32["bytes_sent"] < 0.55, (sixteen, m32["bytes_sent"])
