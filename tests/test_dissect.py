"""The scapy layers (hvd_sparse.tools.scapy_layer) and ``hvd-sparse dissect``
(hvd_sparse.tools.dissect):

1. the layers read and write the same bytes as hvd_sparse.tools.wire, and are the protocol's fields;
2. a real job on the netns testbed (2 worker hosts, 1 aggregator host), captured live on the
   aggregator host and dissected, reports what the workers' own stats and the geometry say;
3. scapy-built malformed, truncated and foreign-job packets fired at a live aggregator during
   a job: the result stays exact, and the dissector's verdict on every packet is the
   aggregator's (its ``malformed`` and ``unknown_job`` counters).

Hand-built junk with stateful faults (lane positions, rounds, tensor mismatches) is
tests/test_aggregator_junk.py's; here every expectation comes from the dissector.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from aggregator_helpers import Job, reduce_under_junk, round0, sync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw, fuzz

from hvd_sparse import _C, auth, blocks, protocol
from hvd_sparse.tools import dissect, wire
from hvd_sparse.tools.scapy_layer import AGGREGATOR_PORT, Body, HvdSparse, Lane, bind_port
from hvd_sparse.tools.testbed import lifecycle, links, topology

ROOT = Path(__file__).resolve().parents[1]
T, INF = protocol.TYPES, protocol.INF
FIELD_NAMES = [name for name, _, _ in protocol.FIELDS]


def header_values(p: HvdSparse) -> dict[str, int]:
    return {name: int(getattr(p, name)) for name in FIELD_NAMES}


# ------------------------------------------------------------------------------------------
# 1. Layers vs hvd_sparse.tools.wire
# ------------------------------------------------------------------------------------------

def test_header_layer_is_the_protocol_description() -> None:
    got = [(f.name, f.sz) for f in HvdSparse.fields_desc]
    assert got == [(name, size) for name, _, size in protocol.FIELDS]
    assert len(HvdSparse()) == protocol.HEADER_BYTES
    assert HvdSparse().magic == protocol.MAGIC and HvdSparse().version == protocol.VERSION


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.fixed_dictionaries({name: st.integers(0, 2 ** (8 * size) - 1)
                              for name, _, size in protocol.FIELDS}))
def test_header_round_trip(values: dict[str, int]) -> None:
    raw = wire.header(**values)
    assert header_values(HvdSparse(raw)) == values
    assert bytes(HvdSparse(**values)) == raw


@functools.cache
def data_cases() -> list[tuple[list[tuple[int, int]], dict[int, bytes], dict[str, int]]]:
    """(lane table, lane -> block, header fields) of DATA and RESULT packets in every dtype."""
    rng = np.random.default_rng(5)
    out = []
    for code, esize in protocol.WIRE_DTYPES.values():
        for lanes in (1, 3, protocol.MAX_LANES):
            bs = int(rng.integers(1, 40))
            table = [(int(rng.integers(0, 100)), int(rng.integers(100, 200))) if rng.random() < .7
                     else (INF, INF) for _ in range(lanes)]
            live = [lane for lane, (o, _) in enumerate(table) if o != INF]
            carried = {lane: rng.bytes(bs * esize) for lane in live if rng.random() < 0.6}
            for typ in ("DATA", "RESULT"):
                out.append((table, carried, {
                    "type": T[typ], "dtype": code, "token": int(rng.integers(1, 2 ** 63)),
                    "worker": 1, "nworkers": 2, "slot": 3, "nslots": 9, "tensor": 2 ** 64 - 5,
                    "round": int(rng.integers(0, 1000)), "block_size": bs, "nblocks": 4000,
                    "meta": 0xDEADBEEF, "flags": int(rng.integers(0, 4))}))
    return out


def scapy_data(table, carried: dict[int, bytes], **fields) -> HvdSparse:
    """The same packet as wire.data, built with the scapy layers (lanes, present counted)."""
    return HvdSparse(**fields) / Body(bitmap=sum(1 << lane for lane in carried),
                                      lane_table=[Lane(offset=o, next=n) for o, n in table],
                                      blocks=[carried[lane] for lane in sorted(carried)])


def test_data_and_result_layers_match_wire() -> None:
    for table, carried, fields in data_cases():
        raw = wire.data(table, carried, **fields)
        want = wire.parse(raw)
        p = HvdSparse(raw)
        assert header_values(p) == {k: want[k] for k in FIELD_NAMES}
        body = p[Body]
        assert body.bitmap == want["bitmap"]
        assert [(lane.offset, lane.next) for lane in body.lane_table] == want["lane_table"]
        assert body.blocks == want["blocks"]
        assert Raw not in p  # the body took every byte
        assert dissect.check(p, len(raw)) is None
        assert bytes(scapy_data(table, carried, **fields)) == raw
    for typ in ("REGISTER", "REGACK", "RELEASE", "BYE", "ERROR", "HELD"):
        fields = {"type": T[typ], "token": 77, "worker": 2, "nworkers": 3, "tensor": 9,
                  "round": protocol.ERRORS["JOB"] if typ == "ERROR" else 0}
        raw = wire.header(**fields)
        assert bytes(HvdSparse(**fields)) == raw
        assert Body not in HvdSparse(raw) and dissect.check(HvdSparse(raw), len(raw)) is None


def test_authenticated_packets_end_in_their_trailer() -> None:
    """A packet flagged AUTH: header (and body), then the trailer layer with its sequence
    number and tag; its structure is judged without the trailer, as receivers judge it."""
    from hvd_sparse.tools.scapy_layer import Trailer
    key = bytes(range(16))
    for table, carried, fields in list(data_cases())[:3]:
        raw = bytearray(wire.data(table, carried, **fields))
        raw[7] |= protocol.FLAGS["AUTH"]
        signed = _C.gmac_sign(key, bytes(raw), 1, 42)
        p = HvdSparse(signed)
        assert p[Trailer].seq == 42 and p[Trailer].tag == signed[-protocol.TAG_BYTES:]
        assert p[Body].blocks == wire.parse(bytes(raw))["blocks"] and Raw not in p
        assert dissect.check(p, len(signed)) is None
        assert dissect.check(p, len(raw)) is not None  # the flag without its trailer
    raw = bytearray(wire.header(type=T["BYE"], token=77, worker=1, nworkers=2))
    raw[7] |= protocol.FLAGS["AUTH"]
    p = HvdSparse(_C.gmac_sign(key, bytes(raw), 1, 7))
    assert p[Trailer].seq == 7 and dissect.check(p, len(raw) + protocol.AUTH_BYTES) is None


def test_bound_to_the_aggregation_port_both_ways() -> None:
    table, carried, fields = data_cases()[0]
    for sport, dport in ((40000, AGGREGATOR_PORT), (AGGREGATOR_PORT, 40000)):
        p = scapy_data(table, carried, **fields)
        frame = IP(bytes(IP() / UDP(sport=sport, dport=dport) / p))
        assert header_values(frame[HvdSparse]) == header_values(HvdSparse(bytes(p)))
        assert frame[Body].blocks == [carried[lane] for lane in sorted(carried)]
    other = bytes(IP() / UDP(sport=40000, dport=4242) / HvdSparse(type=T["BYE"]))
    assert HvdSparse not in IP(other)
    bind_port(4242)
    assert IP(other)[HvdSparse].type == T["BYE"]


def test_ipv6_frames_are_dissected_with_bracketed_addresses() -> None:
    """Over IPv6 as over IPv4: the layer binds to the UDP port, and the report names IPv6
    peers as [addr]:port."""
    table, carried, fields = data_cases()[0]
    p = scapy_data(table, carried, **fields)
    frame = Ether(bytes(Ether() / IPv6(src="fd77::1", dst="fd77::101")
                        / UDP(sport=40000, dport=AGGREGATOR_PORT) / p))
    assert header_values(frame[HvdSparse]) == header_values(HvdSparse(bytes(p)))
    junk = Ether(bytes(Ether() / IPv6(src="fd77::2", dst="fd77::101")
                       / UDP(sport=40001, dport=AGGREGATOR_PORT) / Raw(b"\x00" * 3)))
    d = dissect.summarize([frame, junk])
    assert d["datagrams"] == 2 and len(d["jobs"]) == 1, d
    assert d["jobs"][0]["workers"] == [fields.get("worker", 0)], d["jobs"][0]
    assert d["malformed"]["listed"][0]["from"] == "[fd77::2]:40001", d["malformed"]
    assert d["malformed"]["listed"][0]["to"] == f"[fd77::101]:{AGGREGATOR_PORT}"


# ------------------------------------------------------------------------------------------
# Malformed datagrams: named, never a crash
# ------------------------------------------------------------------------------------------

REASONS = {"truncated", "magic", "version", "type", "reserved", "worker", "size", "dtype",
           "layout", "slot", "count", "bitmap"}


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.integers(0, len(data_cases()) - 1), st.integers(0, 2 ** 32), st.binary(max_size=80))
def test_dissector_never_crashes(case: int, seed: int, junk: bytes) -> None:
    rng = np.random.default_rng(seed)
    table, carried, fields = data_cases()[case]
    raw = wire.data(table, carried, **fields)
    cut = raw[:int(rng.integers(0, len(raw)))]
    at = int(rng.integers(0, len(raw)))
    flipped = raw[:at] + bytes([raw[at] ^ int(rng.integers(1, 256))]) + raw[at + 1:]
    s = dissect.Summary()
    for payload in (cut, raw + junk, junk, flipped, bytes(fuzz(HvdSparse())),
                    bytes(fuzz(HvdSparse(type=fields["type"]) / Body()))):
        h, reason = dissect.classify(payload)
        assert reason is None or reason in REASONS, reason
        s.add(payload, "10.0.0.1:1", f"10.0.0.2:{AGGREGATOR_PORT}", True)
    assert dissect.classify(cut)[1] is not None
    assert dissect.classify(raw + junk)[1] == (None if not junk else "size")
    json.dumps(s.to_dict())


# ------------------------------------------------------------------------------------------
# 2. A real job on the testbed, captured and dissected
# ------------------------------------------------------------------------------------------

TOKEN, PAYLOAD, SLOTS = 0xD155EC7, 8192, 4
SPECS = [(256 * 300 + 5, 256, "float32", 0.3), (64 * 500, 64, "float16", 0.2)]
RANK = r"""
import json, sys, torch
from hvd_sparse import _C
host, port, rank, n, token, payload, slots = sys.argv[1:8]
specs, out, key = json.loads(sys.argv[8]), sys.argv[9], bytes.fromhex(sys.argv[10])
w = _C.OmniWorker([(host, int(port))], int(token), int(rank), int(n),
                  payload_bytes=int(payload), slots_per_aggregator=int(slots), timeout=60.0,
                  key=key)
w.register(30.0)
g = torch.Generator().manual_seed(int(rank) + 1)
stats = []
for tid, (numel, bs, dtype, density) in enumerate(specs, 1):
    nb = -(-numel // bs)
    keep = torch.rand(nb, generator=g) < density
    x = (torch.randn(nb, bs, generator=g) * keep[:, None]).reshape(-1)[:numel]
    x = x.to(getattr(torch, dtype)).contiguous()
    t = w.submit(tid, x, torch.zeros_like(x), bs, 7, None, f"t{tid}", 1.0)
    assert w.wait(t, 60.0), f"tensor {tid} timed out"
    stats.append(w.finish(t))
w.close()
json.dump(stats, open(out, "w"))
"""


def wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} from {proc.args}: {path.read_text()[-2000:]}")
        time.sleep(0.05)


@pytest.mark.testbed
@pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root")
def test_captured_testbed_job_is_dissected(tmp_path: Path) -> None:
    name = f"hvx{os.getpid() % 100000}"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cli = [sys.executable, "-m", "hvd_sparse.tools.cli", "dissect"]
    pcap, sniff_err = tmp_path / "job.pcap", tmp_path / "sniff.err"
    procs: list[subprocess.Popen] = []
    tb = None
    try:
        tb = lifecycle.up(topology.Testbed(name, workers=2, aggregators=1, rate="1gbit",
                                           mtu=9000))
        agg = tb.aggregator_hosts[0]
        # authenticated, as every job on the testbed is: the capture holds trailers
        key = auth.job_key(auth.read_secret_file(tb.secret_file()), TOKEN).hex()
        with open(sniff_err, "w") as err:
            sniffer = subprocess.Popen(
                ["ip", "netns", "exec", agg.ns, *cli, "--iface", "eth0", "--timeout", "120",
                 "--write", str(pcap), "--json"], env=env, stdout=subprocess.PIPE, stderr=err,
                text=True)
        procs.append(sniffer)
        wait_for(sniff_err, "listening on eth0", sniffer)
        outs = [tmp_path / f"rank{r}.json" for r in range(2)]
        workers = [subprocess.Popen(
            ["ip", "netns", "exec", h.ns, sys.executable, "-c", RANK, agg.ip,
             str(AGGREGATOR_PORT), str(r), "2", str(TOKEN), str(PAYLOAD), str(SLOTS),
             json.dumps(SPECS), str(outs[r]), key], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True) for r, h in enumerate(tb.worker_hosts)]
        procs += workers
        for w in workers:
            log = w.communicate(timeout=120)[0]
            assert w.returncode == 0, log[-3000:]
        time.sleep(0.5)  # the last BYE reaches the capture
        sniffer.send_signal(signal.SIGINT)
        live = json.loads(sniffer.communicate(timeout=30)[0])
        assert sniffer.returncode == 0, sniff_err.read_text()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        lifecycle.down(name)
    assert links.namespaces(name) == []
    stats = [json.loads(o.read_text()) for o in outs]

    dissected = subprocess.run([*cli, str(pcap), "--json"], env=env, capture_output=True,
                               text=True, timeout=60)
    assert dissected.returncode == 0, dissected.stderr[-2000:]
    d = json.loads(dissected.stdout)
    assert d == live  # the saved capture reads as the live one did
    table = subprocess.run([*cli, str(pcap)], env=env, capture_output=True, text=True,
                           timeout=60)
    assert table.returncode == 0 and f"job {TOKEN:#x}" in table.stdout, table.stderr[-2000:]

    assert d["malformed"]["count"] == 0, d["malformed"]
    (job,) = d["jobs"]
    assert job["token"] == f"{TOKEN:#x}" and job["workers"] == [0, 1]
    assert job["authenticated"] == live["datagrams"], job  # every packet carried its MAC
    ctl = job["control"]
    assert ctl["REGISTER"] >= 2 and ctl["REGACK"] >= 2 and ctl["BYE"] == 2, ctl
    assert ctl["RELEASE"] == 2 * len(SPECS) and "ERROR" not in ctl, ctl
    assert [x["tensor"] for x in job["tensors"]] == [hex(i) for i in range(1, len(SPECS) + 1)]
    for i, (x, (numel, bs, dtype, _)) in enumerate(zip(job["tensors"], SPECS, strict=True)):
        code, esize = protocol.DTYPES[dtype]
        nb = -(-numel // bs)
        lanes, nslots = protocol.layout(nb, bs, esize, PAYLOAD, SLOTS)
        assert (x["dtype"], x["block_size"], x["nblocks"], x["lanes"], x["nslots"]) == \
            (dtype, bs, nb, lanes, nslots), x
        assert blocks.DTYPE_CODES[getattr(torch, dtype)] == code
        assert x["slots"] == x["complete_slots"] == nslots, x
        assert x["max_round"] >= 1, x  # several rounds per slot
        for r in range(2):
            s, w = stats[r][i], x["per_worker"][str(r)]
            assert (s["lanes"], s["nslots"]) == (lanes, nslots)
            assert x["rounds"] == w["rounds"] == s["rounds"], (x, s)
            assert w["data"] == s["packets"], (w, s)
            assert w.get("data_retransmissions", 0) == s["retransmits"], (w, s)
            assert w["result"] == s["rounds"] + w.get("result_retransmissions", 0), (w, s)
        assert x["data"] == sum(s[i]["packets"] for s in stats), x


# ------------------------------------------------------------------------------------------
# 3. Scapy-built junk at a live aggregator: the dissector's verdict is the aggregator's
# ------------------------------------------------------------------------------------------

KINDS = ["truncated", "extended", "magic", "version", "type", "reserved", "dtype", "worker",
         "nworkers",
         "lanes", "block_size", "slot", "nslots", "present>lanes", "missing block",
         "bitmap beyond lanes", "bitmap popcount", "control + bytes", "foreign data",
         "foreign control", "fuzzed header", "fuzzed packet"]


def scapy_junk(kind: str, seed: int, tensor: int) -> bytes:
    """A packet for the fuzz job built with the scapy layers, faulty as ``kind`` says; what
    it is (malformed, foreign, a REGISTER) is left to the dissector to say."""
    rng = np.random.default_rng(seed)
    nb, lanes, ns, bs = Job.nblocks, Job.lanes, Job.nslots, Job.bs
    slot = int(rng.integers(0, ns))
    table = round0(slot, nb, ns, lanes, rng)
    live = [lane for lane in range(lanes) if table[lane][0] != INF]
    carried = {lane: rng.standard_normal(bs).astype(np.float32).tobytes() for lane in live}
    # a fresh tensor (no state to disturb), round 0, valid but for the fault
    base = {"token": Job.token, "type": T["DATA"], "worker": int(rng.integers(0, Job.n)),
            "nworkers": Job.n, "tensor": 0xF000_0000 + seed, "slot": slot, "round": 0,
            "block_size": bs, "nblocks": nb, "nslots": ns, "meta": 7, "dtype": 0}
    p = scapy_data(table, carried, **base)
    h = p[HvdSparse]
    foreign = Job.token ^ int(rng.integers(1, 2 ** 63))
    if kind == "truncated":
        return bytes(p)[:int(rng.integers(0, len(p)))]
    if kind == "extended":
        return bytes(p / Raw(rng.bytes(int(rng.integers(1, 30)))))
    if kind == "foreign data":
        h.token = foreign
        h.tensor = tensor
        return bytes(p)
    if kind in ("control + bytes", "foreign control"):
        c = HvdSparse(token=Job.token if kind == "control + bytes" else foreign,
                      type=int(rng.choice([T["RELEASE"], T["BYE"], T["RESULT"]])),
                      worker=base["worker"], nworkers=Job.n, tensor=tensor)
        if c.type == T["RESULT"]:  # aggregator-bound: only foreign ones are unknown
            c.token = foreign
            return bytes(c / p[Body])
        return bytes(c / Raw(b"\0" * int(rng.integers(1, 9)))) if kind == "control + bytes" \
            else bytes(c)
    if kind == "fuzzed header":  # every header field random (scapy's fuzz), no body
        return bytes(fuzz(HvdSparse()))
    if kind == "fuzzed packet":  # a DATA of another job, the rest of its header random
        return bytes(fuzz(HvdSparse(magic=protocol.MAGIC, version=protocol.VERSION,
                                    type=T["DATA"], dtype=0, token=foreign, lanes=None,
                                    present=None)) / p[Body])
    faults = {
        "magic": {"magic": int(rng.integers(0, 2 ** 32)) ^ protocol.MAGIC or 1},
        "version": {"version": int(rng.choice([0, protocol.VERSION + 1, 255]))},
        "type": {"type": int(rng.choice([0, max(T.values()) + 1, 255]))},
        "reserved": {"reserved": int(rng.integers(1, 2 ** 32))},
        "dtype": {"dtype": int(rng.integers(len(protocol.WIRE_DTYPES), 256))},
        "worker": {"worker": int(rng.integers(Job.n, 2 ** 16))},
        "nworkers": {"nworkers": int(rng.choice([0, protocol.MAX_WORKERS + 1])), "worker": 0},
        "lanes": {"lanes": int(rng.choice([0, protocol.MAX_LANES + 1]))},
        "block_size": {"block_size": 0},
        "slot": {"slot": ns + int(rng.integers(0, 1000))},
        "nslots": {"nslots": 0, "slot": 0},
        "present>lanes": {"present": lanes + 1},
    }
    if kind in faults:
        for k, v in faults[kind].items():
            setattr(h, k, v)
        return bytes(p)
    if kind == "missing block":  # present and bitmap say one more block than is there
        raw = bytes(p)
        return raw[:-bs * protocol.ELEM_SIZE[0]] if carried else raw[:-1]
    if kind == "bitmap beyond lanes":
        p[Body].bitmap |= 1 << lanes
        return bytes(p)
    if kind == "bitmap popcount":
        p[Body].bitmap ^= 1 << int(rng.integers(0, lanes))
        return bytes(p)
    raise AssertionError(kind)


def expected(payload: bytes) -> str:
    """What the aggregator must count, from the dissector's verdict alone."""
    h, reason = dissect.classify(payload)
    if reason is not None:
        return "malformed"
    assert h is not None
    if h.flags & protocol.FLAGS["AUTH"]:
        return "bad_mac"  # authenticated, at an aggregator without a secret: it cannot check
    assert h.token != Job.token, "a well-formed packet of the job"
    return "register" if h.type == T["REGISTER"] else "unknown"


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(junk=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2 ** 20)), min_size=1,
                     max_size=40))
def test_scapy_junk_during_a_job(fuzz_job, junk: list[tuple[str, int]]) -> None:
    counter = fuzz_job[3]
    counter[0] += 1
    tensor = 5000 + counter[0]
    built = [scapy_junk(kind, seed + 7919 * i, tensor) for i, (kind, seed) in enumerate(junk)]
    want = [expected(p) for p in built]
    d = reduce_under_junk(fuzz_job, tensor, counter[0], built, "scapy junk")
    kinds = sorted({k for k, _ in junk})
    assert d["malformed"] == want.count("malformed"), (d, want, kinds)
    assert d["unknown_job"] == want.count("unknown"), (d, want, kinds)
    assert d["tensors"] == 1 and d["mismatch"] == 0, (d, kinds)


def test_each_verdict_matches_the_aggregator(aggs, make_workers) -> None:
    """Packet by packet, each kind a few times: the aggregator's counters move exactly as
    the dissector said (malformed, unknown job, or neither for a foreign REGISTER)."""
    agg = aggs(Job.n)
    make_workers([agg], Job.n, token=Job.token)  # the job is known: its token is not foreign
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    try:
        sync(sock, agg)
        prev = agg.stats()
        seen = set()
        for i, kind in enumerate(KINDS * 2):
            p = scapy_junk(kind, 31 * i, 1)
            reason = dissect.classify(p)[1]
            want = expected(p)
            sock.sendto(p, agg.addr)
            sync(sock, agg)
            now = agg.stats()
            got = {"malformed": now["malformed"] - prev["malformed"],
                   "unknown": now["unknown_job"] - prev["unknown_job"]}
            assert got == {"malformed": int(want == "malformed"),
                           "unknown": int(want == "unknown")}, (kind, reason, got)
            seen.add(reason)
            prev = now
        # every reason of check_structure was met, and well-formed foreign packets
        assert {None, "magic", "version", "type", "reserved", "worker", "size", "dtype",
                "layout", "slot", "count", "bitmap"} <= seen, seen
    finally:
        sock.close()
