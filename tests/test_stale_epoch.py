"""Stale traffic (docs/PROTOCOL.md "Memberships"): a job keeps its token across memberships and
every packet carries the membership's epoch. A worker of the old membership that still sends
after a new membership registered (a straggler) is dropped and counted ``stale_epoch`` by a
real aggregator process, and by the emulated switch (DPDK, in network namespaces), while the
new membership's sums stay exact against a float64 reference; the ranks agree on the epoch
whoever survived. Every wait is bounded."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from aggregator_helpers import HOST, WAIT, assert_result, block_sparse, reference

from hvd_sparse import _C, protocol, session
from hvd_sparse.tools import wire

T = protocol.TYPES
TOKEN = 0xE90C
ROOT = Path(__file__).resolve().parents[1]


def _submit(workers, tensor_id, inputs, name):
    outs = [torch.zeros_like(x) for x in inputs]
    tickets = [w.submit(tensor_id, x, o, 64, 7, None, name, 1.0)
               for w, x, o in zip(workers, inputs, outs, strict=True)]
    return outs, tickets


def _finish(workers, tickets, timeout=WAIT):
    for w, t in zip(workers, tickets, strict=True):
        assert w.wait(t, timeout), "no hang"
        w.finish(t)


def _stats_until(agg, ok, what: str, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while not ok(s := agg.stats()):
        if time.monotonic() > deadline:
            raise AssertionError(f"aggregator {agg.addr}: {what}: {s}")
        time.sleep(0.05)
    return s


def test_a_straggler_of_the_old_membership_is_dropped_and_counted(aggs, make_workers):
    """Three workers form epoch 1; two of them join again as epoch 2 (one worker lost) with the
    same token. The third, which has not noticed, streams the same tensor id at epoch 1 and
    sends BYE: the aggregator drops all of it (``stale_epoch``), the new membership's sums equal
    the float64 sum of its own inputs, and its job survives the straggler's BYE."""
    agg = aggs(0)  # jobs of any size: the membership shrinks
    kw = {"payload_bytes": 1024, "slots_per_aggregator": 4}
    old = make_workers([agg], 3, token=TOKEN, epoch=1, timeout=1.5, **kw)
    rng = np.random.default_rng(51)
    ins = [block_sparse(rng, 64 * 200 + 5, 64, 0.4, torch.float32) for _ in range(3)]
    outs, tickets = _submit(old, 7, ins, "w")
    _finish(old, tickets)
    for r in range(3):
        assert_result(outs[r], reference(ins), f"epoch 1 rank {r}")

    new = make_workers([agg], 2, token=TOKEN, epoch=2, **kw)
    s = agg.stats()
    assert s["memberships"] == 1 and s["stale_epoch"] == 0, s

    straggler = old[2]
    lost = block_sparse(rng, 64 * 200 + 5, 64, 1.0, torch.float32) * 1e6  # would show in a sum
    gone, ticket = _submit([straggler], 8, [lost], "w")
    mine = [block_sparse(rng, 64 * 200 + 5, 64, 0.4, torch.float32) for _ in range(2)]
    outs, tickets = _submit(new, 8, mine, "w")  # the same tensor id, at the same time
    _finish(new, tickets)
    for r in range(2):
        assert_result(outs[r], reference(mine), f"epoch 2 rank {r}")
    # the straggler's DATA went nowhere: it times out naming the aggregator, it does not hang
    assert straggler.wait(ticket[0], 10), "no hang"
    with pytest.raises(RuntimeError, match=re.escape(f"{HOST}:{agg.port}")):
        straggler.finish(ticket[0])
    assert torch.count_nonzero(gone[0]) == 0  # nothing came back to it

    straggler.close()  # its BYE, at epoch 1
    s = _stats_until(agg, lambda s: s["stale_epoch"] >= 2, "the straggler's packets")
    assert s["memberships"] == 1 and s["mismatch"] == 0 and s["malformed"] == 0, s
    # the new membership's job is intact: another tensor goes through
    mine = [block_sparse(rng, 64 * 50, 64, 0.5, torch.float32) for _ in range(2)]
    outs, tickets = _submit(new, 9, mine, "v")
    _finish(new, tickets)
    for r in range(2):
        assert_result(outs[r], reference(mine), f"epoch 2 rank {r}, after the BYE")


def test_a_late_register_of_the_old_epoch_changes_nothing(aggs, make_workers):
    """A REGISTER of an earlier epoch (a straggler's keep-alive) gets no answer and replaces
    nothing; one of a later epoch replaces the job; a non-zero reserved field is malformed."""
    agg = aggs(0)
    make_workers([agg], 2, token=TOKEN, epoch=5)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((HOST, 0))
    sock.settimeout(0.5)
    try:
        sock.sendto(wire.header(type=T["REGISTER"], token=TOKEN, epoch=4, worker=0,
                                nworkers=2), agg.addr)
        with pytest.raises(socket.timeout):
            sock.recv(2048)
        s = agg.stats()
        assert (s["stale_epoch"], s["memberships"], s["jobs"]) == (1, 0, 1), s
        sock.sendto(wire.header(type=T["REGISTER"], token=TOKEN, epoch=5, worker=0,
                                nworkers=2, reserved=1), agg.addr)
        with pytest.raises(socket.timeout):
            sock.recv(2048)
        assert agg.stats()["malformed"] == 1
        sock.sendto(wire.header(type=T["REGISTER"], token=TOKEN, epoch=6, worker=0,
                                nworkers=3), agg.addr)
        ack = wire.parse(sock.recv(2048))
        assert (ack["type"], ack["epoch"], ack["token"]) == (T["REGACK"], 6, TOKEN), ack
        s = agg.stats()
        assert (s["stale_epoch"], s["memberships"]) == (1, 1), s
    finally:
        sock.close()


@pytest.mark.unit
def test_the_epoch_is_under_the_mac():
    """Authenticated (the aggregator core, in process): a REGISTER whose epoch was changed
    fails its tag (``bad_mac``) and replaces nothing, so no one without the key moves a job to
    a later membership; a signed one of an earlier epoch is stale, of a later one replaces."""
    secret = b"hvd-sparse epoch test secret, 32B"
    key = _C.derive_job_key(secret, TOKEN)
    core = _C.AggregatorCore(secret=secret)
    seq = iter(range(1, 100))

    def register(epoch: int, worker: int = 0) -> bytes:
        p = bytearray(wire.header(type=T["REGISTER"], token=TOKEN, epoch=epoch, worker=worker,
                                  nworkers=2))
        p[7] |= protocol.FLAGS["AUTH"]
        return _C.gmac_sign(key, bytes(p), worker, next(seq))

    sender = ("10.0.0.1", 5000)
    (_, ack), = core.handle(register(2), sender)
    assert wire.parse(ack)["type"] == T["REGACK"] and wire.parse(ack)["epoch"] == 2
    assert core.handle(register(1), sender) == []
    forged = bytearray(register(2))
    at = next(off for name, off, _ in protocol.FIELDS if name == "epoch")
    forged[at:at + 4] = (3).to_bytes(4, "big")  # the epoch, moved on after signing
    assert core.handle(bytes(forged), sender) == []
    c = core.counters()
    assert (c["stale_epoch"], c["bad_mac"], c["memberships"]) == (1, 1, 0), c
    (_, ack), = core.handle(register(3), sender)
    assert wire.parse(ack)["epoch"] == 3 and core.counters()["memberships"] == 1


class FakeComm:
    """The collectives ``agree_membership`` uses, over a list of ranks' answers."""

    def __init__(self, rank: int, answers: list) -> None:
        self.rank, self.answers = rank, answers

    def allgather_object(self, value, name):
        self.answers[self.rank] = value
        return list(self.answers)


@pytest.mark.unit
def test_ranks_agree_on_a_larger_epoch_whoever_survived():
    """A fresh process (join 1) among survivors of epoch 3 joins epoch 4 under their token;
    with no survivor, rank 0's new token at epoch 1."""
    old = session.Membership(0xABC, 3)
    votes = [(3, 0xABC, 0x111), (0, 0, 0), (3, 0xABC, 0)]  # ranks 0 and 2 survived
    got = {session.agree_membership(FakeComm(r, list(votes)), m, "omni")
           for r, m in enumerate((old, None, old))}
    assert got == {session.Membership(0xABC, 4)}
    fresh = [(0, 0, 0x222), (0, 0, 0)]
    assert session.agree_membership(FakeComm(1, fresh), None, "omni") == \
        session.Membership(0x222, 1)


# ------------------------------------------------------------------------------------------
# The emulated switch: DPDK on a veth, the workers in a host namespace behind it
# ------------------------------------------------------------------------------------------

# Runs in the worker host's namespace. The job's two workers live in this one process (both
# bound to this host, as the install says); the control socket is a path, reachable from here.
# argv: switch ip:port, control socket, this host's IP; prints one JSON line.
SWITCH_JOB = textwrap.dedent(r"""
    import json, sys
    import numpy as np, torch
    from hvd_sparse import _C
    from hvd_sparse.switch_control import Client
    host, port = sys.argv[1].split(":")
    switch, ctl, ip = (host, int(port)), Client(sys.argv[2]), sys.argv[3]
    token, bs, e = 0x5E0C, 64, 20  # values: integers of magnitude < 2^10, so 2 x 2^10 x 2^20 fits

    def members(epoch, timeout=30.0):
        ctl.install(token, 2, 8, [ip, ip], epoch=epoch)
        ws = [_C.OmniWorker([switch], token, r, 2, timeout=timeout, epoch=epoch)
              for r in range(2)]
        for w in ws:
            w.register(20.0)
        return ws

    def submit(ws, tid, xs):
        outs = [torch.zeros_like(x) for x in xs]
        ts = [w.submit(tid, x, o, bs, 7, None, "t", 1.0, e) for w, x, o in zip(ws, xs, outs)]
        return outs, ts

    def values(seed, n=bs * 40, scale=1000):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(-scale, scale + 1, (n,), generator=g).float()
        x.view(-1, bs)[torch.rand(n // bs, generator=g) < 0.5] = 0  # whole blocks zero
        return x

    report = {}
    old = members(1, timeout=2.0)
    xs = [values(1), values(2)]
    outs, ts = submit(old, 7, xs)
    for w, t in zip(old, ts):
        assert w.wait(t, 30.0), "no hang"
        w.finish(t)
    ref = (xs[0].double() + xs[1].double()).float()
    report["epoch1_exact"] = all(torch.equal(o, ref) for o in outs)

    new = members(2)  # the control plane installs the new membership: epoch 1's job replaced
    straggler = old[1]
    gone, (lost,) = submit([straggler], 8, [values(3) * 1.0])
    xs = [values(4), values(5)]
    outs, ts = submit(new, 8, xs)  # the same tensor id, while the straggler streams it
    for w, t in zip(new, ts):
        assert w.wait(t, 30.0), "no hang"
        w.finish(t)
    ref = (xs[0].double() + xs[1].double()).float()
    report["epoch2_exact"] = all(torch.equal(o, ref) for o in outs)
    assert straggler.wait(lost, 15.0), "no hang"
    try:
        straggler.finish(lost)
        report["straggler"] = "finished"
    except RuntimeError as err:
        report["straggler"] = str(err)
    for w in old:
        w.close()  # BYEs at epoch 1
    report["removed_by_old"] = ctl.remove(token, 1)  # the old rank 0's late close
    report["jobs"] = ctl.jobs(token)
    outs, ts = submit(new, 9, [values(6), values(7)])  # the new job is intact
    for w, t in zip(new, ts):
        assert w.wait(t, 30.0), "no hang"
        w.finish(t)
    report["after_bye_exact"] = all(
        torch.equal(o, (values(6).double() + values(7).double()).float()) for o in outs)
    report["aggregation"] = ctl.stats()["aggregation"]
    for w in new:
        w.close()
    ctl.remove(token, 2)
    print(json.dumps(report))
""")


@pytest.mark.testbed
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_the_switch_drops_a_straggler_of_the_old_membership(tmp_path):
    """The emulated switch (a real DPDK process on a veth): epoch 1's job installed and summed,
    then epoch 2 installed under the same token; a worker of epoch 1 streams the same tensor id
    and leaves with BYE: the switch drops and counts all of it (``stale_epoch``), epoch 2's
    sums are exact (integers in fixed point: the float64 sum to the bit), and the old rank 0's
    late ``remove`` leaves the new membership installed."""
    from hvd_sparse.tools.testbed import lifecycle, topology

    pytest.importorskip("pyroute2")
    try:
        from hvd_sparse.tools.switch import binary
        binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    name = f"hse{os.getpid() % 100000}"
    # two hosts: a switch has two ports at least; both workers live on the first
    tb = lifecycle.up(topology.Testbed(name, workers=2, aggregators=0, switch="emu"))
    try:
        host = tb.hosts[0]
        script = tmp_path / "job.py"
        script.write_text(SWITCH_JOB)
        p = subprocess.run(["ip", "netns", "exec", host.ns, sys.executable, str(script),
                            tb.switch_address, str(tb.switch_control), host.ip],
                           capture_output=True, text=True, timeout=150,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})  # this checkout's
        assert p.returncode == 0, f"the job in {host.ns}: {p.stderr[-3000:]}"
        report = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        lifecycle.down(name)
    agg = report["aggregation"]
    assert report["epoch1_exact"] and report["epoch2_exact"] and report["after_bye_exact"], report
    assert "timed out" in report["straggler"] or "no progress" in report["straggler"] \
        or tb.switch_address.split(":")[0] in report["straggler"], report["straggler"]
    assert report["removed_by_old"] is False and [j["epoch"] for j in report["jobs"]] == [2]
    # its DATA (retransmitted until its timeout) and both BYEs: dropped, counted, never summed
    assert agg["stale_epoch"] >= 3 and agg["memberships"] == 1, agg
    assert agg["mismatch"] == agg["malformed"] == agg["foreign"] == 0, agg
