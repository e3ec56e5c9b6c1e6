"""One job on the netns testbed (4 worker hosts, 1 aggregator host, 1 Gbit/s links), launched by
tests/test_testbed.py through `hvd-sparse testbed run`'s launcher (mpirun, one rank per worker
host; no LAUNCHES of its own: it needs the testbed that test brings up):

* every scheme equals Horovod's allreduce of the same tensors, in float64 on the CPU;
* 1% loss on the switch (UDP): omnireduce results bit-identical to the lossless run, with
  retransmissions counted;
* the aggregator host's link cut with a reduction in flight: HvdSparseError naming it on every
  rank within the timeout; with fallback="dense" the right answer; down for 1.5 s only (a
  flap shorter than the timeout): the reductions complete, exact;
* rank 0's own local aggregator, with ranks in different namespaces sharing a hostname:
  reachable by every rank (it used to bind 127.0.0.1);
* the aggregator host moved to another address (a rescheduled pod) with the job naming it
  ``a0.<testbed>``: found there, every result exact meanwhile (fallback="dense").
Rank 0 changes the testbed itself (loss, link) through hvd_sparse.tools.testbed, as root.
"""
from __future__ import annotations

import os
import time

import horovod.torch as hvd
import pytest
import torch
from ranktools import barrier, close_to, start

import hvd_sparse
from hvd_sparse import basics
from hvd_sparse.session import RETRY_EVERY
from hvd_sparse.tools.testbed import Testbed, lifecycle, loss

LAUNCHES = []  # tests/test_testbed.py launches it on its testbed

NUMEL = 1 << 21
TIMEOUT = 6.0


def data(seed: int, density: float = 0.1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Whole 256-blocks non-zero at random, a different pattern per rank."""
    g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
    keep = torch.rand(NUMEL // 256, generator=g) < density
    return (torch.randn(NUMEL // 256, 256, generator=g) * keep[:, None]).view(-1).to(dtype)


def change_testbed(**kw: object) -> None:
    """Rank 0 changes the testbed; everyone waits for it."""
    if hvd.rank() == 0:
        lifecycle.update(Testbed.load(os.environ["HVD_SPARSE_TESTBED"]), **kw)
    barrier(f"change.{sorted(kw.items())}")


def schemes() -> str:
    bad = []
    for i, scheme in enumerate(("dense", "allgather", "zen", "omnireduce", "auto")):
        for dtype in (torch.float32, torch.float16):
            t = data(i, dtype=dtype)
            ref = hvd.allreduce(t.double(), name=f"ref.{scheme}.{dtype}", op=hvd.Average)
            out = hvd_sparse.allreduce(t, name=f"s.{scheme}.{dtype}", scheme=scheme)
            why = close_to(out, ref, dtype)
            if why != "":
                bad.append(f"{scheme} {dtype}: {why}")
    return "; ".join(bad)


def lossy_switch() -> str:
    worker = basics.state().omni.worker
    xs = [data(100 + i, density=0.3) for i in range(3)]
    clean = [hvd_sparse.allreduce(x, name=f"clean{i}", scheme="omnireduce", op=hvd.Sum)
             for i, x in enumerate(xs)]
    before = worker.stats()["retransmits"]
    change_testbed(loss_rate=0.01)
    try:
        lossy = [hvd_sparse.allreduce(x, name=f"lossy{i}", scheme="omnireduce", op=hvd.Sum)
                 for i, x in enumerate(xs)]
        barrier("lossy")
        dropped = loss.dropped(Testbed.load(os.environ["HVD_SPARSE_TESTBED"]))
    finally:
        barrier("loss counted")  # rank 0's change below resets the drop counters
        change_testbed(loss_rate=0.0)
    if dropped == 0:
        return "the switch's loss rules dropped no frame"
    retx = hvd.allreduce(torch.tensor([worker.stats()["retransmits"] - before]),
                         op=hvd.Sum, name="retx")
    if int(retx) == 0:
        return "no retransmission at 1% loss (was loss applied?)"
    diff = [i for i, (a, b) in enumerate(zip(clean, lossy, strict=True)) if not torch.equal(a, b)]
    return f"results differ from the lossless run: tensors {diff}" if diff else ""


def cut_in_flight(name: str) -> torch.Tensor:
    """Ranks 1.. start reducing; rank 0 cuts the aggregator host's link, then joins."""
    t = data(7)
    if hvd.rank() != 0:
        h = hvd_sparse.allreduce_async(t, name=name, scheme="omnireduce")
    barrier(name)
    if hvd.rank() == 0:
        lifecycle.update(Testbed.load(os.environ["HVD_SPARSE_TESTBED"]), host="a0",
                         link_up=False)
        h = hvd_sparse.allreduce_async(t, name=name, scheme="omnireduce")
    return hvd_sparse.synchronize(h)


def link_cut() -> str:
    agg = os.environ["HVD_SPARSE_AGGREGATORS"]
    t0 = time.monotonic()
    try:
        cut_in_flight("cut")
        return "no error with the aggregator's link cut"
    except hvd_sparse.HvdSparseError as e:
        took = time.monotonic() - t0
        if agg not in str(e):
            return f"error does not name the aggregator {agg}: {e}"
        if took > TIMEOUT + 5:
            return f"error after {took:.1f} s, timeout {TIMEOUT} s"
        return ""
    finally:
        change_testbed(host="a0", link_up=True)


def link_cut_fallback() -> str:
    hvd_sparse.init(probe="off", timeout=TIMEOUT, fallback="dense")
    try:
        out = cut_in_flight("cut.fallback")
    finally:
        change_testbed(host="a0", link_up=True)
    ref = hvd.allreduce(data(7).double(), name="ref.cut", op=hvd.Average)
    return close_to(out, ref, torch.float32)


def link_flap() -> str:
    """The aggregator host's link down for 1.5 s (less than the timeout) while tensors stream:
    they complete after retransmissions, exact, and aggregation is not marked down."""
    hvd_sparse.init(probe="off", timeout=TIMEOUT)
    worker = basics.state().omni.worker
    xs = [data(200 + i, density=1.0) for i in range(4)]  # 32 MiB per rank: about 1 s on a0
    refs = [hvd.allreduce(x.double(), name=f"ref.flap{i}", op=hvd.Sum) for i, x in enumerate(xs)]
    before = worker.stats()["retransmits"]
    hs = [hvd_sparse.allreduce_async(x, name=f"flap{i}", scheme="omnireduce", op=hvd.Sum)
          for i, x in enumerate(xs)]
    barrier("flap")
    if hvd.rank() == 0:
        tb = Testbed.load(os.environ["HVD_SPARSE_TESTBED"])
        lifecycle.update(tb, host="a0", link_up=False)
        time.sleep(1.5)
        lifecycle.update(tb, host="a0", link_up=True)
    outs = [hvd_sparse.synchronize(h) for h in hs]
    bad = [f"flap{i}: {w}" for i, (o, r) in enumerate(zip(outs, refs, strict=True))
           if (w := close_to(o, r, torch.float32)) != ""]
    retx = hvd.allreduce(torch.tensor([worker.stats()["retransmits"] - before]), op=hvd.Sum,
                         name="flap.retx")
    if int(retx) == 0:
        bad.append("no retransmission: the link went down after the tensors were done")
    if basics.state().omni.down != "":
        bad.append(f"aggregation marked down: {basics.state().omni.down}")
    return "; ".join(bad)


def local_aggregator() -> str:
    """No aggregator given, all on rank 0's host (not the colocated default of several
    hosts): rank 0 starts one, which the other namespaces must reach."""
    hvd_sparse.init(probe="off", timeout=TIMEOUT, aggregators="", local_aggregators=1,
                    aggregator_layout="rank0")
    host = basics.state().omni.addrs[0][0]
    if host.startswith("127."):
        return f"rank 0's aggregator advertised at {host}, unreachable from other hosts"
    t = data(9)
    ref = hvd.allreduce(t.double(), name="ref.local", op=hvd.Average)
    return close_to(hvd_sparse.allreduce(t, name="local", scheme="omnireduce"), ref,
                    torch.float32)


def moved_aggregator() -> str:
    """Rank 0 moves a0 to another address between two reductions; the reduction after goes
    dense on the timeout, the probes find a0's name at its new address, and at a look the job
    regroups there. Moved back after (the testbed as it was for what follows)."""
    tb = Testbed.load(os.environ["HVD_SPARSE_TESTBED"])
    home, away = tb.host("a0").ip, tb.host("a0").ip.rsplit(".", 1)[0] + ".150"
    hvd_sparse.init(probe="off", timeout=TIMEOUT, fallback="dense",
                    aggregators=tb.aggregator_addresses(by_name=True))
    omni = basics.state().omni
    epoch, bad = omni.membership.epoch, []
    try:
        for i in range(4 * RETRY_EVERY):
            if i == 1:
                barrier("move")
                if hvd.rank() == 0:
                    lifecycle.move(Testbed.load(os.environ["HVD_SPARSE_TESTBED"]), "a0", away)
                barrier("moved")
            t = data(300 + i, density=0.3)[: 1 << 16]
            ref = hvd.allreduce(t.double(), name=f"ref.move{i}", op=hvd.Average)
            if w := close_to(hvd_sparse.allreduce(t, name="move", scheme="omnireduce"), ref,
                             torch.float32):
                bad.append(f"call {i}: {w}")
            if i > 1 and omni.membership.epoch > epoch and not omni.down:
                break
        else:
            bad.append(f"a0 not found at {away} within {4 * RETRY_EVERY} reductions")
        if hvd_sparse.metrics()["move"]["scheme"] != "omnireduce":
            bad.append(f"the last reduction went {hvd_sparse.metrics()['move']['scheme']}")
    finally:
        barrier("move back")
        if hvd.rank() == 0:
            tb = Testbed.load(os.environ["HVD_SPARSE_TESTBED"])
            if tb.host("a0").ip != home:
                lifecycle.move(tb, "a0", home)
        barrier("moved back")
    return "; ".join(bad)


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start(probe="off", timeout=TIMEOUT)
    yield
    hvd_sparse.shutdown()


def test_every_scheme_matches_horovod():
    assert schemes() == ""


def test_loss_on_the_switch_gives_identical_results():
    assert lossy_switch() == ""


def test_link_cut_is_an_error_naming_the_aggregator():
    assert link_cut() == ""


def test_link_cut_with_fallback_is_right():
    assert link_cut_fallback() == ""


def test_link_flap_shorter_than_the_timeout_recovers():
    assert link_flap() == ""


def test_rank0_local_aggregator_is_reachable():
    assert local_aggregator() == ""


def test_a_moved_aggregator_is_found_under_its_name():
    assert moved_aggregator() == ""
