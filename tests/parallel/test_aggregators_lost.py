"""Dedicated aggregators lost, stalled or moved while a job runs (fallback="dense"): every
result equals the dense float64 reference, the job regroups over the aggregators that answer
(slots re-sharded) and takes a lost one back when it answers again, at the address its name
resolves to then. Rank 0 runs the aggregators (processes of the real binary on loopback
addresses, which stand for hosts) and kills, stops or moves them between reductions.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import barrier, close_to, start

import hvd_sparse
from hvd_sparse import aggregator, basics
from hvd_sparse.session import RETRY_EVERY

TIMEOUT = 3.0  # HVD_SPARSE_TIMEOUT of the launches
LAUNCHES = [Launch(np=2, env={"HVD_SPARSE_TIMEOUT": "3"}, args=("-k", "not stopped"),
                   timeout=300),
            Launch(np=4, id="np4", env={"HVD_SPARSE_TIMEOUT": "3"}, timeout=400,
                   extended=True)]
NUMEL = 1 << 18
NAME = "hvd-sparse-agg.test"  # the moved aggregator's name, in /etc/hosts while the test runs
HOSTS = Path("/etc/hosts")


@pytest.fixture(scope="module", autouse=True)
def started():
    start(probe="off")


class Aggregators:
    """Rank 0's aggregator processes; the others hold None."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hvd-sparse-lost-"))
        self.procs: dict[int, subprocess.Popen] = {}

    def spawn(self, ip: str, port: int = 0) -> int:
        """An aggregator bound to ``ip:port`` (any port: 0); its port."""
        port_file = self.dir / f"{ip}.{port}.{time.monotonic_ns()}.port"
        proc = subprocess.Popen(
            [str(aggregator.binary()), "--bind", f"{ip}:{port}", "--port-file", str(port_file),
             "--parent-pid", str(os.getpid())], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not port_file.exists() or not port_file.read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, "no aggregator"
            time.sleep(0.01)
        port = int(port_file.read_text())
        self.procs[port] = proc
        return port

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


@pytest.fixture
def aggs() -> Iterator[Aggregators]:
    a = Aggregators()
    try:
        yield a
    finally:
        a.stop()


def data(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(NUMEL, generator=g) * (torch.rand(NUMEL, generator=g) < 0.3)


def reduce_until(done: Callable[[], bool], step: int, calls: int = 4 * RETRY_EVERY) -> int:
    """Reduces a new tensor under the same name until ``done()`` (state the ranks agree on),
    each result checked against the dense float64 reference; the step it got to. Fails past
    ``calls`` reductions, or where one took longer than the engine's timeout and a second."""
    worst = 0.0
    for i in range(calls):
        x = data(step + i)
        ref = hvd.allreduce(x.double(), name=f"ref.{step + i}")
        t0 = time.monotonic()
        out = hvd_sparse.allreduce(x, name="t", scheme="omnireduce")
        worst = max(worst, time.monotonic() - t0)
        assert close_to(out, ref, torch.float32) == "", f"call {i}"
        if done():
            assert worst < TIMEOUT + 1.0, f"a reduction stalled {worst:.1f} s"
            return step + i + 1
        time.sleep(0.05)  # keep-alives and probes have time to come back
    pytest.fail(f"not done after {calls} reductions")


def session():
    return basics.state().omni


def aggregating() -> bool:
    s = session()
    return not s.down and hvd_sparse.metrics()["t"]["scheme"] == "omnireduce"


def two(aggs: Aggregators) -> list[tuple[str, int]]:
    ports = [aggs.spawn("127.0.0.1"), aggs.spawn("127.0.0.1")] if hvd.rank() == 0 else None
    return [("127.0.0.1", p) for p in hvd.broadcast_object(ports, name="ports")]


def test_a_killed_aggregator_is_left_out_then_taken_back(aggs):
    addrs = two(aggs)
    hvd_sparse.init(probe="off", aggregators=addrs, auth=False, fallback="dense")
    step = reduce_until(aggregating, 0, calls=1)
    barrier("kill")
    if hvd.rank() == 0:
        aggs.kill(addrs[1][1])
    barrier("killed")
    # the reduction in flight goes dense; a look later, the job goes on over the one left
    step = reduce_until(lambda: aggregating() and session().addrs == addrs[:1], step)
    assert session().lost == addrs[1:] and session().names == addrs
    if hvd.rank() == 0:
        aggs.spawn(*addrs[1])  # restarted at its address
    barrier("restarted")
    reduce_until(lambda: aggregating() and session().addrs == addrs, step)
    assert session().lost == []


def test_an_aggregator_down_at_the_join_is_left_out(aggs):
    """One of the two does not answer the registration (as after a restart of the job where
    it died, Horovod elastic's or torchrun's): the job joins the other, then both."""
    addrs = two(aggs)
    barrier("down")
    if hvd.rank() == 0:
        aggs.kill(addrs[1][1])
    barrier("before the join")
    hvd_sparse.init(probe="off", aggregators=addrs, auth=False, fallback="error")
    assert session().addrs == addrs[:1] and session().lost == addrs[1:]
    step = reduce_until(aggregating, 0, calls=1)
    if hvd.rank() == 0:
        aggs.spawn(*addrs[1])
    barrier("back")
    hvd_sparse.init(probe="off", aggregators=addrs, auth=False, fallback="dense")
    reduce_until(lambda: aggregating() and session().addrs == addrs, step)


def test_a_stopped_aggregator_costs_a_bounded_stall(aggs):
    """SIGSTOP for 10 s (longer than the timeout): no reduction waits past the timeout; the
    job goes on over the other aggregator, and takes the stopped one back once it runs."""
    addrs = two(aggs)
    hvd_sparse.init(probe="off", aggregators=addrs, auth=False, fallback="dense")
    step = reduce_until(aggregating, 0, calls=1)
    barrier("stop")
    stopped_at = time.monotonic()
    if hvd.rank() == 0:
        aggs.procs[addrs[1][1]].send_signal(signal.SIGSTOP)
    try:
        step = reduce_until(lambda: aggregating() and session().addrs == addrs[:1], step)
    finally:
        if hvd.rank() == 0:
            time.sleep(max(0.0, 10 - (time.monotonic() - stopped_at)))
            aggs.procs[addrs[1][1]].send_signal(signal.SIGCONT)
    barrier("continued")
    reduce_until(lambda: aggregating() and session().addrs == addrs, step)


@pytest.fixture
def hosts_entry() -> Iterator[Callable[[str], None]]:
    """Rank 0 maps ``NAME`` to an address in /etc/hosts (a name service's record that moves,
    as a rescheduled pod's); the line is removed afterwards."""
    original = HOSTS.read_text() if hvd.rank() == 0 else ""

    def point(ip: str) -> None:
        if hvd.rank() == 0:
            HOSTS.write_text(original.rstrip("\n") + f"\n{ip} {NAME}\n")
        barrier(f"hosts.{ip}")
    try:
        yield point
    finally:
        if hvd.rank() == 0:
            HOSTS.write_text(original)


def test_a_moved_aggregator_is_found_under_its_name(aggs, hosts_entry):
    hosts_entry("127.0.0.2")
    port = aggs.spawn("127.0.0.2") if hvd.rank() == 0 else None
    addrs = [(NAME, hvd.broadcast_object(port, name="moved.port"))]
    hvd_sparse.init(probe="off", aggregators=addrs, auth=False, fallback="dense")
    step = reduce_until(aggregating, 0, calls=1)
    barrier("move")
    if hvd.rank() == 0:  # the pod rescheduled: a new process, another address, the same name
        aggs.kill(addrs[0][1])
        aggs.spawn("127.0.0.3", addrs[0][1])
    hosts_entry("127.0.0.3")
    reduce_until(lambda: aggregating() and session().membership.epoch > 1, step)
    assert session().addrs == addrs
