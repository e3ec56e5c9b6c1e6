"""The aggregator's protocol core (csrc/omni/aggregator/core.cpp) driven packet by packet, with
no socket and no process: ``_C.AggregatorCore.handle(packet, sender)`` returns what it would
send. Workers are simulated here, independently of the C++ worker engine, from the protocol
as docs/PROTOCOL.md describes it; a scheduler delivers their packets in random order and
loses, duplicates or adds junk to them. Results are compared with the float64 sum rounded once.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from aggregator_helpers import KINDS, junk_packets
from aggregator_helpers import Job as FuzzJob

from hvd_sparse import _C, fixedpoint, protocol
from hvd_sparse.tools import wire

T, INF = protocol.TYPES, protocol.INF
NP_DTYPE = {protocol.DTYPES[name][0]: np.dtype(name) for name in ("float32", "float64", "float16")}
NP_DTYPE[protocol.FIXED32] = np.dtype(np.int32)
I32 = np.iinfo(np.int32)


class SimWorker:
    """One worker of one tensor: streams its non-zero blocks slot by slot, round by round."""

    def __init__(self, rank: int, n: int, token: int, x: np.ndarray, bs: int, lanes: int,
                 nslots: int, dtype: int, tensor: int = 77) -> None:
        self.rank, self.addr = rank, (f"10.0.0.{rank + 1}", 5000 + rank)
        self.bs, self.lanes, self.nslots, self.dtype, self.tensor = bs, lanes, nslots, dtype, tensor
        self.nblocks = -(-x.size // bs)
        padded = np.zeros(self.nblocks * bs, x.dtype)
        padded[:x.size] = x
        self.blocks = padded.reshape(self.nblocks, bs)
        self.nonzero = set(np.flatnonzero(self.blocks.any(axis=1)).tolist())
        self.out = np.zeros_like(self.blocks)
        self.base = {"token": token, "worker": rank, "nworkers": n, "dtype": dtype,
                     "tensor": tensor, "block_size": bs, "nblocks": self.nblocks,
                     "nslots": nslots, "meta": 9}
        self.round = [0] * nslots
        self.cur = [[0 if self.length(s, lane) else INF for lane in range(lanes)]
                    for s in range(nslots)]
        self.done = [False] * nslots

    def length(self, slot: int, lane: int) -> int:
        return protocol.stream_length(slot, lane, self.nblocks, self.nslots, self.lanes)

    def block(self, slot: int, lane: int, pos: int) -> int:
        return protocol.stream_block(slot, lane, pos, self.nslots, self.lanes)

    def data(self, slot: int) -> bytes:
        """DATA of the slot's current round: blocks held at the lanes' positions, and the next
        position each lane holds a non-zero block at."""
        table, carried = [], {}
        for lane in range(self.lanes):
            off = self.cur[slot][lane]
            nxt = INF
            if off != INF:
                if self.block(slot, lane, off) in self.nonzero:
                    carried[lane] = self.blocks[self.block(slot, lane, off)].tobytes()
                nxt = next((p for p in range(off + 1, self.length(slot, lane))
                            if self.block(slot, lane, p) in self.nonzero), INF)
            table.append((off, nxt))
        return wire.data(table, carried, slot=slot, round=self.round[slot],
                         flags=self.round[slot] & 1, **self.base)

    def on_result(self, p: dict) -> bytes | None:
        """Applies a RESULT of the round in progress; returns the next DATA, if any."""
        s = p["slot"]
        if p["type"] != T["RESULT"] or self.done[s] or p["round"] != self.round[s]:
            return None  # a duplicate or stale result
        carried = [lane for lane in range(self.lanes) if p["bitmap"] >> lane & 1]
        dt = NP_DTYPE[self.dtype]
        for lane, raw in zip(carried, p["blocks"], strict=True):
            self.out[self.block(s, lane, p["lane_table"][lane][0])] = np.frombuffer(raw, dt)
        if p["flags"] & protocol.FLAGS["OWN"]:  # lanes left out that were this worker's alone
            for lane, (off, _) in enumerate(p["lane_table"]):
                if (off != INF and not p["bitmap"] >> lane & 1
                        and (b := self.block(s, lane, off)) in self.nonzero):
                    self.out[b] = self.blocks[b]
        self.cur[s] = [nxt for _, nxt in p["lane_table"]]
        self.round[s] += 1
        if p["flags"] & protocol.FLAGS["LAST"]:
            self.done[s] = True
            return None
        return self.data(s)

    def result(self) -> np.ndarray:
        return self.out.reshape(-1)


def simulate(core, workers: list[SimWorker], rng: np.random.Generator, *, drop: float = 0,
             dup: float = 0, junk: list[bytes] = (), max_steps: int = 200_000) -> None:
    """Runs the job to the end: packets in flight are delivered in random order, some lost or
    duplicated; when nothing is in flight, every worker resends its unfinished slots' DATA
    (its retransmission timers fire)."""
    by_addr = {w.addr: w for w in workers}
    flight: list[tuple[str, tuple, bytes]] = []  # (to "core" or "worker", address, bytes)
    for w in workers:
        reply = core.handle(wire.header(type=T["REGISTER"], **{k: w.base[k] for k in (
            "token", "worker", "nworkers")}), w.addr, 0.0)
        assert [wire.parse(b)["type"] for _, b in reply] == [T["REGACK"]]
        flight += [("core", w.addr, w.data(s)) for s in range(w.nslots)]
    junk = list(junk)
    for _ in range(max_steps):
        if all(all(w.done) for w in workers):
            return
        if junk and rng.random() < 0.3:
            # from elsewhere or spoofing a worker's address: malformed either way
            core.handle(junk.pop(), workers[len(junk) % len(workers)].addr
                        if len(junk) % 2 else ("10.0.0.250", 6000), 0.0)
            continue
        if not flight:
            flight = [("core", w.addr, w.data(s)) for w in workers for s in range(w.nslots)
                      if not w.done[s]]
            continue
        to, addr, pkt = flight.pop(int(rng.integers(len(flight))))
        if rng.random() < drop:
            continue
        if rng.random() < dup:
            flight.append((to, addr, pkt))
        if to == "core":
            flight += [("worker", a, b) for a, b in core.handle(pkt, addr, 0.0)]
        else:
            nxt = by_addr[addr].on_result(wire.parse(pkt))
            if nxt is not None:
                flight.append(("core", addr, nxt))
    raise AssertionError("the job did not finish")


def job(n: int, numel: int, bs: int, lanes: int, nslots: int, dtype: int, density: float,
        seed: int, token: int = 0x77):
    rng = np.random.default_rng(seed)
    xs = []
    for _ in range(n):
        nb = -(-numel // bs)
        keep = np.repeat(rng.random(nb) < density, bs)[:numel]
        x = (rng.standard_normal(numel) * keep).astype(NP_DTYPE[dtype])
        xs.append(x)
    ws = [SimWorker(r, n, token, xs[r], bs, lanes, nslots, dtype) for r in range(n)]
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0).astype(NP_DTYPE[dtype])
    return ws, ref


def assert_exact(ws: list[SimWorker], ref: np.ndarray, what: str) -> None:
    for w in ws:
        got = w.result()[:ref.size]
        if w.dtype == 1:  # float64: the arrival order changes the last bits only
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12, err_msg=what)
        else:
            assert got.tobytes() == ref.tobytes(), f"{what}: rank {w.rank} differs from the " \
                "float64 sum rounded once"


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("dtype", [0, 1, 2], ids=["float32", "float64", "float16"])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
def test_sum_matches_float64_reference(n, dtype, density):
    ws, ref = job(n, numel=16 * 90 + 5, bs=16, lanes=4, nslots=5, dtype=dtype, density=density,
                  seed=n * 100 + dtype)
    core = _C.AggregatorCore()
    simulate(core, ws, np.random.default_rng(1))
    assert_exact(ws, ref, f"n={n} dtype={dtype} density={density}")
    c = core.counters()
    assert c["malformed"] == c["mismatch"] == c["retransmits"] == 0, c
    # Rounds: one per position some worker holds, per slot (zero blocks are skipped).
    assert c["rounds"] <= sum(w.length(s, 0) for w in ws[:1] for s in range(w.nslots)) + 5


@pytest.mark.parametrize("drop,dup", [(0.05, 0), (0.3, 0), (0, 0.3), (0.2, 0.2)])
def test_loss_and_duplication_give_identical_results(drop, dup):
    ws, ref = job(4, numel=32 * 200, bs=32, lanes=8, nslots=6, dtype=0, density=0.3, seed=5)
    core = _C.AggregatorCore()
    simulate(core, ws, np.random.default_rng(7), drop=drop, dup=dup)
    assert_exact(ws, ref, f"drop={drop} dup={dup}")
    c = core.counters()
    assert c["malformed"] == 0, c
    # Lost RESULTs come back from the shadow copy; repeated DATA of a round is ignored.
    assert c["retransmits"] + c["duplicates"] + c["stale"] > 0, c


def test_junk_while_a_job_runs_changes_nothing():
    """The fuzz cases of test_aggregator_junk.py (malformed, truncated and foreign-job packets),
    fired at the core between the packets of a live job: its result stays exact and every
    malformed or foreign packet is counted."""
    n, bs = FuzzJob.n, FuzzJob.bs
    ws, ref = job(n, numel=FuzzJob.numel, bs=bs, lanes=FuzzJob.lanes, nslots=FuzzJob.nslots,
                  dtype=0, density=0.2, seed=3, token=FuzzJob.token)
    tensor = ws[0].tensor
    rng = np.random.default_rng(11)
    built = [junk_packets(kind, 1000 + i, tensor, rng.bytes(int(rng.integers(0, 300))))
             for i, kind in enumerate(KINDS * 4)]
    core = _C.AggregatorCore()
    simulate(core, ws, rng, junk=[p for _, p in built])
    assert_exact(ws, ref, "under junk")
    c = core.counters()
    want = {x: sum(1 for e, _ in built if e == x) for x in ("malformed", "unknown", "fuzzy")}
    assert c["unknown_job"] == want["unknown"], (c, want)
    assert want["malformed"] <= c["malformed"] <= want["malformed"] + want["fuzzy"], (c, want)
    assert c["mismatch"] == 0 and c["tensors"] == 1, c


def test_regack_carries_no_slot_geometry():
    """A software aggregator's REGACK: no slot groups, no per-slot cap (nslots, block_size and
    lanes 0; docs/PROTOCOL.md "Jobs")."""
    reply = _C.AggregatorCore().handle(wire.header(type=T["REGISTER"], token=5, worker=0,
                                                   nworkers=1), ("10.0.0.1", 5000), 0.0)
    p = wire.parse(reply[0][1])
    assert (p["type"], p["nslots"], p["block_size"], p["lanes"]) == (T["REGACK"], 0, 0, 0)


def test_mismatched_workers_get_an_error():
    ws, _ = job(2, numel=64 * 10, bs=64, lanes=2, nslots=3, dtype=0, density=1.0, seed=2)
    other = SimWorker(1, 2, 0x77, np.ones(64 * 11, np.float32), 64, 2, 3, 0)  # one more block
    core = _C.AggregatorCore()
    for w in (ws[0], other):
        core.handle(wire.header(type=T["REGISTER"], token=0x77, worker=w.rank, nworkers=2),
                    w.addr, 0.0)
    assert core.handle(ws[0].data(0), ws[0].addr, 0.0) == []
    replies = core.handle(other.data(0), other.addr, 0.0)
    errors = [(a, wire.parse(b)) for a, b in replies]
    assert sorted(a for a, _ in errors) == sorted([ws[0].addr, other.addr])
    assert all(p["type"] == T["ERROR"] and p["round"] == protocol.ERRORS["MISMATCH"]
               for _, p in errors)
    assert core.counters()["mismatch"] == 1


def test_lanes_one_worker_alone_carried_are_left_out_of_its_copy():
    """A lane one worker alone carried is left out of that worker's copy of the RESULT, flagged
    OWN (also when resent); the other worker gets it summed in float64 (-0 turned +0), and a
    lane both carried goes to both; every worker ends with the exact sums."""
    core = _C.AggregatorCore()
    x0 = np.array([-0.0, 1.5, -2.0, 3.0, 0.25, -0.5, 7.0, 1.0], np.float32)  # blocks 0, 1
    x1 = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.float32)  # block 1
    ws = [SimWorker(r, 2, 0x77, x, 4, 2, 1, 0, 77) for r, x in enumerate((x0, x1))]  # 2 lanes
    for w in ws:
        core.handle(wire.header(type=T["REGISTER"], token=0x77, worker=w.rank, nworkers=2),
                    w.addr, 0.0)
    first = [w.data(0) for w in ws]
    assert core.handle(first[0], ws[0].addr, 0.0) == []
    sent = dict(core.handle(first[1], ws[1].addr, 0.0))
    own, full = wire.parse(sent[ws[0].addr]), wire.parse(sent[ws[1].addr])
    assert own["flags"] & protocol.FLAGS["OWN"] and own["bitmap"] == 0b10, own
    assert own["blocks"] == [(x0[4:] + x1[4:]).tobytes()]
    assert len(sent[ws[0].addr]) == protocol.HEADER_BYTES + protocol.BITMAP_BYTES \
        + 2 * protocol.LANE_BYTES + 4 * 4
    assert not full["flags"] & protocol.FLAGS["OWN"] and full["bitmap"] == 0b11
    assert full["blocks"][0] == np.array([0.0, 1.5, -2.0, 3.0], np.float32).tobytes()  # +0
    assert core.handle(first[0], ws[0].addr, 0.0) == [(ws[0].addr, sent[ws[0].addr])]
    for w, p in zip(ws, (own, full), strict=True):
        assert w.on_result(p) is None  # the one round: done
        assert np.array_equal(w.result(), x0 + x1)
    assert core.counters()["own_results"] == 1


def test_resent_data_of_a_waiting_round_is_held():
    """A DATA its sender already sent this round (its timer fired while the round waits for a
    peer) adds nothing. Once the round has waited HELD_AFTER it is answered HELD, the header
    alone, to that sender only: the slot, tensor and round, and the lowest worker the round
    waits for; sooner, nothing. The round then completes with each worker's blocks added
    once."""
    core = _C.AggregatorCore()
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(32).astype(np.float32) for _ in range(4)]
    ws = [SimWorker(r, 4, 0x77, x, 8, 4, 1, 0, 78) for r, x in enumerate(xs)]  # one round
    for w in ws:
        core.handle(wire.header(type=T["REGISTER"], token=0x77, worker=w.rank, nworkers=4),
                    w.addr, 0.0)
    first = [w.data(0) for w in ws]
    for r in (0, 2):
        assert core.handle(first[r], ws[r].addr, 0.0) == []
    assert core.handle(first[0], ws[0].addr, protocol.HELD_AFTER * 0.9) == []  # a busy peer
    late = protocol.HELD_AFTER * 1.1
    for r, waits_for in ((0, 1), (2, 1)):
        [(to, raw)] = core.handle(first[r], ws[r].addr, late)
        held = wire.parse(raw)
        assert to == ws[r].addr and len(raw) == protocol.HEADER_BYTES
        assert (held["type"], held["token"], held["tensor"], held["slot"], held["round"],
                held["worker"], held["nworkers"]) == (T["HELD"], 0x77, 78, 0, 0, waits_for, 4)
    assert core.handle(first[1], ws[1].addr, late) == []
    [(_, raw)] = core.handle(first[0], ws[0].addr, late)
    assert wire.parse(raw)["worker"] == 3  # workers 0-2 are in: it waits for worker 3
    sent = core.handle(first[3], ws[3].addr, late)
    assert sorted(a for a, _ in sent) == sorted(w.addr for w in ws)
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0).astype(np.float32)
    for a, raw in sent:
        w = next(w for w in ws if w.addr == a)
        assert w.on_result(wire.parse(raw)) is None
        assert np.array_equal(w.result(), ref), f"rank {w.rank}"
    assert core.counters()["duplicates"] == 4


@pytest.mark.parametrize("cap", ["max_job_bytes", "max_tensors"])
def test_a_job_over_its_share_fails_alone(cap):
    """One job's tensors beyond its share (memory, or tensors in flight) fail with ERROR
    CAPACITY; another job on the same aggregator still gets its share (the memory of all jobs
    would have held the greedy one's third tensor)."""
    slot = 4 * 8  # one lane of 4 values, summed in float64
    core = _C.AggregatorCore(max_slot_bytes=4 * slot,
                             **{cap: 2 * slot if cap == "max_job_bytes" else 2})
    greedy, other = 0xA, 0xB
    for token in (greedy, other):
        core.handle(wire.header(type=T["REGISTER"], token=token, worker=0, nworkers=1),
                    ("10.0.0.1", 5000 + token), 0.0)

    def first_round(token: int, tensor: int) -> dict:
        """Round 0 of a two-block stream: the slot stays open (and holds memory) after it."""
        p = wire.data([(0, 1)], {0: np.arange(4, dtype=np.float32).tobytes()}, token=token,
                      worker=0, nworkers=1, dtype=0, tensor=tensor, block_size=4, nblocks=2,
                      nslots=1, meta=1, round=0)
        (_, reply), = core.handle(p, ("10.0.0.1", 5000 + token), 0.0)
        return wire.parse(reply)
    for tensor in (1, 2):
        assert first_round(greedy, tensor)["type"] == T["RESULT"]
    refused = first_round(greedy, 3)
    assert (refused["type"], refused["round"]) == (T["ERROR"], protocol.ERRORS["CAPACITY"])
    for tensor in (1, 2):
        r = first_round(other, tensor)
        assert r["type"] == T["RESULT"]
        assert np.frombuffer(r["blocks"][0], np.float32).tolist() == [0, 1, 2, 3]


def test_idle_tensors_and_jobs_expire():
    ws, _ = job(2, numel=64 * 10, bs=64, lanes=2, nslots=3, dtype=0, density=1.0, seed=2)
    core = _C.AggregatorCore(idle=5.0)
    for w in ws:
        core.handle(wire.header(type=T["REGISTER"], token=0x77, worker=w.rank, nworkers=2),
                    w.addr, 100.0)
    core.handle(ws[0].data(0), ws[0].addr, 100.0)  # rank 1 never comes
    core.expire(104.0)
    assert core.counters()["expired"] == 0 and core.active_jobs() == 1
    core.expire(106.0)
    assert core.counters()["expired"] == 1 and core.active_jobs() == 0


# ------------------------------------------------------------------------------------------
# Fixed point (docs/PROTOCOL.md, "Fixed point")
# ------------------------------------------------------------------------------------------

def fixed_job(n: int, numel: int, bs: int, density: float, seed: int) -> list[SimWorker]:
    """Workers holding int32 values whose sums span the whole int32 range, both ends included."""
    rng = np.random.default_rng(seed)
    nb = -(-numel // bs)
    xs = []
    for _ in range(n):
        keep = np.repeat(rng.random(nb) < density, bs)[:numel]
        m = I32.max // n  # n values in [-m, m] cannot sum outside the int32 range
        xs.append((rng.integers(-m, m + 1, numel) * keep).astype(np.int32))
    # Sums at exactly INT32_MAX and INT32_MIN (block 0 is then non-zero on every rank).
    for i, total in ((0, I32.max), (1, I32.min)):
        for x in xs:
            x[i] = total // n
        xs[0][i] += total - n * (total // n)
    return [SimWorker(r, n, 0x77, xs[r], bs, 4, 5, protocol.FIXED32) for r in range(n)]


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
def test_fixed32_sums_are_exact(n, density):
    ws = fixed_job(n, numel=16 * 90 + 5, bs=16, density=density, seed=n)
    ref = np.sum([w.blocks.reshape(-1).astype(np.int64) for w in ws], axis=0)
    assert ref[0] == I32.max and ref[1] == I32.min  # the edges are reached, not passed
    core = _C.AggregatorCore()
    simulate(core, ws, np.random.default_rng(n), drop=0.1, dup=0.1)
    for w in ws:
        np.testing.assert_array_equal(w.result().astype(np.int64), ref, f"rank {w.rank}")
    c = core.counters()
    assert c["overflow"] == c["mismatch"] == c["malformed"] == 0, c


def test_fixed32_overflow_errors_every_worker_and_never_wraps():
    """Block 7 sums to 2^31 (INT32_MAX + 1): its slot gets ERROR OVERFLOW to every worker,
    again on every retransmission; no RESULT ever carries a value unequal to the exact sum."""
    n, bs, nslots = 4, 8, 3
    rng = np.random.default_rng(4)
    xs = [rng.integers(-1000, 1000, bs * 30).astype(np.int32) for _ in range(n)]
    for x in xs:
        x[7 * bs + 3] = 2**29  # 4 x 2^29 = 2^31
    ws = [SimWorker(r, n, 0x77, xs[r], bs, 2, nslots, protocol.FIXED32) for r in range(n)]
    ref = np.sum([x.astype(np.int64) for x in xs], axis=0).reshape(-1, bs)
    core = _C.AggregatorCore()
    for w in ws:
        core.handle(wire.header(type=T["REGISTER"], token=0x77, worker=w.rank, nworkers=n),
                    w.addr, 0.0)
    flight = [(w.addr, w.data(s)) for w in ws for s in range(nslots)]
    errors, results = [], 0
    bad_slot = next(s for s in range(nslots) for lane in range(2) for pos in range(30)
                    if ws[0].block(s, lane, pos) == 7)
    for step in range(10_000):
        if not flight:
            break
        addr, pkt = flight.pop(0)
        for to, raw in core.handle(pkt, addr, 0.0):
            p = wire.parse(raw)
            if p["type"] == T["ERROR"]:
                errors.append((to, p))
                continue
            assert p["type"] == T["RESULT"] and p["dtype"] == protocol.FIXED32
            results += 1
            w = next(w for w in ws if w.addr == to)
            carried = [lane for lane in range(w.lanes) if p["bitmap"] >> lane & 1]
            for lane, raw_block in zip(carried, p["blocks"], strict=True):
                b = w.block(p["slot"], lane, p["lane_table"][lane][0])
                assert b != 7, "the overflowing block was returned"
                np.testing.assert_array_equal(np.frombuffer(raw_block, "<i4"), ref[b])
            nxt = w.on_result(p)
            if nxt is not None:
                flight.append((to, nxt))
        if step == 200:  # every worker resends its stuck slot: the ERROR comes again
            flight += [(w.addr, w.data(bad_slot)) for w in ws]
    assert results > 0  # the other slots completed exactly
    first = errors[:n]
    assert sorted(a for a, _ in first) == sorted(w.addr for w in ws)
    assert all(p["round"] == protocol.ERRORS["OVERFLOW"] and p["tensor"] == ws[0].tensor
               for _, p in errors)
    assert len(errors) > n  # retransmissions of the failed tensor are answered with ERROR too
    c = core.counters()
    assert c["overflow"] == 1 and c["mismatch"] == 0, c
    assert not any(w.done[bad_slot] for w in ws)


@pytest.mark.parametrize("max_abs,n,e", [
    (1.0, 1, 30),            # 2^30 <= 2^31 - 1 < 2^31
    (1.0, 4, 28),
    (3.0, 4, 27),            # 12 * 2^27 = 1.5 * 2^30 <= 2^31 - 1 < 12 * 2^28
    (2.0**31 - 1, 1, 0),     # equality is allowed
    (2.0**31, 1, -1),
    (0.75, 1024, 21),        # 768 * 2^21 = 1.5 * 2^30
    (2.0**-20, 2, 49),       # 2^-19 * 2^49 = 2^30
    (0.0, 4, 0),
])
def test_exponent_hand_computed(max_abs, n, e):
    assert fixedpoint.exponent(max_abs, n) == e
    want = 0.0 if max_abs == 0 else n * 2.0 ** -(e + 1)
    assert fixedpoint.error_bound(max_abs, n) == want


def test_exponent_is_the_largest_that_fits():
    rng = np.random.default_rng(0)
    cases = [(float(m), int(n)) for m, n in zip(
        np.exp(rng.uniform(-700, 700, 2000)), rng.integers(1, 1025, 2000), strict=True)]
    cases += [(5e-324, 1), (1.7976931348623157e308, 1024), (float(np.finfo(np.float32).max), 7),
              (float(np.finfo(np.float32).tiny), 3), (65504.0, 4), (1.0 + 2**-52, 3)]
    for m, n in cases:
        e = fixedpoint.exponent(m, n)
        two = Fraction(2)
        assert Fraction(m) * n * two**e <= 2**31 - 1 < Fraction(m) * n * two**(e + 1), (m, n, e)
        assert fixedpoint.error_bound(m, n) == math.ldexp(n, -(e + 1))
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError):
            fixedpoint.exponent(bad, 4)


@pytest.mark.parametrize("env,want", [("1", True), ("true", True), ("0", False), ("off", False),
                                      (None, False)])
def test_fixed_point_option_from_env(monkeypatch, env, want):
    from hvd_sparse.config import from_env_and_kwargs
    if env is None:
        monkeypatch.delenv("HVD_SPARSE_FIXED_POINT", raising=False)
    else:
        monkeypatch.setenv("HVD_SPARSE_FIXED_POINT", env)
    assert from_env_and_kwargs().fixed_point is want
    monkeypatch.setenv("HVD_SPARSE_FIXED_POINT", "maybe")
    with pytest.raises(ValueError):
        from_env_and_kwargs()
