"""Bringing a testbed up, changing it while jobs run, and taking it down without leftovers."""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import time

from . import cpu, launch, links, loss, names
from .topology import SUBNET, Testbed, parse_rate


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError("hvd-sparse testbed needs root (network namespaces, veths, tc "
                              "and nftables): run it as root or with sudo")


def up(tb: Testbed) -> Testbed:
    """Creates the namespaces, links, loss rules and aggregators of ``tb``; on any failure
    removes what it made and raises."""
    require_root()
    if links.namespaces(tb.name) or Testbed.state_path(tb.name).exists():
        raise FileExistsError(f"testbed {tb.name!r} is already up: `hvd-sparse testbed down "
                              f"--name {tb.name}` first, or pick another --name")
    try:
        tb.save()  # first, so that `down` finds it even if we crash half-way
        if tb.cpu_per_host:
            cpu.create(tb)  # before any process: each starts inside its host's budget
        links.create(tb)
        names.write(tb)
        launch.start_switch(tb)  # before the loss: the emulated switch applies it itself
        loss.apply(tb)
        launch.start_aggregators(tb)
        tb.save()
    except BaseException:
        down(tb.name)
        raise
    return tb


def update(tb: Testbed, host: str | None = None, loss_rate: float | None = None,
           rate: str | None = None, link_up: bool | None = None,
           dup: float | None = None, reorder: float | None = None) -> Testbed:
    """Changes loss, rate, link state, duplication or reordering of one host (or loss of every
    port) in a running testbed; jobs running on it see the change at once.

    Args:
        tb: the testbed (as ``Testbed.load`` gives it); saved with the change.
        host: the host ("w0", "a0", ...); None: every port (loss, rate only).
        loss_rate: share of the frames to and from the host dropped, in [0, 1).
        rate: the link's rate ("1gbit").
        link_up: False cuts the host's link at the switch, True restores it.
        dup: share of the frames to and from the host the switch sends twice, in [0, 1).
        reorder: share of the frames to and from the host held back behind the others, in
            [0, 1).

    Returns:
        ``tb``, changed.

    Raises:
        PermissionError: not root.
        ValueError: a share out of range, or duplication/reordering without a host or on the
            emulated switch.
        RuntimeError: nft or tc failed.
    """
    require_root()
    target = tb.host(host) if host else None
    for what, share in (("dup", dup), ("reorder", reorder)):
        if share is None:
            continue
        if not 0 <= share < 1:
            raise ValueError(f"{what} must be in [0, 1), got {share}")
        if target is None:
            raise ValueError(f"{what} needs --host")
    if dup is not None or reorder is not None:
        assert target is not None
        before = any(h.reorder > 0 for h in tb.hosts)
        target.dup = target.dup if dup is None else dup
        target.reorder = target.reorder if reorder is None else reorder
        if before != any(h.reorder > 0 for h in tb.hosts):
            links.shape(tb)  # the ports' slow class, or their plain cap again
        if loss_rate is None:
            loss.apply(tb)
    if loss_rate is not None:
        if not 0 <= loss_rate < 1:
            raise ValueError(f"loss must be in [0, 1), got {loss_rate}")
        if target:
            target.loss = loss_rate
        else:
            tb.loss = loss_rate
        loss.apply(tb)
    if rate is not None:
        htb = any(h.reorder > 0 for h in tb.hosts)  # the switch's side: shape() sets it
        for h in [target] if target else tb.hosts:
            links.set_rate(tb, h, parse_rate(rate), sides=((h.ns, "eth0"),) if htb else ())
            h.rate = rate
        if not target:
            tb.rate = rate
        if htb:
            links.shape(tb)
    if link_up is not None:
        if target is None:
            raise ValueError("link up/down needs --host")
        links.set_link(tb, target, link_up)
        target.down = not link_up
    tb.save()
    return tb


def move(tb: Testbed, host: str, ip: str) -> Testbed:
    """Reschedules aggregator host ``host`` as Kubernetes does a StatefulSet's pod: its
    aggregator killed, the host readdressed to ``ip``, the aggregator started again there (same
    port, same secret). Its name (``a0.<testbed>``, names.py) follows: jobs that name their
    aggregators so (``aggregator_addresses(by_name=True)``) find it again; jobs given its old
    address lose it.

    Args:
        tb: the testbed (as ``Testbed.load`` gives it); saved with the change.
        host: an aggregator host ("a0", ...).
        ip: its new address, unused, in the testbed's subnet.

    Returns:
        ``tb``, changed.

    Raises:
        PermissionError: not root.
        ValueError: not an aggregator host, an address taken or outside the subnet, or a
            testbed whose hosts' addresses are bound elsewhere (DPDK, the emulated switch) or
            whose jobs reach aggregators over IPv6.
        RuntimeError: the aggregator did not start at its new address.
    """
    require_root()
    h = tb.host(host)
    if h not in tb.aggregator_hosts:
        raise ValueError(f"move: {host} is not an aggregator host")
    net = ipaddress.ip_network(f"{SUBNET}.0/24")
    if ipaddress.ip_address(ip) not in net or ip in (f"{SUBNET}.0", f"{SUBNET}.255"):
        raise ValueError(f"move: {ip} is not a host address of the testbed's subnet {net}")
    if ip in [x.ip for x in tb.hosts] + [tb.switch_address.split(":")[0]]:
        raise ValueError(f"move: {ip} is taken")
    if tb.transport != "udp" or tb.switch != "bridge" or tb.ipv6:
        # DPDK processes own their host's address and the emulated switch binds each host's;
        # the names are the IPv4 addresses'
        raise ValueError("move: only with kernel UDP aggregators behind the bridge, over IPv4")
    if pid := tb.pids.pop(h.name, None):
        _kill(pid)
    links.readdress(h, ip)
    h.ip = ip
    loss.apply(tb)  # its rules match addresses
    names.write(tb)
    tb.save()  # the new address, before a process that `down` must find
    launch.start_aggregator(tb, h.name)
    tb.save()
    return tb


def _kill(pid: int, wait: float = 5.0) -> None:
    """SIGKILL, then until it has ended (reaped here if it is our child)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait
    while not links.ended(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"testbed: process {pid} outlived SIGKILL for {wait:g} s")
        time.sleep(0.01)
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # another process's child: its parent reaps it
        pass


def down(name: str) -> list[str]:
    """Removes testbed ``name``: its processes, namespaces, veths, CPU budgets (cgroups) and
    state. Safe to repeat and after a crash; touches nothing outside the testbed's own names."""
    require_root()
    removed = links.destroy(name)
    cpu.destroy(name)  # after the processes: a group with processes cannot be removed
    names.remove(name)
    Testbed.state_path(name).unlink(missing_ok=True)
    shutil.rmtree(Testbed(name).log_dir(), ignore_errors=True)  # /run is memory: no leftovers
    return removed
