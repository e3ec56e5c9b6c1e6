"""IPv6 where hvd-sparse takes addresses: the C++ parser behind the aggregator's --bind
(hvd_sparse._C.parse_endpoint), the aggregator's command line, an aggregator bound to [::]
(dual-stack) summing one job whose workers reach it over IPv6 and over IPv4, and the Python
helpers that resolve names and pick the local address toward a peer (hvd_sparse.session).
IPv6 on loopback (::1) only; the netns testbed's IPv6 run is tests/test_testbed.py's."""
from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from aggregator_helpers import WAIT, assert_result, block_sparse, reference

from hvd_sparse import _C, aggregator, protocol, session


@pytest.mark.unit
@pytest.mark.parametrize("text,want", [
    ("10.0.0.1:9999", ("10.0.0.1", 9999, 4, "10.0.0.1:9999")),
    ("0.0.0.0:0", ("0.0.0.0", 0, 4, "0.0.0.0:0")),
    ("[::]:0", ("::", 0, 6, "[::]:0")),
    ("[FD00:0::1]:65535", ("fd00::1", 65535, 6, "[fd00::1]:65535")),
    # v4-mapped is the IPv4 address: what a dual-stack socket reports for an IPv4 peer
    ("[::ffff:10.0.0.1]:5", ("10.0.0.1", 5, 4, "10.0.0.1:5"))])
def test_parse_endpoint(text, want):
    assert _C.parse_endpoint(text) == want


@pytest.mark.unit
@pytest.mark.parametrize("text,why", [
    ("fd00::1:9999", "takes brackets"), ("[fd00::1]", "port"), ("10.0.0.1", "no port"),
    ("10.0.0.1:65536", "port"), ("10.0.0.1:", "port"), ("[fd00::1]:-1", "port"),
    ("[fe80::1]:9", "link-local"), ("[10.0.0.1]:9", "not an IPv4 or IPv6"),
    ("node1:9", "not an IPv4 or IPv6"), ("[fd00::g]:9", "not an IPv4 or IPv6"),
    (":9", "not an IPv4 or IPv6")])
def test_parse_endpoint_refuses_saying_what_is_accepted(text, why):
    with pytest.raises(ValueError) as e:
        _C.parse_endpoint(text)
    assert why in str(e.value) and "[fd00::1]:9999" in str(e.value) and text in str(e.value)


@pytest.mark.integration
def test_aggregator_listens_on_ipv6(aggs):
    agg = aggs(1, host="::1")
    assert agg.addr == ("::1", agg.port)
    first = agg.log.read_text().splitlines()[0]
    assert first.startswith(f"hvd-sparse aggregator listening on [::1]:{agg.port} "), first


@pytest.mark.integration
@pytest.mark.parametrize("args,why", [
    (["--bind", "fd00::1:9"], "takes brackets"), (["--bind", "[::1]"], "port"),
    (["--bind", "[fe80::1]:9"], "link-local"),
    (["--bind", "[::1]:9", "--transport", "dpdk"], "IPv4 only")])
def test_aggregator_refuses_a_bad_bind(args, why):
    p = subprocess.run([str(aggregator.binary()), *args], capture_output=True, text=True,
                       timeout=30)
    if "built without DPDK" in p.stderr:
        pytest.skip("this aggregator has no DPDK transport to refuse IPv6 with")
    assert p.returncode == 2 and why in p.stderr, p.stderr


@pytest.mark.integration
def test_dual_stack_aggregator_sums_ipv6_and_ipv4_workers():
    """--bind [::]:0 takes IPv6 and IPv4: worker 0 reaches it at ::1, worker 1 at 127.0.0.1,
    one job; each peer is pinned at the address it came from (an IPv4 one as v4-mapped by the
    socket, the same Endpoint as over IPv4), and the sums are exact."""
    agg = aggregator.LocalAggregators(1, 2, "::")
    ws = []
    try:
        port = agg.ports[0]
        ws = [_C.OmniWorker([(host, port)], 0x6, r, 2, payload_bytes=1024,
                            slots_per_aggregator=4, key=b"") for r, host in
              enumerate(("::1", "127.0.0.1"))]
        for w in ws:
            w.register(15.0)
        rng = np.random.default_rng(6)
        ins = [block_sparse(rng, 64 * 500 + 3, 64, 0.3, torch.float32) for _ in ws]
        outs = [torch.zeros_like(x) for x in ins]
        tickets = [w.submit(5, x, o, 64, 7, None, "t", 1.0)
                   for w, x, o in zip(ws, ins, outs, strict=True)]
        for w, t in zip(ws, tickets, strict=True):
            assert w.wait(t, WAIT)
            w.finish(t)
        for r, out in enumerate(outs):
            assert_result(out, reference(ins), f"worker {r}")
    finally:
        for w in ws:
            w.close()
        agg.stop()


@pytest.mark.integration
def test_resolve_prefers_ipv4_then_ipv6():
    """As the worker engine resolves (csrc/omni/worker/worker.cpp): a probe that compares
    addresses must see the same one."""
    assert session.resolve("::1") == "::1" and session.resolve("[::1]") == "::1"
    assert session.resolve("127.0.0.1") == "127.0.0.1"
    import socket
    families = {i[0] for i in socket.getaddrinfo("localhost", None)}
    if socket.AF_INET in families:
        assert session.resolve("localhost") == "127.0.0.1"
    with pytest.raises(OSError):
        session.resolve("no-such-host.invalid")


@pytest.mark.integration
@pytest.mark.parametrize("host,bind", [("::1", "::1"), ("127.0.0.1", "127.0.0.1"),
                                       ("fd00::5", "::"), ("10.9.9.9", "0.0.0.0"),
                                       ("no-such-host.invalid", "0.0.0.0")])
def test_local_aggregators_bind_the_family_of_their_address(host, bind):
    """Loopback: that address alone; else every address of the family (:: takes IPv4 too); a
    name only the workers resolve: every IPv4 address, as before IPv6."""
    assert session._bind_address(host) == bind


@pytest.mark.integration
@pytest.mark.parametrize("peer", ["::1", "127.0.0.1"])
def test_address_toward_a_peer_of_either_family(peer):
    assert session._address_toward([[peer]]) == peer


@pytest.mark.integration
def test_path_mtu_over_ipv6_counts_its_40_byte_header():
    mtu = int(Path("/sys/class/net/lo/mtu").read_text())
    assert session._max_datagram("::1", 9) == min(protocol.MAX_DATAGRAM, mtu - 48)
    assert session._max_datagram("127.0.0.1", 9) == min(protocol.MAX_DATAGRAM, mtu - 28)


@pytest.mark.integration
def test_whereabouts_lists_addresses_peers_can_use():
    """IPv4 first, then IPv6; neither loopback nor link-local (no interface to name)."""
    addrs = [ipaddress.ip_address(a) for a in session._whereabouts()[2]]
    assert not any(a.is_loopback or a.is_link_local for a in addrs), addrs
    versions = [a.version for a in addrs]
    assert versions == sorted(versions), addrs


@pytest.mark.unit
def test_an_ipv6_testbed_gives_hosts_ipv6_addresses_and_refuses_ipv4_only_parts():
    from hvd_sparse.tools.testbed import loss, topology

    tb = topology.Testbed("v6unit", workers=2, aggregators=2, ipv6=True)
    assert [h.ip6 for h in tb.hosts] == ["fd77::1", "fd77::2", "fd77::101", "fd77::102"]
    assert tb.aggregator_addresses() == "[fd77::101]:9999,[fd77::102]:9999"
    assert topology.Testbed("v4unit", workers=1).hosts[0].ip6 == ""
    tb.hosts[1].dup = 0.5  # copies of frames to w1 are chosen by either of its addresses
    rules = loss._dup_table(tb, "")
    assert "ip daddr 10.77.0.2 " in rules and "ip6 daddr fd77::2 " in rules, rules
    for kw in ({"switch": "emu"}, {"transport": "dpdk"}):
        with pytest.raises(ValueError, match="IPv4"):
            topology.Testbed("v6unit", ipv6=True, **kw)
