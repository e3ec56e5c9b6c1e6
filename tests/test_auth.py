"""Packet authentication (docs/PROTOCOL.md "Authentication"), held to the spec from outside:
the trailer against OpenSSL's own GMAC (the `openssl mac` command), the job key against
Python's HMAC, the aggregator core and the worker engine against peers written here from the
spec. Forged, altered, replayed and unauthenticated packets are dropped and counted, and never
reach a sum."""
from __future__ import annotations

import os
import socket
import struct
import subprocess
import time

import numpy as np
import pytest
import torch

from hvd_sparse import _C, auth, protocol
from hvd_sparse.errors import HvdSparseError
from hvd_sparse.tools import wire

T, F = protocol.TYPES, protocol.FLAGS
AUTH = F["AUTH"]
SECRET = b"correct horse battery staple 42!"
TOKEN = 0x1234_5678_9ABC_DEF1
KEY = auth.job_key(SECRET, TOKEN)
AGG0 = protocol.AGGREGATOR_SENDER  # aggregator 0's sender id


def signed(packet: bytes, sender: int, seq: int, key: bytes = KEY) -> bytes:
    """``packet`` flagged AUTH, with its trailer."""
    p = bytearray(packet)
    p[7] |= AUTH
    return _C.gmac_sign(key, bytes(p), sender, seq)


def body(packet: bytes) -> bytes:
    """An authenticated packet less its trailer."""
    return packet[:-protocol.AUTH_BYTES]


def trailer(packet: bytes) -> tuple[int, bytes]:
    seq, = struct.unpack(">Q", packet[-protocol.AUTH_BYTES:-protocol.TAG_BYTES])
    return seq, packet[-protocol.TAG_BYTES:]


@pytest.mark.integration  # runs the openssl command
def test_trailer_is_gmac_as_specified(tmp_path):
    """The tag is AES-128-GMAC under the key with nonce (sender, seq), over header, body and
    the sequence number: recomputed with the openssl command."""
    packet = signed(wire.header(type=T["BYE"], token=TOKEN, worker=3, nworkers=4), 3, 77)
    seq, tag = trailer(packet)
    assert seq == 77 and packet[7] & AUTH
    (tmp_path / "m").write_bytes(packet[:-protocol.TAG_BYTES])
    iv = struct.pack(">IQ", 3, 77).hex()
    out = subprocess.run(["openssl", "mac", "-cipher", "AES-128-GCM", "-macopt",
                          f"hexkey:{KEY.hex()}", "-macopt", f"hexiv:{iv}", "-in",
                          str(tmp_path / "m"), "GMAC"], capture_output=True, text=True, check=True)
    assert out.stdout.strip().lower() == tag.hex()


def test_job_key_is_the_specified_hmac():
    import hashlib
    import hmac
    for secret, token in ((SECRET, TOKEN), (b"x" * 16, 1), (os.urandom(40), 2**63 - 1)):
        want = hmac.new(secret, b"hvd-sparse job key v1" + token.to_bytes(8, "big"),
                        hashlib.sha256).digest()[:16]
        assert auth.job_key(secret, token) == want == _C.derive_job_key(secret, token)


def test_x25519_agreement_and_bad_keys():
    a, pa = _C.x25519_keypair()
    b, pb = _C.x25519_keypair()
    assert _C.x25519(a, pb) == _C.x25519(b, pa) != _C.x25519(a, pa)
    with pytest.raises(ValueError, match="bad peer key"):
        _C.x25519(a, bytes(32))  # a low-order point: an all-zero shared secret


@pytest.mark.parametrize("problem", ["mode", "short", "symlink", "missing"])
def test_secret_file_rules(tmp_path, problem):
    """Python and the aggregator read a secret file alike, and refuse the same bad ones."""
    good = tmp_path / "good"
    good.write_bytes(SECRET + b"\n")
    good.chmod(0o600)
    assert auth.read_secret_file(good) == SECRET
    path = tmp_path / "bad"
    if problem == "mode":
        path.write_bytes(SECRET)
        path.chmod(0o644)  # (group read alone: tests/test_secret_file.py)
    elif problem == "short":
        path.write_bytes(b"0123456789abcde \n")
        path.chmod(0o600)
    elif problem == "symlink":
        path.symlink_to(good)
    words = {"mode": "readable by others", "short": "fewer than 16", "symlink": "secret file",
             "missing": "secret file"}[problem]
    with pytest.raises(HvdSparseError, match=words):
        auth.read_secret_file(path)


# ------------------------------------------------------------------------------------------
# The aggregator core, with a secret
# ------------------------------------------------------------------------------------------

W = [("10.0.0.1", 5001), ("10.0.0.2", 5002)]


def register(worker: int, seq: int, index: int = 0, key: bytes = KEY) -> bytes:
    return signed(wire.header(type=T["REGISTER"], token=TOKEN, worker=worker, nworkers=2,
                              slot=index), worker, seq, key)


def data(worker: int, seq: int, values: np.ndarray, round_: int = 0, key: bytes = KEY) -> bytes:
    """DATA of a one-slot, one-lane tensor of one 4-element block."""
    return signed(wire.data([(0, protocol.INF)], {0: values.astype(np.float32).tobytes()},
                            token=TOKEN, worker=worker, nworkers=2, dtype=0, slot=0,
                            round=round_, flags=round_ & 1, tensor=9, block_size=4, nblocks=1,
                            nslots=1, meta=1), worker, seq, key)


def core_with_job() -> _C.AggregatorCore:
    core = _C.AggregatorCore(workers=2, secret=SECRET)
    for w in range(2):
        (to, reply), = core.handle(register(w, 1), W[w])
        assert to == W[w] and wire.parse(body(reply))["type"] == T["REGACK"]
        # signed by aggregator 0 of the job, with a fresh sequence number
        seq, _ = trailer(reply)
        assert signed(body(reply), AGG0, seq) == reply
    return core


def test_authenticated_round_sums_and_signs_the_result():
    core = core_with_job()
    a, b = np.array([1, 2, 3, 4.5]), np.array([10, 20, 30, 40.25])
    assert core.handle(data(0, 2, a), W[0]) == []
    out = core.handle(data(1, 2, b), W[1])
    assert sorted(to for to, _ in out) == sorted(W)
    replies = {p for _, p in out}
    assert len(replies) == 1  # one RESULT, signed once, to both
    reply = replies.pop()
    seq, _ = trailer(reply)
    assert signed(body(reply), AGG0, seq) == reply
    r = wire.parse(body(reply))
    assert r["type"] == T["RESULT"] and r["flags"] & AUTH
    np.testing.assert_array_equal(np.frombuffer(r["blocks"][0], np.float32), (a + b).astype(
        np.float32))


@pytest.mark.parametrize("attack", ["no_mac", "wrong_key", "altered", "replay", "other_sender"])
def test_forged_data_never_reaches_the_sum(attack):
    """A sniffer's DATA (it has the token, not the key) sent before the genuine ones: dropped
    and counted; the genuine ones then sum as if it never came."""
    core = core_with_job()
    a, b, evil = np.array([1, 2, 3, 4.0]), np.array([5, 6, 7, 8.0]), np.full(4, 1e6)
    genuine0 = data(0, 2, a)
    if attack == "no_mac":
        forged = body(data(0, 2, evil))
        forged = forged[:7] + bytes([forged[7] & ~AUTH]) + forged[8:]
        counter = "unauthenticated"
    elif attack == "wrong_key":
        forged, counter = data(0, 2, evil, key=os.urandom(16)), "bad_mac"
    elif attack == "altered":  # a genuine packet with its values changed in flight
        forged = bytearray(genuine0)
        forged[-protocol.AUTH_BYTES - 1] ^= 0x40
        forged, counter = bytes(forged), "bad_mac"
    elif attack == "other_sender":  # worker 0's packet claiming to be worker 1's
        forged = bytearray(genuine0)
        forged[16:18] = (1).to_bytes(2, "big")
        forged, counter = bytes(forged), "bad_mac"
    else:  # worker 0's REGISTER captured and sent again
        forged, counter = register(0, 1), "replayed"
    sender = W[1] if attack == "other_sender" else W[0]
    assert core.handle(forged, sender) == []
    assert core.counters()[counter] == 1
    assert core.handle(genuine0, W[0]) == []
    out = core.handle(data(1, 2, b), W[1])
    r = wire.parse(body(out[0][1]))
    np.testing.assert_array_equal(np.frombuffer(r["blocks"][0], np.float32), a + b)
    # the genuine DATA again (a captured copy): a replay, not a retransmission
    assert core.handle(genuine0, W[0]) == []
    assert core.counters()["replayed"] == 1 + (attack == "replay")


def test_replay_window_takes_reordering_and_drops_the_too_old():
    core = core_with_job()  # worker 0 has sent sequence number 1

    def taken(seq: int) -> bool:  # a REGISTER (keep-alive) is answered when taken
        return core.handle(register(0, seq), W[0]) != []
    assert taken(2000) and taken(1990) and taken(977)  # 977: the oldest the window holds
    assert not taken(976) and not taken(1990) and not taken(0)
    assert core.counters()["replayed"] == 3


def test_retransmitted_result_is_signed_again():
    """A worker that lost its RESULT resends DATA (new sequence number) and gets the stored
    RESULT with a sequence number of its own, which its replay window takes."""
    core = core_with_job()
    core.handle(data(0, 2, np.ones(4)), W[0])
    first = core.handle(data(1, 2, np.ones(4)), W[1])[0][1]
    again = core.handle(data(0, 3, np.ones(4)), W[0])
    assert [to for to, _ in again] == [W[0]]
    resent = again[0][1]
    assert body(resent)[:-8] == body(first)[:-8]  # the same RESULT
    assert trailer(resent)[0] > trailer(first)[0]
    assert signed(body(resent), AGG0, trailer(resent)[0]) == resent


def test_held_is_signed():
    """A late resend of a DATA the round holds is answered HELD, signed like every packet of
    the job: forged, one could make a worker's timeout blame the wrong rank."""
    core = core_with_job()
    assert core.handle(data(0, 2, np.ones(4)), W[0], 0.0) == []
    [(to, held)] = core.handle(data(0, 3, np.ones(4)), W[0], protocol.HELD_AFTER + 1)
    seq, _ = trailer(held)
    assert to == W[0] and signed(body(held), AGG0, seq) == held
    h = wire.parse(body(held))
    assert (h["type"], h["worker"], h["round"]) == (T["HELD"], 1, 0) and h["flags"] & AUTH


def test_secret_and_plain_do_not_mix():
    plain = _C.AggregatorCore(workers=2)
    assert plain.handle(register(0, 1), W[0]) == []  # it cannot check a MAC
    assert plain.counters()["bad_mac"] == 1
    keyed = _C.AggregatorCore(workers=2, secret=SECRET)
    reg = wire.header(type=T["REGISTER"], token=TOKEN, worker=0, nworkers=2)
    assert keyed.handle(reg, W[0]) == []
    assert keyed.counters()["unauthenticated"] == 1 and keyed.active_jobs() == 0


def test_register_with_another_aggregator_index_is_refused():
    """The index is the aggregator's sender id: workers that disagree on it get ERROR JOB."""
    core = core_with_job()
    (to, reply), = core.handle(register(0, 5, index=1), W[0])
    r = wire.parse(body(reply))
    assert r["type"] == T["ERROR"] and r["round"] == protocol.ERRORS["JOB"]
    assert signed(body(reply), AGG0 + 1, trailer(reply)[0]) == reply


# ------------------------------------------------------------------------------------------
# The worker engine, against an aggregator written here
# ------------------------------------------------------------------------------------------

class SpecAggregator:
    """One UDP socket that answers a single worker as docs/PROTOCOL.md says an aggregator
    with the job's key does, and can send it anything else."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(10)
        self.addr = self.sock.getsockname()
        self.seq = 0
        self.worker: tuple[str, int] | None = None

    def recv(self, type_: int) -> dict:
        while True:
            p, self.worker = self.sock.recvfrom(70000)
            seq, _ = trailer(p)
            assert signed(body(p), 0, seq) == p, "a worker packet with a bad tag"
            h = wire.parse(body(p))
            if h["type"] == type_:
                return h

    def send(self, packet: bytes, sign: bool = True, key: bytes = KEY) -> bytes:
        self.seq += 1
        if sign:
            packet = signed(packet, AGG0, self.seq, key)
        self.sock.sendto(packet, self.worker)
        return packet


@pytest.mark.integration  # a worker engine on a socket
def test_worker_takes_only_authenticated_results():
    agg = SpecAggregator()
    w = _C.OmniWorker([agg.addr], TOKEN, 0, 1, key=KEY, timeout=20)
    try:
        import threading
        t = threading.Thread(target=w.register, args=(20.0,))
        t.start()
        reg = agg.recv(T["REGISTER"])
        regack = agg.send(wire.header(type=T["REGACK"], token=TOKEN, worker=0, nworkers=1))
        t.join(20)
        assert not t.is_alive() and reg["slot"] == 0
        x = torch.zeros(4)
        x[1] = 3.0
        out = torch.zeros(4)
        ticket = w.submit(5, x, out, 4, 1)
        d = agg.recv(T["DATA"])
        assert np.frombuffer(d["blocks"][0], np.float32)[1] == 3.0

        def result(values: list[float]) -> bytes:
            """The RESULT of that DATA's round (its layout, every lane finished)."""
            table = [(off, protocol.INF) for off, _ in d["lane_table"]]
            return wire.data(table, {0: np.array(values, np.float32).tobytes()},
                             type=T["RESULT"], token=TOKEN, worker=0, nworkers=1, dtype=0,
                             slot=0, round=0, flags=F["LAST"], tensor=5, block_size=4,
                             nblocks=d["nblocks"], nslots=d["nslots"], meta=d["meta"])
        agg.send(result([9, 9, 9, 9]), sign=False)  # no tag
        agg.send(result([8, 8, 8, 8]), key=os.urandom(16))  # a tag under another key
        agg.send(regack, sign=False)  # a genuine packet again
        forged_error = wire.header(type=T["ERROR"], token=TOKEN, worker=0, nworkers=1, slot=0,
                                   tensor=5, round=protocol.ERRORS["MISMATCH"])
        agg.send(forged_error, key=os.urandom(16))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            c = w.stats()
            if c["bad_mac"] >= 2 and c["unauthenticated"] and c["replayed"]:
                break
            time.sleep(0.02)
        assert not w.poll(ticket), "a forged packet finished the tensor"
        agg.send(result([0, 4, 0, 0]))
        w.wait(ticket, 20)
        stats = w.finish(ticket)
        assert torch.equal(out, torch.tensor([0, 4.0, 0, 0])), stats
        c = w.stats()
        assert (c["unauthenticated"], c["bad_mac"], c["replayed"]) == (1, 2, 1), c
    finally:
        w.close()
        agg.sock.close()
