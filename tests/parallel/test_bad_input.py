"""Bad input on 2 ranks: clear errors on every rank, never a hang or a wrong sum. Mismatched
tensors, edge shapes, NaN/Inf, bad arguments, a silent peer, then a dead one (rank 1 leaves)."""
from __future__ import annotations

import time

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import close_to, leave, start

import hvd_sparse

TIMEOUT = 4
LAUNCHES = [Launch(np=2, env={"HVD_SPARSE_TIMEOUT": "4"}, timeout=240)]
SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start(small_bytes=1024)
    assert hvd_sparse.basics.state().config.timeout == TIMEOUT


def expect_error(name: str, fn, *words: str) -> None:
    with pytest.raises(hvd_sparse.HvdSparseError) as e:
        fn()
    missing = [w for w in (name, *words) if w not in str(e.value)]
    assert missing == [], f"error does not mention {missing}: {e.value}"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ["shape", "numel", "small", "dtype"])
def test_mismatch_raises_on_every_rank(kind, scheme):
    """Ranks disagree about a tensor: every rank must raise, naming it."""
    rank, name = hvd.rank(), f"mismatch.{kind}.{scheme}"
    if kind == "dtype":
        t = torch.ones(5000, dtype=torch.float32 if rank == 0 else torch.float64)
    else:
        a, b = {"shape": ([64, 300], [300, 64]), "numel": ([2000], [3000]),
                "small": ([4, 4], [16])}[kind]
        t = torch.zeros(a if rank == 0 else b)
        t.view(-1)[::7] = 1.0
    expect_error(name, lambda: hvd_sparse.allreduce(t, name=name, scheme=scheme))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_edge_shapes(scheme):
    """Edge shapes and layouts reduce correctly; sparse inputs, plain and hybrid (nn.Embedding's
    gradients), are reduced by rows unless the scheme is dense, which densifies (in a copy) as
    Horovod would; the caller's tensor is left alone."""
    rank = hvd.rank()
    g = torch.Generator().manual_seed(rank)
    base = torch.randn(300, 41, generator=g) * (torch.rand(300, 41, generator=g) < 0.02)
    orig = base.clone()
    tensors = {"empty": torch.zeros(0), "one": torch.tensor([float(rank + 1)]),
               "noncontig": base.t(), "sliced": base[::3, 1:], "scalar": torch.tensor(2.0)}
    errs = []
    for k, t in tensors.items():
        ref = hvd.allreduce(t.double().contiguous(), name=f"ref.{k}.{scheme}")
        out = hvd_sparse.allreduce(t, name=f"edge.{k}.{scheme}", scheme=scheme)
        errs += [f"{k}: {e}" for e in [close_to(out, ref, torch.float32)] if e != ""]
    ref = hvd.allreduce(base.double(), name=f"ref.coo.{scheme}")
    for k, coo in (("coo", base.to_sparse()), ("hybrid", base.to_sparse(sparse_dim=1))):
        out = hvd_sparse.allreduce(coo, name=f"edge.{k}.{scheme}", scheme=scheme)
        if out.is_sparse != (scheme != "dense"):
            errs.append(f"{k}: result is_sparse={out.is_sparse}")
        errs += [f"{k}: {e}" for e in [close_to(out.to_dense(), ref, torch.float32)] if e != ""]
    if not torch.equal(base, orig):
        errs.append("the caller's tensor (viewed as noncontig, sliced) was modified")
    assert errs == []


@pytest.mark.parametrize("scheme", SCHEMES)
def test_nan_inf_propagate_as_in_dense_allreduce(scheme):
    rank = hvd.rank()
    t = torch.zeros(4096)
    t[10] = float("nan") if rank == 0 else 1.0
    t[600] = float("inf")
    t[1500] = float("inf") if rank == 0 else float("-inf")
    t[3000] = 2.0
    ref = hvd.allreduce(t, name=f"ref.nan.{scheme}", op=hvd.Sum)
    out = hvd_sparse.allreduce(t, name=f"nan.{scheme}", op=hvd.Sum, scheme=scheme)
    at = [10, 600, 1500, 3000]
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(
        out.nan_to_num(0, 1e30, -1e30), ref.nan_to_num(0, 1e30, -1e30)), \
        f"got {out[at]}, want {ref[at]}"


@pytest.mark.parametrize("kwargs", [{"op": hvd.Adasum}, {"scheme": "bogus"}],
                         ids=["adasum", "bogus-scheme"])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        hvd_sparse.allreduce(torch.ones(3), name="bad", **kwargs)


@pytest.mark.ends(rank=1)
def test_silent_peer_times_out_naming_the_tensor():
    """Rank 0 alone submits a tensor: a timeout error naming it, not a hang. Rank 1 stays
    silent, then its process ends: the dead peer of the next test."""
    if hvd.rank() != 0:
        time.sleep(TIMEOUT + 2)
        leave()
    t0 = time.monotonic()
    expect_error("lonely", lambda: hvd_sparse.allreduce(
        torch.ones(5000), name="lonely", scheme="allgather"), "timed out")
    took = time.monotonic() - t0
    assert took < TIMEOUT + 5, f"took {took:.1f}s"


def test_dead_peer_fails_within_timeout():
    """The peer is gone: the next reduction fails within the timeout, naming the tensor."""
    t0 = time.monotonic()
    expect_error("after-death", lambda: hvd_sparse.allreduce(
        torch.ones(5000), name="after-death", scheme="zen"))
    took = time.monotonic() - t0
    assert took < TIMEOUT + 10, f"took {took:.1f}s"
