"""Aggregator failures on 4 ranks: a killed aggregator is an error naming it on every rank,
within the timeout, or, with fallback="dense", a correct dense result; never a hang, never a
partial sum.

test_rank0_dies ends the job (rank 0 kills itself): it runs alone, launched by
tests/test_job_faults.py, which then checks that no aggregator outlived rank 0.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import close_to, start

import hvd_sparse
from hvd_sparse import aggregator, basics
from hvd_sparse.session import RETRY_EVERY

LAUNCHES = [Launch(np=4, id="kill-aggregator", env={"HVD_SPARSE_TIMEOUT": "4"},
                   args=("-k", "not rank0_dies"), timeout=300, extended=True)]
NUMEL = 1 << 22


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start(probe="off")


@pytest.fixture(scope="module")
def ref() -> torch.Tensor:
    return hvd.allreduce(data().double(), name="ref")


def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(hvd.rank())
    return torch.randn(NUMEL, generator=g) * (torch.rand(NUMEL, generator=g) < 0.3)


def kill_mid_flight(name: str, inplace: bool, t: torch.Tensor | None = None) -> torch.Tensor:
    """Ranks 1.. start reducing `name` (``t``, else this rank's data); rank 0 kills the
    aggregator once they have, then joins: the aggregator dies with the reduction in flight on
    every peer."""
    t = data() if t is None else t
    if hvd.rank() != 0:
        h = (hvd_sparse.allreduce_async_(t, name=name, scheme="omnireduce") if inplace else
             hvd_sparse.allreduce_async(t, name=name, scheme="omnireduce"))
    hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")
    if hvd.rank() == 0:
        basics.state().omni.local.procs[0].send_signal(signal.SIGKILL)
        h = (hvd_sparse.allreduce_async_(t, name=name, scheme="omnireduce") if inplace else
             hvd_sparse.allreduce_async(t, name=name, scheme="omnireduce"))
    return hvd_sparse.synchronize(h)


def test_killed_aggregator_error(ref):
    timeout = basics.state().config.timeout
    t0 = time.monotonic()
    with pytest.raises(hvd_sparse.HvdSparseError) as e:
        kill_mid_flight("killed", inplace=False)
    took = time.monotonic() - t0
    # one host: the job's aggregators stay on rank 0's host, on loopback
    assert basics.state().omni.placement == "rank0"
    port = basics.state().omni.addrs[0][1]
    assert f"127.0.0.1:{port}" in str(e.value) and "'killed'" in str(e.value), \
        f"error does not name the aggregator and tensor: {e.value}"
    assert took < timeout + 10, f"took {took:.1f}s"


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
def test_killed_aggregator_fallback(ref, inplace):
    """fallback="dense": the same failure ends in the dense result on every rank."""
    hvd_sparse.init(probe="off", fallback="dense")
    out = kill_mid_flight("fallback.inplace" if inplace else "fallback", inplace=inplace)
    assert close_to(out, ref, torch.float32) == ""


@pytest.mark.ends(rank=0, job=True)
def test_rank0_dies():
    """Rank 0 writes its aggregators' pids and SIGKILLs itself; the launcher ends the job."""
    if hvd.rank() == 0:
        pids = [p.pid for p in basics.state().omni.local.procs]
        Path(os.environ["HVD_SPARSE_TEST_OUT"], "aggregator_pids.json").write_text(
            json.dumps(pids))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # horovodrun ends the job once rank 0 is gone


def test_killed_aggregator_leaves_an_inplace_tensor_as_it_was(ref):
    """fallback="error" in place: the error says so, and the caller's tensor holds its own
    values again, not half a result."""
    hvd_sparse.init(probe="off")  # fresh aggregators (an earlier test killed one), "error"
    t = data()
    want = t.clone()
    with pytest.raises(hvd_sparse.HvdSparseError, match="left as it was"):
        kill_mid_flight("killed.inplace", inplace=True, t=t)
    assert torch.equal(t, want)


def test_down_fails_at_once_then_resumes(ref):
    """fallback="error": after an aggregator timed out, later tensors fail at once (not after
    another timeout); restarted at its address (same secret) it answers the keep-alives, and
    aggregation resumes at the next look, exact."""
    hvd_sparse.init(probe="off")
    session = basics.state().omni
    # the error says whether the aggregator answered anything lately (a dead one: not since
    # it was killed), which tells a dead aggregator from a late peer
    with pytest.raises(hvd_sparse.HvdSparseError,
                       match=r"no result from aggregator .*; it last answered a round "
                             r"(never|[0-9.]+ s ago), [0-9]+ of [0-9]+ slots of this tensor"
                       ) as err:
        kill_mid_flight("down", inplace=False)
    ago = re.search(r"last answered a round ([0-9.]+) s ago", str(err.value))
    assert ago is None or float(ago.group(1)) > 1.0, str(err.value)  # silent since the kill
    t0 = time.monotonic()
    with pytest.raises(hvd_sparse.HvdSparseError, match="an aggregator is down"):
        hvd_sparse.allreduce(data(), name="down.next", scheme="omnireduce")
    assert time.monotonic() - t0 < 2, "a second timeout"
    if hvd.rank() == 0:
        restart(session.local)
    deadline = time.monotonic() + 30  # keep-alives go every 10 s
    while not session.answered_since_down():
        assert time.monotonic() < deadline, "the restarted aggregator never answered"
        time.sleep(0.1)
    hvd.allreduce(torch.zeros(1), name="down.answered")
    # a sixteenth of the data: the restarted aggregator's first job within the 4 s timeout
    # even on a loaded box (the whole tensor once took longer there)
    t = data()[:NUMEL // 16]
    want = hvd.allreduce(t.double(), name="down.ref")
    for i in range(RETRY_EVERY):  # the look comes at the RETRY_EVERY-th call of the name
        try:
            out = hvd_sparse.allreduce(t, name="down.back", scheme="omnireduce")
            break
        except hvd_sparse.HvdSparseError as e:
            assert "is down" in str(e) and i < RETRY_EVERY - 1, str(e)
    assert session.down == "" and close_to(out, want, torch.float32) == ""
    assert hvd_sparse.metrics()["down.back"]["scheme"] == "omnireduce"


def test_down_goes_dense_at_once(ref):
    """fallback="dense": the failure that marks aggregation down is agreed by every rank, and
    the next tensor goes dense without streaming, exact."""
    hvd_sparse.init(probe="off", fallback="dense")
    assert close_to(kill_mid_flight("dense.first", inplace=False), ref, torch.float32) == ""
    out = hvd_sparse.allreduce(data(), name="dense.next", scheme="omnireduce")
    assert close_to(out, ref, torch.float32) == ""
    # straight to dense (the dense reduction itself takes seconds on this box: no timing)
    assert hvd_sparse.metrics()["dense.next"]["reason"] == "aggregator down"


def restart(local: aggregator.LocalAggregators) -> None:
    """Aggregator 0 again, at its port, with the job's secret: an aggregator restart."""
    port_file = local.dir / "restarted.port"
    local.procs[0] = subprocess.Popen(
        [str(aggregator.binary()), "--bind", f"127.0.0.1:{local.ports[0]}", "--workers",
         str(hvd.size()), "--parent-pid", str(os.getpid()), "--port-file", str(port_file),
         "--secret-file", str(local.dir / "secret")], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not port_file.exists():
        assert local.procs[0].poll() is None and time.monotonic() < deadline, "no restart"
        time.sleep(0.01)
