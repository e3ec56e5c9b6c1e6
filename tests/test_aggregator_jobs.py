"""Jobs on an aggregator: two jobs share one without mixing; registration refused for a job of
another size or timing out with nobody listening; a killed aggregator fails the tensor naming
it."""
from __future__ import annotations

import re
import socket
import time

import numpy as np
import pytest
import torch
from aggregator_helpers import (
    HOST,
    WAIT,
    assert_result,
    block_sparse,
    reference,
)

from hvd_sparse import _C
from hvd_sparse.config import format_address

# The aggregator and its workers over IPv4 and over IPv6 (loopback): the same protocol
FAMILIES = pytest.mark.parametrize("host", [HOST, "::1"], ids=["ipv4", "ipv6"])


@FAMILIES
def test_two_jobs_share_an_aggregator_without_mixing(aggs, make_workers, host):
    agg = aggs(2, host=host)
    a = make_workers([agg], 2, token=111, payload_bytes=1024, slots_per_aggregator=4)
    b = make_workers([agg], 2, token=222, payload_bytes=1024, slots_per_aggregator=4)
    rng = np.random.default_rng(2)
    ins_a = [block_sparse(rng, 64 * 300 + 1, 64, 0.3, torch.float32) for _ in range(2)]
    ins_b = [block_sparse(rng, 64 * 300 + 1, 64, 0.3, torch.float32) for _ in range(2)]
    outs = {}
    tickets = []
    for job, ws, ins in (("a", a, ins_a), ("b", b, ins_b)):  # same tensor id, interleaved
        for r, w in enumerate(ws):
            outs[job, r] = torch.zeros_like(ins[r])
            tickets.append((w, w.submit(42, ins[r], outs[job, r], 64, 7, None, "same", 1.0)))
    for w, t in tickets:
        assert w.wait(t, WAIT)
        w.finish(t)
    for job, ins in (("a", ins_a), ("b", ins_b)):
        for r in range(2):
            assert_result(outs[job, r], reference(ins), f"job {job} rank {r}")
    # RELEASE goes out as a tensor finishes, from each worker's socket: the aggregator may count
    # it a moment after the ranks are done.
    deadline = time.monotonic() + 10
    while (s := agg.stats())["released"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s["jobs"] == 2 and s["tensors"] == 2 and s["released"] == 2, s


# ------------------------------------------------------------------------------------------
# Registration; a dead aggregator
# ------------------------------------------------------------------------------------------

def test_register_refused_for_a_job_of_another_size(aggs, make_workers):
    agg = aggs(3)
    (w0, _) = make_workers([agg], 2, register=False)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"refused.*{HOST}:{agg.port}|"
                                           rf"{HOST}:{agg.port}.*refused"):
        w0.register(10.0)
    assert time.monotonic() - t0 < 5
    assert agg.stats()["jobs"] == 0


@FAMILIES
def test_register_with_nobody_listening_times_out_naming_the_address(make_workers, host):
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    w = _C.OmniWorker([(host, port)], 5, 0, 1)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=re.escape(format_address(host, port))):
            w.register(1.0)
        assert 0.9 < time.monotonic() - t0 < 5
    finally:
        w.close()


def test_killed_aggregator_fails_the_tensor_naming_it(aggs, make_workers):
    """K = 2; aggregator 1 dies (SIGKILL) while a large tensor streams: every worker's finish()
    raises within about the timeout, naming 127.0.0.1:PORT of the dead one."""
    a0, a1 = aggs(2), aggs(2)
    timeout = 2.0
    # one block per packet, one slot per aggregator: thousands of rounds per slot
    ws = make_workers([a0, a1], 2, timeout=timeout, payload_bytes=1024, slots_per_aggregator=1)
    rng = np.random.default_rng(6)
    ins = [block_sparse(rng, 1 << 21, 256, 1.0, torch.float32) for _ in range(2)]
    outs = [torch.empty_like(x) for x in ins]
    tickets = [ws[0].submit(1, ins[0], outs[0], 256, 7, None, "big", 1.0)]
    time.sleep(0.1)
    tickets.append(ws[1].submit(1, ins[1], outs[1], 256, 7, None, "big", 1.0))
    time.sleep(0.02)
    assert not ws[1].poll(tickets[1]), "finished before the kill: make the tensor larger"
    a1.kill()
    t0 = time.monotonic()
    for w, t in zip(ws, tickets, strict=True):
        assert w.wait(t, timeout + 10), "no hang"
        with pytest.raises(RuntimeError, match=re.escape(f"{HOST}:{a1.port}")):
            w.finish(t)
    assert time.monotonic() - t0 < timeout + 5
    assert a0.alive()
