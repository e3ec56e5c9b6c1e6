"""A job kept to a UDP port range (``ports``, HVD_SPARSE_PORTS): the job's own aggregators and
every worker socket bind inside it, a full range fails with an error naming it, two jobs share
one range without sharing a port, and each still sums right."""
from __future__ import annotations

import socket
from contextlib import ExitStack

import pytest
import torch

from hvd_sparse import HvdSparseError
from hvd_sparse._C import OmniWorker
from hvd_sparse.aggregator import LocalAggregators
from hvd_sparse.config import Config

pytestmark = pytest.mark.integration
WAIT = 20


def free_range(n: int) -> tuple[int, int]:
    """n consecutive UDP ports that are free now (and not in the kernel's ephemeral range)."""
    for lo in range(20000, 30000, n):
        with ExitStack() as stack:
            try:
                for p in range(lo, lo + n):
                    s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
                    s.bind(("0.0.0.0", p))
            except OSError:
                continue
        return lo, lo + n - 1
    raise RuntimeError("no free UDP port range")


def job(aggs: LocalAggregators, nworkers: int, ports: tuple[int, int], token: int
        ) -> list[OmniWorker]:
    addrs = [("127.0.0.1", p) for p in aggs.ports]
    ws = [OmniWorker(addrs, token, r, nworkers, ports=ports) for r in range(nworkers)]
    for w in ws:
        w.register(WAIT)
    return ws


def reduce(ws: list[OmniWorker], tensor_id: int) -> None:
    """Every worker's block-sparse float32 tensor, summed at the aggregators, against float64."""
    gen = torch.Generator().manual_seed(tensor_id)
    ins = []
    for _ in ws:
        x = torch.randn(64, 256, generator=gen)
        x[torch.rand(64, generator=gen) < 0.7] = 0
        ins.append(x.view(-1))
    outs = [torch.zeros_like(x) for x in ins]
    tickets = [w.submit(tensor_id, x, o, 256, 5, None, f"t{tensor_id}", 1.0)
               for w, x, o in zip(ws, ins, outs, strict=True)]
    for w, t in zip(ws, tickets, strict=True):
        assert w.wait(t, WAIT), "a worker did not finish"
        w.finish(t)
    want = sum(x.double() for x in ins).float()
    for o in outs:
        torch.testing.assert_close(o, want, rtol=1e-6, atol=1e-6)


def test_config_parses_the_range() -> None:
    assert Config(ports="29600-29699").validate().port_range() == (29600, 29699)
    assert Config().validate().port_range() == (0, 0)
    for bad in ("29600", "0-10", "10-5", "1-70000", "a-b"):
        with pytest.raises(ValueError, match="HVD_SPARSE_PORTS"):
            Config(ports=bad).validate()


def test_aggregators_and_workers_bind_in_a_narrow_range() -> None:
    lo, hi = free_range(4)  # exactly enough: 2 aggregators and 2 workers
    aggs = LocalAggregators(2, 2, "127.0.0.1", ports=(lo, hi))
    try:
        ws = job(aggs, 2, (lo, hi), 11)
        used = [*aggs.ports, *(w.local_port() for w in ws)]
        assert sorted(used) == list(range(lo, hi + 1)), used
        reduce(ws, 1)
        for w in ws:
            w.close()
    finally:
        aggs.stop()


def test_a_taken_range_fails_naming_it() -> None:
    lo, hi = free_range(3)
    with ExitStack() as stack:
        for p in range(lo, hi + 1):  # someone else holds every port of it
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)).bind(
                ("0.0.0.0", p))
        with pytest.raises(HvdSparseError, match=f"no free UDP port in {lo}-{hi}"):
            LocalAggregators(1, 1, "127.0.0.1", ports=(lo, hi))
        with pytest.raises(RuntimeError, match=f"no free UDP port in {lo}-{hi}"):
            OmniWorker([("127.0.0.1", 9)], 1, 0, 1, ports=(lo, hi))


def test_a_port_shared_by_reuseport_is_not_joined() -> None:
    """An aggregator never joins another process's SO_REUSEPORT group on a port (which would
    split the job's datagrams between them): it takes the next free one."""
    lo, hi = free_range(2)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", lo))
        aggs = LocalAggregators(1, 1, "127.0.0.1", ports=(lo, hi))
        try:
            assert aggs.ports == [hi], aggs.ports
        finally:
            aggs.stop()


def test_two_jobs_share_one_range() -> None:
    lo, hi = free_range(8)
    a = LocalAggregators(2, 2, "127.0.0.1", ports=(lo, hi))
    b = LocalAggregators(2, 2, "127.0.0.1", ports=(lo, hi))
    try:
        wa, wb = job(a, 2, (lo, hi), 21), job(b, 2, (lo, hi), 22)
        used = [*a.ports, *b.ports, *(w.local_port() for w in wa + wb)]
        assert len(set(used)) == 8 and all(lo <= p <= hi for p in used), used
        reduce(wa, 1)
        reduce(wb, 2)
        for w in wa + wb:
            w.close()
    finally:
        a.stop()
        b.stop()
