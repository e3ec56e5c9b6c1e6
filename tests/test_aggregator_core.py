"""The aggregator's protocol core (csrc/omni/aggregator/core.cpp) driven packet by packet, with
no socket and no process: ``_C.AggregatorCore.handle(packet, sender)`` returns what it would
send. Workers are simulated here, independently of the C++ worker engine, from the protocol
as docs/PROTOCOL.md describes it; a scheduler delivers their packets in random order and
loses, duplicates or adds junk to them. Results are compared with the float64 sum rounded once.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_aggregator import KINDS, junk_packets
from test_aggregator import Job as FuzzJob

from hvd_sparse import _C, protocol, wire

T, INF = protocol.TYPES, protocol.INF
NP_DTYPE = {protocol.DTYPES[name][0]: np.dtype(name) for name in ("float32", "float64", "float16")}


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
            core.handle(junk.pop(), ("10.0.0.250", 6000), 0.0)
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
    """The fuzz cases of test_aggregator.py (malformed, truncated and foreign-job packets),
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
