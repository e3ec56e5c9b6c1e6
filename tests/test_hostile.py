"""A hostile host on the netns testbed (`pytest -k hostile`): while 4 ranks reduce with
omnireduce (authenticated, the default), an extra host that sees every aggregation packet (the
aggregator's switch port mirrored to it) sends, at a bounded rate, what such a host can: the
packets it captured again (replays), captured DATA and RESULT with values changed, forged
REGISTER, BYE, RELEASE, DATA, RESULT, ERROR and REGACK carrying the job's token (with a made-up
tag and without one), and random junk, at the aggregator and at the workers, from their own
addresses (spoofed). Every result must still equal Horovod's allreduce, nothing may hang, and
the aggregator's and the workers' counters must show the drops. Needs root."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

from hvd_sparse.tools.testbed import launch as testbed_launch
from hvd_sparse.tools.testbed import links, topology

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "parallel"))
from driver import Launch, run  # noqa: E402
from test_testbed import running  # noqa: E402

NAME = f"hvh{os.getpid() % 100000}"
RATE = 300  # forged packets per second: an attack, not a flood
TENSORS = 12  # reduced under attack

# The attacker, in its own namespace: sniffs the mirrored traffic from a raw socket, then sends
# forged frames from its own MAC with spoofed IPv4 sources until the stop file appears; writes
# how many of each kind it sent. argv: stop file, report file, packets per second.
ATTACKER = textwrap.dedent(r"""
    import json, os, random, socket, struct, sys, time
    from scapy.all import Ether, IP, UDP
    from hvd_sparse import protocol
    from hvd_sparse.tools import wire

    stop, report, rate = sys.argv[1], sys.argv[2], float(sys.argv[3])
    T, PORT, AUTH = protocol.TYPES, protocol.AGGREGATOR_PORT, protocol.FLAGS["AUTH"]
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
    s.bind(("eth0", 0))
    s.settimeout(0.5)
    mine = s.getsockname()[4]
    caught = []  # (frame, to_aggregator)
    deadline = time.monotonic() + 120
    while len(caught) < 400 and time.monotonic() < deadline and not os.path.exists(stop):
        try:
            f = s.recv(65536)
        except socket.timeout:
            continue
        if len(f) < 42 or f[12:14] != b"\x08\x00" or f[23] != 17:
            continue
        ihl = (f[14] & 15) * 4
        sport, dport = struct.unpack(">HH", f[14 + ihl:18 + ihl])
        if PORT in (sport, dport) and len(f) >= 14 + ihl + 8 + protocol.HEADER_BYTES:
            caught.append((f, dport == PORT))
    assert caught, "sniffed nothing"
    rng = random.Random(7)

    def parts(f):
        ihl = (f[14] & 15) * 4
        ip = IP(f[14:14 + ihl + 8])
        return f[0:6], f[6:12], ip.src, ip.dst, ip[UDP].sport, ip[UDP].dport, f[14 + ihl + 8:]

    def send(dst_mac, src, dst, sport, dport, payload):
        frame = Ether(dst=dst_mac, src=mine) / IP(src=src, dst=dst) / \
            UDP(sport=sport, dport=dport, chksum=0) / payload
        s.send(bytes(frame))

    def flip(p):  # a value changed in flight (the UDP checksum is dropped, so it arrives)
        p = bytearray(p)
        i = rng.randrange(protocol.HEADER_BYTES, max(protocol.HEADER_BYTES + 1, len(p)))
        p[i % len(p)] ^= 0x5A
        return bytes(p)

    def forged(h, kind):
        hdr = wire.parse(h)
        fields = {k: hdr[k] for k in ("token", "worker", "nworkers", "tensor", "slot")}
        p = wire.header(type=T[kind], round=rng.randrange(0, 6), **fields)
        if rng.random() < 0.5:  # claims a tag, and makes one up
            p = bytearray(p)
            p[7] |= AUTH
            p = bytes(p) + os.urandom(protocol.AUTH_BYTES)
        return p

    sent = {}
    gap = 1.0 / rate
    while not os.path.exists(stop):
        f, up = rng.choice(caught)
        dmac, smac, src, dst, sport, dport, p = parts(f)
        kind = rng.choice(["replay", "altered", "control", "junk"])
        if kind == "replay":
            send(dmac, src, dst, sport, dport, p)
        elif kind == "altered":
            send(dmac, src, dst, sport, dport, flip(p))
        elif kind == "control":
            what = rng.choice(["REGISTER", "BYE", "RELEASE"] if up else
                              ["RESULT", "ERROR", "REGACK", "HELD"])
            send(dmac, src, dst, sport, dport, forged(p, what))
        else:
            send(dmac, src, dst, sport, dport, os.urandom(rng.randrange(1, 2000)))
        key = f"{kind} to {'aggregator' if up else 'worker'}"
        sent[key] = sent.get(key, 0) + 1
        time.sleep(gap)
    open(report, "w").write(json.dumps({"caught": len(caught), "sent": sent}))
""")


@contextlib.contextmanager
def attacker_host(tb: topology.Testbed) -> Iterator[str]:
    """A namespace on the testbed's bridge that receives a copy of every frame to and from
    the aggregator host (its switch port mirrored); removed, with its processes, after."""
    ns, sw, veth = f"{tb.name}-x", tb.switch_ns, f"{tb.name}x"
    port = tb.aggregator_hosts[0].port
    mirror = ["ip", "netns", "exec", sw, "tc", "filter", "add", "dev", port]
    to_x = ["protocol", "all", "u32", "match", "u32", "0", "0", "action", "mirred", "egress",
            "mirror", "dev", "x"]
    try:
        for cmd in (
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", veth, "type", "veth", "peer", "name", "x", "netns", sw],
            ["ip", "link", "set", veth, "netns", ns],
            ["ip", "-n", ns, "link", "set", veth, "name", "eth0", "mtu", str(tb.mtu)],
            ["ip", "-n", ns, "addr", "add", f"{topology.SUBNET}.200/24", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up", "promisc", "on"],
            ["ip", "-n", sw, "link", "set", "x", "mtu", str(tb.mtu), "master", "br0", "up"],
            ["ip", "netns", "exec", sw, "tc", "qdisc", "add", "dev", port, "clsact"],
            [*mirror, "ingress", *to_x],
            [*mirror, "egress", *to_x],
        ):
            subprocess.run(cmd, check=True, capture_output=True)
        yield ns
    finally:
        links.kill_processes([ns])
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)


def test_hostile_host_changes_no_sum(tmp_path: Path) -> None:
    with running(topology.Testbed(NAME, workers=4, aggregators=1, rate="1gbit",
                                  mtu=9000)) as tb:
        with attacker_host(tb) as ns:
            stop, report = tmp_path / "stop", tmp_path / "attack.json"
            before = testbed_launch.counters(tb, "a0")
            attacker = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-c", ATTACKER, str(stop), str(report),
                 str(RATE)], env={**os.environ, "PYTHONPATH": str(ROOT)})
            try:
                launch = Launch("mpirun", np=tb.workers, timeout=300,
                                env={"HOSTILE_TENSORS": str(TENSORS), "OMP_NUM_THREADS": "1"})
                outcome = run(ROOT / "tests" / "parallel" / "test_hostile_job.py", launch,
                              tmp_path / "job", runner=lambda argv, env, t: testbed_launch.run(
                                  tb, argv, env=env, timeout=t, capture=True))
            finally:
                stop.touch()
                rc = attacker.wait(timeout=60)
            outcome.check()  # every rank: every result exact, omnireduce each time
            assert rc == 0, "the attacker failed"
            attack = json.loads(report.read_text())
            after = testbed_launch.counters(tb, "a0")
    sent = attack["sent"]
    assert sum(sent.values()) > 200, attack
    assert {"replay to aggregator", "altered to aggregator", "replay to worker",
            "altered to worker", "control to worker", "control to aggregator"} <= set(sent), sent
    drops = {k: after[k] - before[k] for k in ("unauthenticated", "bad_mac", "replayed",
                                                "malformed")}
    assert drops["bad_mac"] > 0 and drops["replayed"] > 0 and drops["unauthenticated"] > 0, drops
    workers = [json.loads((tmp_path / "job" / f"worker{r}.json").read_text())
               for r in range(tb.workers)]
    assert sum(w["bad_mac"] for w in workers) > 0, workers
    assert sum(w["replayed"] for w in workers) > 0, workers
    print(f"attack: {attack}; aggregator drops: {drops}; worker drops: "
          f"{[{k: w[k] for k in ('bad_mac', 'replayed', 'unauthenticated')} for w in workers]}")
