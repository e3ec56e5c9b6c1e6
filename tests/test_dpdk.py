"""The DPDK transport: the aggregator on an af_packet vdev on its host's veth in the netns
testbed, kernel-UDP workers (3 worker hosts, 1 Gbit/s, MTU 9000). Needs root and an aggregator
built with DPDK (make dev, which make test runs, installs libdpdk-dev): both hold in CI, so
neither is skipped."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_testbed import run_job, running

from hvd_sparse.aggregator import binary
from hvd_sparse.tools.testbed import launch, links, topology

NAME = f"hvd{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def testbed():
    with running(topology.Testbed(NAME, workers=3, aggregators=1, rate="1gbit", mtu=9000,
                                  loss_proto="udp", transport="dpdk")) as tb:
        yield tb


def test_dpdk_aggregator_with_kernel_udp_workers(testbed: topology.Testbed,
                                                 tmp_path: Path) -> None:
    log = (testbed.log_dir() / "a0.log").read_text()
    assert "transport=dpdk" in log, log
    before = launch.counters(testbed, "a0")
    junk_sent = run_job(testbed, "test_dpdk_job.py", tmp_path).props(0)["junk_sent"]
    after = launch.counters(testbed, "a0")
    d = {k: after[k] - before[k] for k in after}
    assert d["rounds"] > 0 and d["tx_packets"] > 0, d
    # Every junk datagram reached the DPDK aggregator's core and was counted, none crashed it.
    assert d["malformed"] >= junk_sent > 0, d
    assert d["mismatch"] == 0, d
    assert testbed.pids["a0"] in links.pids_in(testbed.host("a0").ns)


def test_bad_eal_arguments_fail_with_a_clear_error() -> None:
    proc = subprocess.run(
        [str(binary()), "--transport", "dpdk", "--bind", "10.9.9.9:9999", "--dpdk",
         "--no-huge --no-pci -m 64 --no-shconf --file-prefix=hvdbad --log-level=error "
         "--vdev=net_af_packet0,iface=no-such-if0"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert "hvd-sparse aggregator: dpdk:" in proc.stderr, proc.stderr
    unbound = subprocess.run([str(binary()), "--transport", "dpdk", "--bind", "0.0.0.0:0"],
                             capture_output=True, text=True, timeout=60)
    assert unbound.returncode == 2 and "explicit --bind" in unbound.stderr, unbound.stderr


# From a worker host: datagrams to the aggregator with the right UDP checksum, none (0, allowed
# over IPv4) and a broken one, `count` times each. argv: aggregator ip, port, count.
BAD_CHECKSUMS = """
import sys
from scapy.all import Ether, IP, UDP, Raw, getmacbyip, sendp
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mac = getmacbyip(ip)
for i in range(n):
    for chksum in (None, 0, 0x1234):  # scapy's (right), none, broken
        sendp(Ether(dst=mac) / IP(dst=ip) / UDP(sport=40000, dport=port, chksum=chksum)
              / Raw(b"x" * 40), iface="eth0", verbose=False)
"""


def test_dpdk_aggregator_drops_broken_udp_checksums(testbed: topology.Testbed) -> None:
    """Datagrams whose UDP checksum fails are dropped and counted (rx_bad_checksum), never
    parsed; those with a right checksum reach the core (malformed: 40 bytes of junk)."""
    before = launch.counters(testbed, "a0")
    host, port = testbed.aggregator_addresses().split(",")[0].split(":")
    subprocess.run(["ip", "netns", "exec", testbed.host("w0").ns, sys.executable, "-c",
                    BAD_CHECKSUMS, host, port, "5"], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    after = launch.counters(testbed, "a0")
    d = {k: after[k] - before[k] for k in after}
    assert d["rx_bad_checksum"] == 5 and d["malformed"] == 10, d
