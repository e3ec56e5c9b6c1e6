"""The testbed's link faults beyond loss (this kernel has no netem): duplication (nftables
``dup`` on the switch's ports) and reordering (a share of the frames held in a slow HTB class),
checked with numbered UDP datagrams between two worker hosts in both directions, then switched
off again (the ports' plain tbf caps back, nothing duplicated or reordered any more); and the
fault injector (hvd_sparse.tools.testbed.faults) applying and reverting a timed schedule.
Needs root."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hvd_sparse.tools.testbed import faults, lifecycle, loss, topology

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_testbed import running  # noqa: E402

NAME = f"hvf{os.getpid() % 100000}"
COUNT = 3000

# argv: recv|send, own address, peer address. The receiver prints "received distinct
# inversions" (a datagram numbered below the one before it: overtaken) after 2 s of silence;
# it says "ready" once bound, and only then does the sender start.
UDP = textwrap.dedent("""
    import socket, sys
    mode, me, peer, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: root, so no datagram lost
    s.bind((me, 5555))
    if mode == "recv":
        print("ready", flush=True)
        s.settimeout(2)
        got = []
        try:
            while True:
                got.append(int(s.recv(2000).split()[0]))
        except socket.timeout:
            pass
        inv = sum(1 for a, b in zip(got, got[1:]) if b < a)
        print(len(got), len(set(got)), inv)
    else:
        for i in range(count):
            s.sendto(str(i).encode() + b" " * 1200, (peer, 5555))
""")


def exchange(tb: topology.Testbed, src: str, dst: str) -> tuple[int, int, int]:
    """COUNT datagrams from host ``src`` to host ``dst``: (received, distinct, inversions)."""
    a, b = tb.host(src), tb.host(dst)
    recv = subprocess.Popen(["ip", "netns", "exec", b.ns, sys.executable, "-c", UDP, "recv",
                             b.ip, a.ip, str(COUNT)], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
        subprocess.run(["ip", "netns", "exec", a.ns, sys.executable, "-c", UDP, "send", a.ip,
                        b.ip, str(COUNT)], check=True, timeout=60)
        out, _ = recv.communicate(timeout=60)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    got, distinct, inv = map(int, out.split())
    return got, distinct, inv


def qdiscs(tb: topology.Testbed, host: str) -> str:
    return subprocess.run(["ip", "netns", "exec", tb.switch_ns, "tc", "qdisc", "show", "dev",
                           tb.host(host).port], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def testbed():
    with running(topology.Testbed(NAME, workers=2, aggregators=0, rate="1gbit",
                                  mtu=1500)) as tb:
        yield tb


def test_duplication_both_ways(testbed: topology.Testbed) -> None:
    lifecycle.update(testbed, host="w1", dup=0.2)
    try:
        to = exchange(testbed, "w0", "w1")
        back = exchange(testbed, "w1", "w0")
        counted = loss.counted(testbed)
    finally:
        lifecycle.update(testbed, host="w1", dup=0.0)
    for got, distinct, _ in (to, back):
        assert distinct == COUNT, (to, back)
        assert 1.1 * COUNT < got < 1.3 * COUNT, (to, back)  # about a fifth sent twice
    assert counted["duplicated"] > 0.3 * COUNT, counted
    got, distinct, _ = exchange(testbed, "w0", "w1")
    assert got == distinct == COUNT, "still duplicated after the fault was cleared"


def test_reordering_both_ways_and_the_cap_restored(testbed: topology.Testbed) -> None:
    assert "tbf" in qdiscs(testbed, "w1")
    lifecycle.update(testbed, host="w1", reorder=0.2)
    try:
        assert "htb" in qdiscs(testbed, "w1") and "htb" in qdiscs(testbed, "w0")
        to = exchange(testbed, "w0", "w1")
        back = exchange(testbed, "w1", "w0")
        counted = loss.counted(testbed)
    finally:
        lifecycle.update(testbed, host="w1", reorder=0.0)
    for got, distinct, inv in (to, back):
        assert got == distinct == COUNT, (to, back)  # reordered, not lost
        assert inv > 10, (to, back)
    assert counted["reordered"] > 0.3 * COUNT, counted
    assert "tbf" in qdiscs(testbed, "w1") and "htb" not in qdiscs(testbed, "w1")
    got, distinct, inv = exchange(testbed, "w0", "w1")
    assert got == distinct == COUNT and inv == 0, "still reordered after the fault was cleared"


def test_injector_applies_and_reverts_a_schedule(testbed: topology.Testbed) -> None:
    schedule = [faults.Fault("link_down", at=0.0, duration=0.5, host="w1"),
                faults.Fault("loss", at=0.6, duration=0.5, host="w1", rate=0.2),
                faults.Fault("dup", at=1.2, duration=0.5, host="w1", rate=0.1),
                faults.Fault("reorder", at=1.8, duration=0.5, host="w1", rate=0.1)]
    seen: list[tuple[str, bool, float, float]] = []

    def probe() -> None:  # what the testbed's state says while each fault is in force
        while inj.is_alive():
            h = topology.Testbed.load(testbed.name).host("w1")
            seen.append((inj.current, h.down, h.loss, h.dup + h.reorder))
            time.sleep(0.05)

    inj = faults.Injector(testbed.name, schedule)
    inj.start()
    probe()
    inj.join(timeout=30)
    assert not inj.is_alive() and inj.errors == [], inj.errors
    kinds = {k for k, *_ in seen}
    assert {"link_down", "loss", "dup", "reorder"} <= kinds, seen
    assert any(k == "link_down" and down for k, down, *_ in seen), seen
    assert any(k == "loss" and lost == 0.2 for k, _, lost, _ in seen), seen
    assert all(f.start > 0 and f.end >= f.start + f.duration * 0.9 for f in inj.done), inj.done
    h = topology.Testbed.load(testbed.name).host("w1")
    assert (h.down, h.loss, h.dup, h.reorder) == (False, 0.0, 0.0, 0.0)
    got, distinct, inv = exchange(testbed, "w0", "w1")
    assert got == distinct == COUNT and inv == 0


def test_a_lost_worker_is_not_w0_nor_an_aggregator_host() -> None:
    assert faults.Fault("worker_lost", at=0, duration=3, host="w2").label() == \
        "worker_lost w2 3 s"
    for host in ("w0", "a0"):
        with pytest.raises(ValueError, match="other than w0"):
            faults.Fault("worker_lost", at=0, duration=3, host=host)
