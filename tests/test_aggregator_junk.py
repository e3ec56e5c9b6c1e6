"""Malformed and foreign packets while a job runs (hypothesis-fuzzed: the result stays exact and
the aggregator's counters move as each packet's kind says), a malformed packet cannot redirect
results, and tensors whose ranks disagree fail every worker."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch
from aggregator_helpers import (
    HOST,
    INF,
    KINDS,
    WAIT,
    T,
    assert_result,
    block_sparse,
    junk_packets,
    reduce_under_junk,
    reference,
    sync,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_sparse import _C, protocol
from hvd_sparse.tools import wire


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(junk=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2 ** 20),
                               st.binary(min_size=0, max_size=300)), min_size=1, max_size=40))
def test_fuzz_malformed_and_foreign_packets_during_a_job(fuzz_job, junk):
    counter = fuzz_job[3]
    counter[0] += 1
    tensor = 1000 + counter[0]
    built = [junk_packets(kind, seed + 7919 * i, tensor, raw)
             for i, (kind, seed, raw) in enumerate(junk)]
    d = reduce_under_junk(fuzz_job, tensor, counter[0], [p for _, p in built], "fuzz")
    want = {x: sum(1 for e, _ in built if e == x) for x in ("malformed", "unknown", "fuzzy")}
    kinds = sorted({k for k, _, _ in junk})
    assert d["unknown_job"] == want["unknown"], (d, want, kinds)
    assert want["malformed"] <= d["malformed"] <= want["malformed"] + want["fuzzy"], (
        d, want, kinds)
    # the rest is well-formed but from an address no worker registered from, or stale
    assert (d["malformed"] + d["foreign"] + d["stale"] + d["duplicates"]
            >= want["malformed"] + want["fuzzy"]), (d, want, kinds)
    assert d["mismatch"] == 0 and d["jobs"] == 0, (d, kinds)
    assert d["tensors"] == 1, f"malformed packets created tensor state: {d} {kinds}"


def hand_workers(agg, token: int) -> list[socket.socket]:
    """Three sockets on this host: workers 0 and 1 of a 2-worker job, registered with
    ``agg``, and a third (the forger's)."""
    w = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    for s in w:
        s.bind((HOST, 0))
        s.settimeout(5)
    for r in range(2):
        w[r].sendto(wire.header(type=T["REGISTER"], token=token, worker=r, nworkers=2),
                    agg.addr)
        assert wire.parse(w[r].recv(100))["type"] == T["REGACK"]
    return w


def test_malformed_packet_cannot_redirect_results(aggs):
    """Python workers speak the protocol by hand: the RESULT is the sum, sent to the workers'
    own addresses; a malformed DATA carrying the job token and a worker id (here for the
    round in progress) changes nothing, so the RESULT still goes to that worker, not to the
    sender of the junk."""
    agg = aggs(2)
    token = 0xC0FFEE
    w = hand_workers(agg, token)
    try:
        vals = [np.arange(4, dtype=np.float32) + 1, np.full(4, 0.5, dtype=np.float32)]
        geom = {"token": token, "nworkers": 2, "tensor": 9, "slot": 0, "round": 0,
                "block_size": 4, "nblocks": 1, "nslots": 1, "meta": 1, "dtype": 0}
        w[1].sendto(wire.data([(0, INF)], {0: vals[1].tobytes()}, **geom, worker=1), agg.addr)
        # the attacker holds the token: malformed DATA (bad lane table) as worker 1
        w[2].sendto(wire.data([(3, 1)], {0: vals[1].tobytes()}, **geom, worker=1), agg.addr)
        sync(w[2], agg)
        w[0].sendto(wire.data([(0, INF)], {0: vals[0].tobytes()}, **geom, worker=0), agg.addr)
        for r in range(2):
            res = wire.parse(w[r].recv(1000))
            assert res["type"] == T["RESULT"] and res["round"] == 0 and res["present"] == 1
            assert res["flags"] & protocol.FLAGS["LAST"]
            assert res["lane_table"] == [(0, INF)] and res["bitmap"] == 1
            np.testing.assert_array_equal(np.frombuffer(res["blocks"][0], np.float32),
                                          vals[0] + vals[1])
        w[2].settimeout(0.3)
        with pytest.raises(TimeoutError):
            w[2].recv(1000)
        # a lost RESULT: the retransmitted DATA of round 0 gets the stored copy back
        w[1].sendto(wire.data([(0, INF)], {0: vals[1].tobytes()}, **geom, worker=1), agg.addr)
        again = wire.parse(w[1].recv(1000))
        assert again["type"] == T["RESULT"] and again["round"] == 0
        for r in range(2):
            w[r].sendto(wire.header(type=T["RELEASE"], token=token, worker=r, nworkers=2,
                                    tensor=9), agg.addr)
        sync(w[2], agg)
        s = agg.stats()
        # the junk, a DATA in worker 1's name, came from elsewhere: dropped
        assert s["released"] == 1 and s["retransmits"] == 1, s
        assert s["foreign"] == 1 and s["malformed"] + s["duplicates"] == 0, s
        assert s["tensors"] == 1, s
    finally:
        for s in w:
            s.close()


def test_tensor_mismatch_fails_every_worker(aggs, make_workers):
    ws = make_workers([aggs(3)], 3, timeout=20)
    rng = np.random.default_rng(0)
    for tid, variant in ((1, "numel"), (2, "meta"), (3, "dtype")):
        ins = [block_sparse(rng, 64 * 100 + 3, 64, 0.5, torch.float32) for _ in range(3)]
        meta = [7, 7, 7]
        if variant == "numel":
            ins[2] = block_sparse(rng, 64 * 130, 64, 0.5, torch.float32)
        elif variant == "meta":
            meta[1] = 8
        else:
            ins[0] = ins[0].double()
        outs = [x.clone() for x in ins]
        t0 = time.monotonic()
        tickets = [w.submit(tid, ins[r], outs[r], 64, meta[r], None, f"m{tid}", 1.0)
                   for r, w in enumerate(ws)]
        for r, w in enumerate(ws):
            assert w.wait(tickets[r], WAIT)
            with pytest.raises(RuntimeError, match="mismatch"):
                w.finish(tickets[r])
        assert time.monotonic() - t0 < 15, "a mismatch is reported, not timed out"


def test_tensor_mismatch_on_tensor_id_zero(aggs, make_workers):
    ws = make_workers([aggs(2)], 2, timeout=1.5)
    ins = [torch.ones(64), torch.ones(128)]  # one slot each; block counts differ
    tickets = [w.submit(0, ins[r], ins[r].clone(), 64, 7, None, "zero", 1.0)
               for r, w in enumerate(ws)]
    for r, w in enumerate(ws):
        assert w.wait(tickets[r], WAIT)
        with pytest.raises(RuntimeError, match="mismatch"):
            w.finish(tickets[r])


def test_register_cannot_move_a_worker_nor_bye_end_its_job(aggs):
    """A worker's address is pinned at its REGISTER: a REGISTER, BYE or RELEASE in its name
    from another address gets no answer and changes nothing; the job still sums, and the
    RESULT goes to the registered addresses."""
    agg = aggs(2)
    token = 0xB0B
    w = hand_workers(agg, token)
    try:
        forged = [wire.header(type=T["REGISTER"], token=token, worker=0, nworkers=2)]
        forged += [wire.header(type=T[t], token=token, worker=r, nworkers=2, tensor=9)
                   for t in ("RELEASE", "BYE") for r in range(2)]
        for p in forged:
            w[2].sendto(p, agg.addr)
        sync(w[2], agg)
        w[2].settimeout(0.3)
        with pytest.raises(TimeoutError):  # no REGACK for the forger
            while True:
                assert wire.parse(w[2].recv(1000))["token"] != token
        vals = [np.full(4, 1.5, dtype=np.float32), np.full(4, 0.25, dtype=np.float32)]
        geom = {"token": token, "nworkers": 2, "tensor": 9, "slot": 0, "round": 0,
                "block_size": 4, "nblocks": 1, "nslots": 1, "meta": 1, "dtype": 0}
        for r in range(2):
            w[r].sendto(wire.data([(0, INF)], {0: vals[r].tobytes()}, **geom, worker=r),
                        agg.addr)
        for r in range(2):
            res = wire.parse(w[r].recv(1000))
            assert res["type"] == T["RESULT"], res
            np.testing.assert_array_equal(np.frombuffer(res["blocks"][0], np.float32),
                                          vals[0] + vals[1])
        s = agg.stats()
        assert s["foreign"] == len(forged) and s["jobs"] == 1 and s["released"] == 0, s
    finally:
        for s in w:
            s.close()


def test_worker_takes_results_and_errors_only_from_its_aggregator(aggs, make_workers):
    """While worker 0 waits for its peer, a forger sends it an ERROR and a RESULT of the
    tensor in flight (the right token, tensor, slot, round and layout): both are dropped and
    counted, and the reduction ends with the true sum."""
    import psutil
    agg = aggs(2)
    forger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    forger.bind((HOST, 0))
    try:
        before = {c.laddr.port for c in psutil.Process().net_connections("udp4")}
        ws = make_workers([agg], 2, token=0xF0F)
        ports = {c.laddr.port for c in psutil.Process().net_connections("udp4")} - before
        rng = np.random.default_rng(4)
        xs = [block_sparse(rng, 4096, 256, 0.5, torch.float32, force=(0,)) for _ in range(2)]
        outs = [torch.zeros_like(x) for x in xs]
        # a first reduction tells the layout (lanes, slots) that forged packets must match
        t0 = [ws[r].submit(1, xs[r], outs[r], 256, 7, None, "probe", 1.0) for r in range(2)]
        for r in range(2):
            assert ws[r].wait(t0[r], WAIT)
        lay = ws[0].finish(t0[0])
        ws[1].finish(t0[1])
        ticket = ws[0].submit(2, xs[0], outs[0], 256, 7, None, "forged", 1.0)
        base = {"token": 0xF0F, "nworkers": 2, "worker": 0, "tensor": 2,
                "slot": 0, "round": 0, "block_size": 256, "nblocks": 16,
                "nslots": lay["nslots"], "meta": 7, "dtype": 0}
        lanes = [(0, INF)] + [(0, INF)] * (lay["lanes"] - 1)
        for port in ports:  # the workers' sockets (one of them is worker 0's)
            forger.sendto(wire.header(**{**base, "type": T["ERROR"], "round": 1}),
                          (HOST, port))
            forger.sendto(wire.data(lanes, {0: bytes(1024)}, **{**base, "type": T["RESULT"],
                          "flags": protocol.FLAGS["LAST"]}), (HOST, port))
        time.sleep(0.3)
        t1 = ws[1].submit(2, xs[1], outs[1], 256, 7, None, "forged", 1.0)
        assert ws[0].wait(ticket, WAIT) and ws[1].wait(t1, WAIT)
        ws[0].finish(ticket)
        ws[1].finish(t1)
        for r in range(2):
            assert_result(outs[r], reference(xs), f"rank {r}")
        assert ws[0].stats()["foreign"] >= 2, ws[0].stats()
    finally:
        forger.close()


def test_worker_drops_every_malformed_result_from_its_aggregator():
    """The worker engine's packet parser, from the one address it trusts: every single-byte
    change of the header fields it judges, of the bitmap and of the lane table, every
    truncation and some extensions of the RESULT it waits for are dropped and counted, the
    tensor stays in flight, and the genuine RESULT then finishes it exactly. Under
    `make sanitize-ext` a read or write past any of these packets is fatal."""
    agg = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    agg.bind((HOST, 0))
    agg.settimeout(10)
    token, bs, numel = 0xBAD5, 4, 12
    w = _C.OmniWorker([agg.getsockname()], token, 0, 1, timeout=120)
    try:
        import threading
        reg = threading.Thread(target=w.register, args=(20.0,))
        reg.start()
        p, worker = agg.recvfrom(70000)
        assert wire.parse(p)["type"] == T["REGISTER"]
        agg.sendto(wire.header(type=T["REGACK"], token=token, worker=0, nworkers=1), worker)
        reg.join(20)
        assert not reg.is_alive()
        x = torch.zeros(numel)
        x[[1, 9]] = 1.0
        out = torch.zeros(numel)
        ticket = w.submit(3, x, out, bs, 5, None, "fuzzed", 1.0)
        d = wire.parse(agg.recv(70000))
        assert d["type"] == T["DATA"] and d["nslots"] == 1 and d["lanes"] > 3, d
        # Three blocks in three lanes, one position each: every lane finishes in this RESULT.
        values = np.arange(1, numel + 1, dtype=np.float32)
        table = [(0, INF) if lane < 3 else (INF, INF) for lane in range(d["lanes"])]
        result = wire.data(table, {lane: values[lane * bs:(lane + 1) * bs].tobytes()
                                   for lane in range(3)},
                           type=T["RESULT"], token=token, worker=0, nworkers=1, dtype=0,
                           slot=0, round=0, tensor=3, block_size=bs, nblocks=d["nblocks"],
                           nslots=1, meta=d["meta"])
        # Not changed: fields the worker does not judge (flags but AUTH, worker, nworkers, meta;
        # a packet with another value there is genuine) and the block values.
        unjudged = {o for name, off, size in protocol.FIELDS
                    if name in ("worker", "nworkers", "meta") for o in range(off, off + size)}
        values_at = len(result) - 3 * bs * 4
        junk = [result[:n] for n in range(len(result))]
        junk += [result + bytes(n) for n in (1, 7, 8, 24, 4096)]
        for at in range(values_at):
            if at in unjudged:
                continue
            for flip in ((protocol.FLAGS["AUTH"],) if at == 7 else (0x01, 0x80, 0xFF)):
                junk.append(result[:at] + bytes([result[at] ^ flip]) + result[at + 1:])
        for i, p in enumerate(junk):
            agg.sendto(p, worker)
            if i % 64 == 63:
                time.sleep(0.002)  # within the socket buffer
        counted = ("malformed", "stale", "unauthenticated", "stale_epoch")  # epoch: another's
        deadline = time.monotonic() + 30
        while sum(w.stats()[k] for k in counted) < len(junk) and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = w.stats()
        assert sum(stats[k] for k in counted) == len(junk), stats
        assert not w.poll(ticket), "a malformed RESULT finished the tensor"
        agg.sendto(result, worker)
        assert w.wait(ticket, WAIT)
        w.finish(ticket)
        assert torch.equal(out, torch.from_numpy(values)), out
    finally:
        w.close()
        agg.close()
