"""Many reductions in flight at once, the way training overlaps them (4 ranks).

Each iteration submits 8 tensors (33k-500k floats, ~2% of their blocks non-zero) with
``allreduce_async``, drops every reference to the inputs, and synchronizes in reverse order;
a Python thread allocating and freeing tensors runs beside it. This once deadlocked: the
omnireduce worker thread released the last reference to a finished tensor, which needs the GIL,
while holding the mutex the caller (holding the GIL) waited for. Every result is checked
against a float64 sum of all ranks' inputs, rebuilt locally from their seeds. The hang showed
as a Gloo/hvd_sparse timeout on the peers: the timeout is kept short.
"""
from __future__ import annotations

import threading
import time

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import close_to, start

import hvd_sparse

LAUNCHES = [Launch(np=4, env={"HVD_SPARSE_TIMEOUT": "20"}, timeout=420, extended=True)]

SIZES = [33_000, 61_000, 97_000, 150_000, 211_000, 300_000, 404_000, 500_000]
BLOCK = 256


def data(rank: int, it: int, i: int) -> torch.Tensor:
    """~2% of the blocks non-zero, chosen by (rank, iteration, tensor)."""
    g = torch.Generator().manual_seed(rank * 1_000_003 + it * 101 + i)
    n = SIZES[i]
    nb = -(-n // BLOCK)
    keep = torch.rand(nb, generator=g) < 0.02
    x = torch.randn(nb, BLOCK, generator=g) * keep.unsqueeze(1)
    return x.view(-1)[:n].clone()


def churn(stop: threading.Event) -> None:
    """Allocates and frees tensors in another Python thread: more GIL traffic, more frees."""
    while not stop.is_set():
        torch.ones(50_000).sum()
        time.sleep(0.001)


def run(scheme: str, iters: int) -> str:
    for it in range(iters):
        handles = [hvd_sparse.allreduce_async(data(hvd.rank(), it, i), name=f"stress.{i}",
                                              op=hvd.Sum, scheme=scheme)
                   for i in range(len(SIZES))]
        outs = {i: hvd_sparse.synchronize(handles[i]) for i in reversed(range(len(SIZES)))}
        del handles
        if it % 5 == 0 or it == iters - 1:  # the reference costs more than the reductions
            for i, out in outs.items():
                ref = sum(data(r, it, i).double() for r in range(hvd.size()))
                err = close_to(out, ref, torch.float32)
                if err != "":
                    return f"iteration {it}, tensor {i}: {err}"
    return ""


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start(probe="off")


@pytest.mark.parametrize("scheme,iters", [("omnireduce", 150), ("auto", 30)])
def test_inflight_reductions_finish_and_match_the_reference(scheme, iters):
    stop = threading.Event()
    thread = threading.Thread(target=churn, args=(stop,), daemon=True)
    thread.start()
    try:
        err = run(scheme, iters)
    finally:
        stop.set()
        thread.join()
    assert err == ""
