"""Namespaces, veths, the switch's bridge and the rate caps, through netlink (pyroute2).

Every host is a namespace ``<name>-<host>`` with one ``eth0``, a veth whose other end is port
``<host>`` of the bridge in ``<name>-sw``. Both ends carry a tbf rate cap, so each link is
capped in both directions (netem, which could add delay and loss, does not exist on this
kernel: loss is the switch's nftables rules, see loss.py)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from pyroute2 import IPRoute, NetNS, netns

from .topology import Host, Testbed, parse_rate


def _tbf_args(rate_bps: int) -> dict:
    # Burst: large enough for a GSO super-packet, and a couple of ms of the rate at high rates
    # (tbf refills on timers). Queue: 50 ms of the rate. With 10 ms (1.25 MB at 1 Gbit/s)
    # three MPI senders into one port lost so many TCP segments in a row that an allgather
    # stalled past 30 s on exponential retransmission backoff (incast collapse).
    burst = max(256 * 1024, rate_bps // 8 // 500)
    return {"rate": f"{rate_bps}bit", "burst": burst, "latency": "50ms"}


def _cap(ns: NetNS, index: int, rate_bps: int) -> None:
    ns.tc("replace", "tbf", index=index, handle="1:", **_tbf_args(rate_bps))


def create(tb: Testbed) -> None:
    """Builds the testbed's namespaces and links (the caller removes them on failure)."""
    netns.create(tb.switch_ns)
    bridge = tb.switch == "bridge"  # else the emulated switch owns the ports (launch.start_switch)
    with NetNS(tb.switch_ns) as sw:
        if bridge:
            sw.link("add", ifname="br0", kind="bridge")
        for ifname in ("lo", "br0") if bridge else ("lo",):
            sw.link("set", index=sw.link_lookup(ifname=ifname)[0], state="up")
    for i, h in enumerate(tb.hosts):
        netns.create(h.ns)
        host_end, sw_end = f"{tb.name}{i}h", f"{tb.name}{i}s"  # unique in the root namespace
        with IPRoute() as ipr:
            ipr.link("add", ifname=host_end, kind="veth", peer=sw_end)
            ipr.link("set", index=ipr.link_lookup(ifname=host_end)[0], net_ns_fd=h.ns)
            ipr.link("set", index=ipr.link_lookup(ifname=sw_end)[0], net_ns_fd=tb.switch_ns)
        with NetNS(h.ns) as ns:
            idx = ns.link_lookup(ifname=host_end)[0]
            ns.link("set", index=idx, ifname="eth0", mtu=tb.mtu)
            ns.addr("add", index=idx, address=h.ip, prefixlen=24)
            for j in (idx, ns.link_lookup(ifname="lo")[0]):
                ns.link("set", index=j, state="up")
            _cap(ns, idx, tb.rate_bps)
        if h.ip6:  # nodad: usable at once, not after duplicate address detection's second
            _ip(h.ns, "-6", "addr", "add", f"{h.ip6}/64", "dev", "eth0", "nodad")
        with NetNS(tb.switch_ns) as sw:
            idx = sw.link_lookup(ifname=sw_end)[0]
            sw.link("set", index=idx, ifname=h.port, mtu=tb.mtu,
                    **({"master": sw.link_lookup(ifname="br0")[0]} if bridge else {}))
            sw.link("set", index=idx, state="up")
            _cap(sw, idx, tb.rate_bps)
        # A DPDK process (the emulated switch, DPDK aggregators) reads frames through a packet
        # socket and verifies their UDP checksums: hosts must compute them, not leave them to
        # an offload
        if not bridge or tb.transport == "dpdk":
            disable_offloads(h.ns, "eth0")
        if not bridge:
            disable_offloads(tb.switch_ns, h.port)


def _ip(ns_name: str, *args: str) -> None:
    cmd = ["ip", "-n", ns_name, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if p.returncode != 0:
        raise RuntimeError(f"testbed: {' '.join(cmd)}: {p.stderr.strip()}")


def disable_offloads(ns_name: str, ifname: str) -> None:
    """Frames leave ``ifname`` whole and checksummed: no segmentation or checksum offload, no
    receive coalescing. A packet socket (af_packet, as the emulated switch uses) sees frames as the
    kernel holds them: a 64 KB TSO or GRO super-frame, or a checksum left to an offload that
    veths never do, would reach the next host broken."""
    cmd = ["ip", "netns", "exec", ns_name, "ethtool", "-K", ifname, "tx", "off", "sg", "off",
           "tso", "off", "gso", "off", "gro", "off"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except FileNotFoundError as e:
        raise RuntimeError("testbed: --switch emu needs ethtool (make build installs it)") from e
    if p.returncode != 0:
        raise RuntimeError(f"testbed: {' '.join(cmd)}: {p.stderr.strip()}")


def mac(ns_name: str) -> str:
    """The MAC address of a host's eth0."""
    with NetNS(ns_name) as ns:
        return ns.get_links(ns.link_lookup(ifname="eth0")[0])[0].get_attr("IFLA_ADDRESS")


def set_rate(tb: Testbed, host: Host, rate_bps: int,
             sides: tuple[tuple[str, str], ...] = ()) -> None:
    """Caps ``host``'s link at ``rate_bps`` (tbf), both ends, or the (namespace, interface)
    ``sides`` given."""
    for ns_name, ifname in sides or ((host.ns, "eth0"), (tb.switch_ns, host.port)):
        with NetNS(ns_name) as ns:
            _cap(ns, ns.link_lookup(ifname=ifname)[0], rate_bps)


def _tc(ns_name: str, *args: str, check: bool = True) -> None:
    cmd = ["ip", "netns", "exec", ns_name, "tc", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if check and p.returncode != 0:
        raise RuntimeError(f"testbed: {' '.join(cmd)}: {p.stderr.strip()}")


def shape(tb: Testbed) -> None:
    """The switch ports' qdiscs for the hosts' reordering: while any host reorders, every
    port's rate cap is an HTB of two classes, ``1:1`` at the port's rate (every frame, by
    default) and ``1:2`` at a tenth of it, where the frames the forward chain marked wait
    (loss.py); otherwise the tbf cap alone, as ``create`` made it."""
    reorder = any(h.reorder > 0 for h in tb.hosts)
    for h in tb.hosts:
        bps = parse_rate(h.rate or tb.rate)
        _tc(tb.switch_ns, "qdisc", "del", "dev", h.port, "root", check=False)
        if not reorder:
            set_rate(tb, h, bps, sides=((tb.switch_ns, h.port),))
            continue
        burst = _tbf_args(bps)["burst"]
        _tc(tb.switch_ns, "qdisc", "add", "dev", h.port, "root", "handle", "1:", "htb",
            "default", "1")
        for cls, rate in (("1:1", bps), ("1:2", max(bps // 10, 1_000_000))):
            _tc(tb.switch_ns, "class", "add", "dev", h.port, "parent", "1:", "classid", cls,
                "htb", "rate", f"{rate}bit", "burst", str(burst), "quantum", "60000")


def set_link(tb: Testbed, host: Host, up: bool) -> None:
    """Cuts (or restores) a host's link at the switch, as a pulled cable would."""
    with NetNS(tb.switch_ns) as sw:
        sw.link("set", index=sw.link_lookup(ifname=host.port)[0], state="up" if up else "down")


def flush_addresses(ns_name: str) -> None:
    """Removes the IPv4 addresses of a host's eth0 (the link stays up): for a DPDK process that
    owns the address on that link."""
    with NetNS(ns_name) as ns:
        ns.flush_addr(index=ns.link_lookup(ifname="eth0")[0], family=2)


def readdress(host: Host, ip: str) -> None:
    """Gives a host's eth0 address ``ip`` in place of its own (``host.ip``)."""
    with NetNS(host.ns) as ns:
        idx = ns.link_lookup(ifname="eth0")[0]
        # in this order: removing a subnet's primary address removes its secondaries too
        ns.addr("del", index=idx, address=host.ip, prefixlen=24)
        ns.addr("add", index=idx, address=ip, prefixlen=24)


def counters(tb: Testbed) -> dict[str, dict[str, int]]:
    """Per host: bytes and packets its eth0 received and sent (the host's side of its link)."""
    out = {}
    for h in tb.hosts:
        with NetNS(h.ns) as ns:
            s = ns.get_links(ns.link_lookup(ifname="eth0")[0])[0].get("stats64")
            out[h.name] = {k: int(s.get(k)) for k in
                           ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_dropped",
                            "tx_dropped")}
    return out


def is_namespace_of(name: str, ns: str) -> bool:
    """Whether ``ns`` is a namespace name of testbed ``name`` (its exact naming pattern)."""
    return re.fullmatch(rf"{re.escape(name)}-(sw|w\d+|a\d+)", ns) is not None


def namespaces(name: str) -> list[str]:
    """The namespaces of testbed ``name`` that exist."""
    return [n for n in netns.listnetns() if is_namespace_of(name, n)]


def pids_in(ns_name: str) -> list[int]:
    """Processes whose network namespace is ``ns_name``."""
    try:
        ino = os.stat(f"/run/netns/{ns_name}").st_ino
    except FileNotFoundError:
        return []
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.stat(d / "ns" / "net").st_ino == ino:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def kill_processes(ns_names: list[str]) -> None:
    """Ends every process in these namespaces: SIGTERM, then SIGKILL after 3 s."""
    pids = [p for n in ns_names for p in pids_in(n) if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if not ended(p)]
            time.sleep(0.02)


def destroy(name: str) -> list[str]:
    """Removes every namespace of testbed ``name`` and what lives in it (processes first:
    a namespace with processes outlives its name, and so would its veths). Returns them."""
    found = namespaces(name)
    kill_processes(found)
    for n in found:
        netns.remove(n)
    # Namespaces die asynchronously; veths still in the root namespace (a crash between
    # creating and moving them) go by their names.
    with IPRoute() as ipr:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = [link for link in ipr.get_links() if _ours(name, link.get("ifname"))]
            if not left:
                break
            for link in left:
                try:
                    ipr.link("del", index=link["index"])
                except Exception:  # noqa: BLE001 - already going with its namespace
                    pass
            time.sleep(0.05)
    return found


def _ours(name: str, ifname: str | None) -> bool:
    return bool(ifname and re.fullmatch(rf"{re.escape(name)}\d+[hs]", ifname))


def ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (ended, not yet reaped by its parent)."""
    try:  # the last ") ": a command name may hold one
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True
