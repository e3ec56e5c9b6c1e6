"""The emulated switch's aggregation data plane (csrc/switch/pipeline.cpp) driven packet
by packet with no port: ``_C.SwitchPipeline.handle(packet, sender)`` returns what the switch
would send. Workers are test_aggregator_core's protocol simulation (independent of the C++
worker engine), sending FIXED32 values; sums are compared with numpy's int64 sums."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch
from aggregator_helpers import KINDS, junk_packets
from aggregator_helpers import Job as FuzzJob
from test_aggregator_core import SimWorker, simulate

from hvd_sparse import _C, protocol
from hvd_sparse.tools import wire

T, ERR, FIX = protocol.TYPES, protocol.ERRORS, protocol.FIXED32


def fixed_job(n: int, numel: int, bs: int, lanes: int, nslots: int, density: float, seed: int,
              token: int = 0x77, tensor: int = 77, bound: int = 2**31 // 64):
    """Workers holding random int32 values (|x| < bound) in blocks kept with ``density``, and
    the int64 sum they must get."""
    rng = np.random.default_rng(seed)
    nb = -(-numel // bs)
    xs = [(rng.integers(-bound, bound, numel) *
           np.repeat(rng.random(nb) < density, bs)[:numel]).astype(np.int32) for _ in range(n)]
    ws = [SimWorker(r, n, token, xs[r], bs, lanes, nslots, FIX, tensor) for r in range(n)]
    return ws, np.sum([x.astype(np.int64) for x in xs], axis=0)


def register(sw, ws) -> list:
    return [wire.parse(b) for w in ws for _, b in sw.handle(wire.header(
        type=T["REGISTER"], token=w.base["token"], worker=w.rank,
        nworkers=w.base["nworkers"]), w.addr)]


def release(sw, ws, now: float = 0.0) -> None:
    """Every worker's per-slot RELEASE after its slots' last results."""
    for w in ws:
        for s in range(w.nslots):
            sw.handle(wire.header(type=T["RELEASE"], token=w.base["token"], worker=w.rank,
                                  nworkers=len(ws), tensor=w.tensor, slot=s,
                                  nslots=w.nslots), w.addr, now)


@pytest.mark.parametrize("density", [0.0, 1e-4, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("bs,lanes", [(64, 8), (256, 2), (100, 3)])
def test_sums_are_exact(density, bs, lanes):
    """4 workers, blocks in any order, some lost or duplicated: every worker gets the exact
    int64 sum; the passes counted are lanes x ceil(block_size / 64) per DATA."""
    sw = _C.SwitchPipeline(auto_groups=16, cells_per_slot=32)  # multi-pass packets too
    ws, ref = fixed_job(4, 20_000, bs, lanes, 6, density, seed=int(density * 1e4) + bs)
    # REGACK carries the job's group count: no tensor lays out more slots than that
    assert [(p["type"], p["nslots"]) for p in register(sw, ws)] == [(T["REGACK"], 16)] * 4
    simulate(sw, ws, np.random.default_rng(bs), drop=0.05, dup=0.05)
    for w in ws:
        assert np.array_equal(w.result()[:ref.size].astype(np.int64), ref), f"rank {w.rank}"
    c = sw.counters()
    passes = lanes * -(-bs // 64)
    data = c["packets"] - 8  # all but the REGISTERs (ours and simulate's) are DATA here
    assert c["recirculations"] == data * (passes - 1)
    assert c["passes"] == c["packets"] + c["recirculations"]
    assert c["overflow"] == c["malformed"] == 0


def test_retransmission_gets_the_stored_result():
    """A DATA of the previous round (its sender lost the RESULT) gets the same bytes back,
    from the shadow set, without touching the round in progress."""
    sw = _C.SwitchPipeline(auto_groups=4, cells_per_slot=2)
    ws, _ = fixed_job(2, 64 * 8, 64, 2, 1, 1.0, seed=1)
    register(sw, ws)
    first = [w.data(0) for w in ws]
    assert sw.handle(first[0], ws[0].addr) == []
    results = sw.handle(first[1], ws[1].addr)
    assert [a for a, _ in results] == [w.addr for w in ws]
    assert len({b for _, b in results}) == 1  # one multicast packet
    ws[0].on_result(wire.parse(results[0][1]))  # worker 0 moves on to round 1
    sw.handle(ws[0].data(0), ws[0].addr)
    again = sw.handle(first[1], ws[1].addr)  # worker 1 lost RESULT 0
    assert again == [(ws[1].addr, results[0][1])]
    assert sw.counters()["retransmits"] == 1


def test_resent_data_of_a_waiting_round_is_held():
    """A duplicate DATA (its worker already in the seen-bitmap) leaves the registers as they
    were; into a round open for HELD_AFTER it goes back to its sender as a HELD, the header
    alone, naming the lowest worker not seen. The round then sums each worker's values once."""
    sw = _C.SwitchPipeline(auto_groups=4, cells_per_slot=2)
    ws, ref = fixed_job(3, 64 * 2, 64, 2, 1, 1.0, seed=5)
    register(sw, ws)
    first = [w.data(0) for w in ws]
    assert sw.handle(first[1], ws[1].addr, 0.0) == []
    assert sw.handle(first[1], ws[1].addr, protocol.HELD_AFTER * 0.9) == []  # a busy peer
    late = protocol.HELD_AFTER * 1.1
    [(to, raw)] = sw.handle(first[1], ws[1].addr, late)
    held = wire.parse(raw)
    assert to == ws[1].addr and len(raw) == protocol.HEADER_BYTES
    assert (held["type"], held["tensor"], held["slot"], held["round"], held["worker"],
            held["nworkers"]) == (T["HELD"], ws[1].tensor, 0, 0, 0, 3)
    assert sw.handle(first[0], ws[0].addr, late) == []
    [(_, raw)] = sw.handle(first[1], ws[1].addr, late)
    assert wire.parse(raw)["worker"] == 2
    sent = sw.handle(first[2], ws[2].addr, late)
    for w in ws:
        w.on_result(wire.parse(dict(sent)[w.addr]))
        assert np.array_equal(w.result().astype(np.int64), ref), f"rank {w.rank}"
    assert sw.counters()["duplicates"] == 3


def test_the_only_holder_gets_the_header_alone():
    """A round whose blocks one worker alone carried: that worker's copy is the header and
    lane table, flagged OWN, with no block (also when resent from the shadow set); the others
    get its blocks as the sums. A round two workers carry goes whole to every worker."""
    sw = _C.SwitchPipeline(auto_groups=4, cells_per_slot=2)
    rng = np.random.default_rng(3)
    x0 = rng.integers(-2**20, 2**20, 256).astype(np.int32)  # blocks 0-3, 2 lanes: 2 rounds
    x2 = np.where(np.arange(256) // 64 == 2, rng.integers(-2**20, 2**20, 256), 0).astype(np.int32)
    xs = [x0, np.zeros(256, np.int32), x2]  # round 0 (blocks 0, 1): worker 0's alone
    ws = [SimWorker(r, 3, 0x77, x, 64, 2, 1, FIX, 77) for r, x in enumerate(xs)]
    register(sw, ws)
    sent = dict([sw.handle(w.data(0), w.addr) for w in ws][-1])
    copies = {a: wire.parse(b) for a, b in sent.items()}
    own = copies[ws[0].addr]
    assert own["flags"] & protocol.FLAGS["OWN"] and own["bitmap"] == own["present"] == 0, own
    assert len(sent[ws[0].addr]) == protocol.HEADER_BYTES + protocol.BITMAP_BYTES \
        + 2 * protocol.LANE_BYTES
    assert [copies[w.addr]["bitmap"] for w in ws[1:]] == [0b11, 0b11]
    # worker 0 lost its copy: the same comes back from the shadow set
    assert sw.handle(ws[0].data(0), ws[0].addr) == [(ws[0].addr, sent[ws[0].addr])]
    nxt = [w.on_result(copies[w.addr]) for w in ws]
    last = dict([sw.handle(d, w.addr) for w, d in zip(ws, nxt, strict=True)][-1])
    assert [wire.parse(last[w.addr])["bitmap"] for w in ws] == [0b11] * 3  # two holders
    ref = x0.astype(np.int64) + x2
    for w in ws:
        w.on_result(wire.parse(last[w.addr]))
        assert np.array_equal(w.result().astype(np.int64), ref), f"rank {w.rank}"
    assert sw.counters()["own_results"] == 2  # the round's copy and its resend


def test_overflow_is_reported_never_wrapped():
    """Sums beyond int32 saturate and the round answers ERROR OVERFLOW to every worker, also
    to retransmissions: no RESULT (wrapped or saturated) ever leaves the switch."""
    sw = _C.SwitchPipeline(auto_groups=4)
    x = np.full(64, 2**30 + 5, np.int32)
    ws = [SimWorker(r, 2, 0x77, x, 64, 1, 1, FIX) for r in range(2)]
    register(sw, ws)
    sent = sw.handle(ws[0].data(0), ws[0].addr) + sw.handle(ws[1].data(0), ws[1].addr)
    got = [(a, wire.parse(b)) for a, b in sent]
    assert [(a, p["type"], p["round"]) for a, p in got] == \
        [(w.addr, T["ERROR"], ERR["OVERFLOW"]) for w in ws]
    assert all(p["tensor"] == 77 for _, p in got)
    again = [wire.parse(b) for _, b in sw.handle(ws[0].data(0), ws[0].addr)]
    assert [(p["type"], p["round"]) for p in again] == [(T["ERROR"], ERR["OVERFLOW"])]
    assert sw.counters()["overflow"] == 1


def test_what_a_switch_cannot_sum_is_refused():
    """33 workers (a 32-bit seen-bitmap), floating-point values and packets beyond a slot's
    cells are refused with ERROR UNSUPPORTED, which sends the job elsewhere."""
    sw = _C.SwitchPipeline(auto_groups=4, cells_per_slot=4)
    p = register(sw, [SimWorker(32, 33, 5, np.zeros(4, np.int32), 4, 1, 1, FIX)])
    assert [(x["type"], x["round"]) for x in p] == [(T["ERROR"], ERR["UNSUPPORTED"])]
    assert sw.jobs() == []
    with pytest.raises(RuntimeError, match="at most 32"):
        sw.install(token=6, nworkers=33, groups=1)
    floats = [SimWorker(r, 2, 7, np.ones(64, np.float32), 64, 1, 1, 0) for r in range(2)]
    register(sw, floats)
    out = [wire.parse(b) for _, b in sw.handle(floats[0].data(0), floats[0].addr)]
    assert [(x["type"], x["round"]) for x in out] == [(T["ERROR"], ERR["UNSUPPORTED"])] * 2
    big = [SimWorker(r, 2, 8, np.ones(64 * 5, np.int32), 64, 5, 1, FIX) for r in range(2)]
    register(sw, big)  # 5 lanes of 64 values: 5 passes, 4 cells per slot
    out = [wire.parse(b) for _, b in sw.handle(big[0].data(0), big[0].addr)]
    assert [(x["type"], x["round"]) for x in out] == [(T["ERROR"], ERR["UNSUPPORTED"])] * 2
    # refused: the 33-worker REGISTER and the 33-worker install
    assert sw.counters()["unsupported"] == 2 and sw.counters()["refused"] == 2


def test_jobs_get_disjoint_ranges_and_run_together():
    """Installed jobs own disjoint group ranges (first fit, refused when the pool is full) and
    two jobs interleaved on the switch both get exact sums."""
    sw = _C.SwitchPipeline(cells=64 * 32, cells_per_slot=32)  # 64 groups
    assert sw.install(token=1, nworkers=3, groups=20) == 0
    assert sw.install(token=2, nworkers=3, groups=20) == 20
    with pytest.raises(RuntimeError, match="exhausted: 30 slot groups asked, 24 of 64 free"):
        sw.install(token=3, nworkers=3, groups=30)
    assert sw.remove(1) and sw.install(token=3, nworkers=2, groups=10) == 0
    assert [(j["token"], j["first"], j["groups"]) for j in sw.jobs()] == \
        [(3, 0, 10), (2, 20, 20)]
    a, ref_a = fixed_job(3, 5000, 64, 4, 5, 0.3, seed=3, token=2, tensor=11)
    b, ref_b = fixed_job(2, 7000, 64, 4, 5, 0.3, seed=4, token=3, tensor=11)
    for w in b:
        w.addr = (f"10.0.1.{w.rank + 1}", 7000 + w.rank)
    register(sw, a)
    register(sw, b)
    simulate(sw, a + b, np.random.default_rng(5), drop=0.02)
    for ws, ref in ((a, ref_a), (b, ref_b)):
        for w in ws:
            assert np.array_equal(w.result()[:ref.size].astype(np.int64), ref)
    # REGISTER of an uninstalled job, with automatic installs off, is refused.
    p = register(sw, [SimWorker(0, 2, 99, np.zeros(4, np.int32), 4, 1, 1, FIX)])
    assert [(x["type"], x["round"]) for x in p] == [(T["ERROR"], ERR["JOB"])]


def test_slots_in_flight_and_round_wait_are_timed():
    """occupied_us integrates the bound groups over the switch's clock and round_wait_us sums
    each round's first-to-last DATA: two one-round slots, bound at t=1 and t=2, completed at
    t=1.5 and t=2.25, released at t=3 and t=4 (by hand: 2 s + 2 s of one bound slot; waits
    0.5 s + 0.25 s)."""
    sw = _C.SwitchPipeline(cells=64, cells_per_slot=32)
    sw.install(token=0x77, nworkers=2, groups=2)
    a, ref_a = fixed_job(2, 256, 64, 4, 1, 1.0, seed=9, tensor=1)  # 4 lanes x 1 block: 1 round
    b, ref_b = fixed_job(2, 256, 64, 4, 1, 1.0, seed=10, tensor=2)
    register(sw, a)
    for ws, t0, t1 in ((a, 1.0, 1.5), (b, 2.0, 2.25)):  # the switch's clock only advances
        assert sw.handle(ws[0].data(0), ws[0].addr, t0) == []
        out = sw.handle(ws[1].data(0), ws[1].addr, t1)
        assert [wire.parse(x)["type"] for _, x in out] == [T["RESULT"]] * 2
    assert sw.occupied() == 2
    release(sw, a, 3.0)
    release(sw, b, 4.0)
    assert sw.occupied() == 0
    c = sw.counters()
    assert c["results"] == 2 and c["released"] == 2
    assert c["round_wait_us"] == 750_000
    assert c["occupied_us"] == 4_000_000  # 1 slot over [1, 2), 2 over [2, 3), 1 over [3, 4)


def test_a_bound_group_makes_others_wait_until_released():
    """With one group, tensor B's round 0 is dropped ("busy") while tensor A's slot holds it;
    the workers' per-slot RELEASEs free it; without them it is reclaimed after `hold`."""
    sw = _C.SwitchPipeline(cells=32, cells_per_slot=32, hold=2.0)
    sw.install(token=0x77, nworkers=2, groups=1)
    a, ref_a = fixed_job(2, 640, 64, 4, 1, 1.0, seed=6, tensor=1)
    b, ref_b = fixed_job(2, 640, 64, 4, 1, 1.0, seed=7, tensor=2)
    register(sw, a)
    simulate(sw, a, np.random.default_rng(1))
    assert sw.occupied() == 1
    assert sw.handle(b[0].data(0), b[0].addr, 1.0) == []
    assert sw.counters()["busy"] == 1
    release(sw, a)
    assert sw.occupied() == 0 and sw.counters()["released"] == 1
    simulate(sw, b, np.random.default_rng(2))
    for ws, ref in ((a, ref_a), (b, ref_b)):
        assert all(np.array_equal(w.result()[:ref.size].astype(np.int64), ref) for w in ws)
    c, ref_c = fixed_job(2, 640, 64, 4, 1, 1.0, seed=8, tensor=3)
    assert sw.handle(c[0].data(0), c[0].addr, 1.0) == []  # b never released: busy...
    assert sw.handle(c[0].data(0), c[0].addr, 3.0) == []  # ... until `hold` has passed
    assert sw.counters()["reclaimed"] == 1 and sw.counters()["busy"] == 2
    out = sw.handle(c[1].data(0), c[1].addr, 3.0)
    assert [wire.parse(x)["type"] for _, x in out] == [T["RESULT"]] * 2


def test_junk_never_changes_a_sum():
    """test_aggregator_junk's fuzz cases (malformed, truncated, foreign-job packets, float values
    for the running tensor) among a live job's packets: exact sums, foreign packets counted."""
    sw = _C.SwitchPipeline(auto_groups=8, cells_per_slot=32)
    ws, ref = fixed_job(FuzzJob.n, FuzzJob.numel, FuzzJob.bs, FuzzJob.lanes, FuzzJob.nslots,
                        0.2, seed=9, token=FuzzJob.token)
    register(sw, ws)
    rng = np.random.default_rng(9)
    built = [junk_packets(kind, 2000 + i, ws[0].tensor, rng.bytes(int(rng.integers(0, 300))))
             for i, kind in enumerate(KINDS * 4)]
    simulate(sw, ws, rng, drop=0.02, junk=[p for _, p in built])
    for w in ws:
        assert np.array_equal(w.result()[:ref.size].astype(np.int64), ref)
    c = sw.counters()
    assert c["unknown_job"] == sum(1 for e, _ in built if e == "unknown"), c
    assert c["malformed"] >= sum(1 for e, _ in built if e == "malformed"), c


def test_regack_carries_the_slot_geometry():
    """A switch's REGACK: the job's groups in nslots, its values per pass in block_size and its
    cells per slot in lanes (docs/PROTOCOL.md "Jobs"), as configured, else protocol.h's."""
    for kw, want in (({}, (protocol.SWITCH_VALUES_PER_PASS, protocol.SWITCH_CELLS_PER_SLOT)),
                     ({"values_per_pass": 32, "cells_per_slot": 8}, (32, 8))):
        ws = [SimWorker(r, 2, 0x77, np.zeros(4, np.int32), 4, 1, 1, FIX) for r in range(2)]
        got = register(_C.SwitchPipeline(auto_groups=16, **kw), ws)
        assert [(p["type"], p["nslots"], p["block_size"], p["lanes"]) for p in got] == \
            [(T["REGACK"], 16, *want)] * 2
    with pytest.raises(ValueError, match="16 bits"):
        _C.SwitchPipeline(cells=1 << 17, cells_per_slot=1 << 16)


class Relay:
    """A socket-free core behind a real UDP socket, on a thread: what the C++ worker engine
    registers and streams with."""

    def __init__(self, core) -> None:
        self.core, self.stop = core, False
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.addr = self.sock.getsockname()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop:
            try:
                data, sender = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            for to, b in self.core.handle(data, sender, time.monotonic()):
                self.sock.sendto(b, to)

    def close(self) -> None:
        self.stop = True
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.mark.parametrize("core,geometry", [
    (lambda: _C.AggregatorCore(), (0, 0)),
    (lambda: _C.SwitchPipeline(auto_groups=4),
     (protocol.SWITCH_VALUES_PER_PASS, protocol.SWITCH_CELLS_PER_SLOT)),
    (lambda: _C.SwitchPipeline(auto_groups=4, values_per_pass=32, cells_per_slot=8), (32, 8)),
], ids=["software", "switch", "small switch"])
def test_the_regack_geometry_reaches_the_worker(core, geometry):
    """The C++ worker engine reads the geometry from its REGACK and caps its payload at what a
    slot holds (values per pass x cells per slot x 4 bytes; uncapped from software): the
    small switch (1 KiB slots) then sums a fixed-point tensor it would refuse at the configured
    payload (64 lanes of 32 values: 64 passes, 8 cells)."""
    relay = Relay(core())
    payload = 64512
    w = _C.OmniWorker([relay.addr], 0x6E0, 0, 1, payload_bytes=payload, timeout=10.0)
    try:
        assert w.slot_geometry() == (0, 0) and w.payload_bytes() == payload  # not registered
        w.register(10.0)
        values_per_pass, cells_per_slot = geometry
        assert w.slot_geometry() == geometry
        assert w.payload_bytes() == min(payload, 4 * values_per_pass * cells_per_slot or payload)
        # a switch's smaller packets come with more slots, at most the job's groups (4)
        assert w.slots_per_aggregator() == (4 if values_per_pass else 64)
        if geometry == (32, 8):
            x = (torch.arange(32 * 8 * 3, dtype=torch.float32) % 7) - 3
            out = torch.zeros_like(x)
            ticket = w.submit(1, x, out, 32, 0, None, "x", 1.0, 0)
            assert w.wait(ticket, 10.0)
            stats = w.finish(ticket)
            assert torch.equal(out, x) and stats["lanes"] == 8, stats
    finally:
        w.close()
        relay.close()


def test_installed_workers_are_bound_to_their_hosts():
    """A job installed with its workers' addresses takes each worker's REGISTER only from its
    own host: another host claiming the worker gets no reply (counted foreign), and cannot
    take over a worker that already registered; the job still sums exactly."""
    sw = _C.SwitchPipeline(cells_per_slot=4)
    ws, ref = fixed_job(2, 64 * 16, 64, 4, 2, 0.5, seed=3)
    sw.install(token=0x77, nworkers=2, groups=4, ips=[w.addr[0] for w in ws])
    forged = wire.header(type=T["REGISTER"], token=0x77, worker=0, nworkers=2)
    assert sw.handle(forged, ("10.0.0.9", 5000)) == []  # worker 0 claimed from another host
    assert sw.counters()["foreign"] == 1
    simulate(sw, ws, np.random.default_rng(0))
    assert sw.handle(forged, ("10.0.0.9", 5000)) == []
    assert sw.handle(forged, ("10.0.0.1", 5999)) == []  # its host, another port: pinned
    assert sw.counters()["foreign"] == 3
    for w in ws:
        assert np.array_equal(w.result()[:ref.size].astype(np.int64), ref), f"rank {w.rank}"
    with pytest.raises(RuntimeError, match="1 worker addresses for 2 workers"):
        sw.install(token=0x78, nworkers=2, groups=1, ips=["10.0.0.1"])


def test_a_group_left_mid_round_is_reclaimed():
    """A slot group whose round never completes (a worker died mid-round) holds its group:
    another tensor's round 0 waits ("busy") until nothing touched the group for `abandon`
    seconds, then binds it and sums exactly; a live round is never taken."""
    sw = _C.SwitchPipeline(auto_groups=1, abandon=10.0)  # one group: every slot maps to it
    x = np.arange(64, dtype=np.int32)
    dead = [SimWorker(r, 2, 0x77, x, 64, 1, 1, FIX, tensor=5) for r in range(2)]
    register(sw, dead)
    assert sw.handle(dead[0].data(0), dead[0].addr, 0.0) == []  # worker 1 never sends
    ws = [SimWorker(r, 2, 0x77, x * (r + 1), 64, 1, 1, FIX, tensor=6) for r in range(2)]
    assert sw.handle(ws[0].data(0), ws[0].addr, 5.0) == []
    # a retransmission: alive, and held (it waits for worker 1)
    assert [wire.parse(b)["type"] for _, b in sw.handle(dead[0].data(0), dead[0].addr, 9.0)] \
        == [T["HELD"]]
    assert sw.handle(ws[0].data(0), ws[0].addr, 18.0) == []
    assert sw.counters()["busy"] == 2 and sw.counters()["abandoned"] == 0
    assert sw.handle(ws[0].data(0), ws[0].addr, 19.5) == []  # 10.5 s untouched: taken
    out = sw.handle(ws[1].data(0), ws[1].addr, 19.6)
    assert sw.counters()["abandoned"] == 1
    assert [a for a, _ in out] == [w.addr for w in ws]
    for w in ws:
        w.on_result(wire.parse(out[0][1]))
        assert np.array_equal(w.result()[:64], x * 3)
