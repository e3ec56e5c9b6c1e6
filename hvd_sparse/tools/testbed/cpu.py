"""CPU budgets: one cgroup per testbed host, so that each host's processes get ``c`` of a core
and can neither starve nor borrow from another (the kernel's CFS bandwidth control, cgroup v1
``cpu`` or v2 ``cpu.max``, whichever the machine has; see `detect`).

Groups are ``hvd-sparse-<testbed>/<host>`` under the controller's mount, plus ``sw`` for the
switch's process (accounted, not capped: it stands for switch hardware). A process joins its
host's group before it runs: launchers start it through `join_script` (``cgjoin HOST CMD..``),
which writes its own pid to the group's ``cgroup.procs`` and execs CMD, so every child it
starts (ranks' threads, aggregators a rank starts) is born inside the budget.

The CFS period (`period_us`): a process that uses up its quota waits for the next period, so a
quota can stall a host for up to ``period x (1 - c)``. The kernel's default 100 ms would stall
a 1/8-core host for 87 ms, longer than many of the calls measured here; 10 ms keeps a stall
under 10 ms. Shorter is no better: the kernel wants a quota of at least 1 ms, and CFS hands out
run time in slices of a few ms (sched_cfs_bandwidth_slice_us, 5 ms), so with quotas below that
a host's time would come in lumps of a whole period anyway. Below c = 0.1 the period grows to
keep the quota at 1 ms (c = 1/24: 24 ms)."""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .topology import Testbed

PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel refuses smaller quotas (v1 and v2)
SWITCH = "sw"  # the group of the emulated switch's process: accounted, no quota


@dataclass(frozen=True)
class Hierarchy:
    """Where the cpu controller is: v2's unified mount, or v1's ``cpu`` mount with ``cpuacct``
    (the same mount when they are mounted together, as most distributions do)."""
    version: int
    cpu: Path
    acct: Path

    def top(self, name: str) -> list[Path]:
        """The testbed's top group in each mount (one path when cpu and cpuacct share one)."""
        return list(dict.fromkeys([self.cpu / f"hvd-sparse-{name}",
                                   self.acct / f"hvd-sparse-{name}"]))


def detect(mountinfo: str = "/proc/self/mountinfo") -> Hierarchy | None:
    """The cpu controller's hierarchy: v2 where the unified mount offers ``cpu`` (pure v2, or a
    hybrid that gave it to v2), else v1's ``cpu`` mount; None when neither is mounted."""
    v1: dict[str, Path] = {}
    v2: Path | None = None
    for line in Path(mountinfo).read_text().splitlines():
        mount, _, tail = line.partition(" - ")
        fields, tail_fields = mount.split(), tail.split()
        if len(fields) < 5 or len(tail_fields) < 3:
            continue
        point, fstype, opts = Path(fields[4]), tail_fields[0], tail_fields[2].split(",")
        if fstype == "cgroup2":
            try:
                if "cpu" in (point / "cgroup.controllers").read_text().split():
                    v2 = point
            except OSError:
                continue
        elif fstype == "cgroup":
            for c in ("cpu", "cpuacct"):
                if c in opts:
                    v1.setdefault(c, point)
    if v2 is not None:
        return Hierarchy(2, v2, v2)
    if "cpu" in v1 and "cpuacct" in v1:
        return Hierarchy(1, v1["cpu"], v1["cpuacct"])
    return None


def require() -> Hierarchy:
    h = detect()
    if h is None:
        raise RuntimeError("testbed: CPU budgets need the cgroup cpu controller (v1 'cpu' and "
                           "'cpuacct' mounts, or cgroup2 offering 'cpu'); none is mounted")
    return h


def cores() -> float:
    """The CPUs this process may run on (its affinity, as a container's cpuset limits it)."""
    return float(len(os.sched_getaffinity(0)))


def auto_share(hosts: int) -> float:
    """c = cores / H: the machine split evenly among the hosts (DieCast's scaling)."""
    return cores() / hosts


def period_us(share: float) -> int:
    """The CFS period for a host of ``share`` cores (module docstring: why 10 ms)."""
    return max(PERIOD_US, math.ceil(round(MIN_QUOTA_US / share, 3)))  # round: 1/24 is inexact


def quota_us(share: float) -> int:
    return max(MIN_QUOTA_US, round(share * period_us(share)))


def group_names(tb: Testbed) -> list[str]:
    return [h.name for h in tb.hosts] + [SWITCH]


def create(tb: Testbed) -> Hierarchy:
    """A group per host with ``tb.cpu_per_host`` cores (the caller removes them on failure)."""
    hier = require()
    share = tb.cpu_per_host
    if not 0 < share <= cores():
        raise ValueError(f"testbed: CPU per host must be in (0, {cores():g}] (the cores this "
                         f"machine gives us), got {share:g}")
    if hier.version == 2:
        # Controllers reach a group only through its parent's subtree_control; the top group
        # holds no process itself, as v2 requires of a group that hands cpu down.
        _enable(hier.cpu / "cgroup.subtree_control")
    for top in hier.top(tb.name):
        top.mkdir(exist_ok=True)
        if hier.version == 2:
            _enable(top / "cgroup.subtree_control")
        for g in group_names(tb):
            (top / g).mkdir(exist_ok=True)
    # The top group competes with the machine's other processes as one scheduling entity: with
    # the default weight its hosts together would get what one process gets (measured: 6 hosts
    # of 0.25 core at 0.045 core each with load 13 on 2 cores). Weighted as its groups' count,
    # they get what as many plain processes would, as ranks without budgets did.
    n = len(group_names(tb))
    if hier.version == 2:
        (hier.cpu / f"hvd-sparse-{tb.name}" / "cpu.weight").write_text(str(min(10_000, 100 * n)))
    else:
        (hier.cpu / f"hvd-sparse-{tb.name}" / "cpu.shares").write_text(str(1024 * n))
    period, quota = period_us(share), quota_us(share)
    for h in tb.hosts:
        d = hier.cpu / f"hvd-sparse-{tb.name}" / h.name
        if hier.version == 2:
            (d / "cpu.max").write_text(f"{quota} {period}")
        else:
            (d / "cpu.cfs_period_us").write_text(str(period))
            (d / "cpu.cfs_quota_us").write_text(str(quota))
    write_join_script(tb, hier)
    return hier


def _enable(subtree_control: Path) -> None:
    if "cpu" not in subtree_control.read_text().split():
        try:
            subtree_control.write_text("+cpu")
        except OSError as e:
            raise RuntimeError(f"testbed: cannot enable the cpu controller in {subtree_control}: "
                               f"{e}") from None


def join_script(tb: Testbed) -> Path:
    return tb.log_dir() / "cgjoin"


def write_join_script(tb: Testbed, hier: Hierarchy) -> None:
    """``cgjoin HOST CMD ARGS..``: joins HOST's group in every mount, then becomes CMD (the
    same pid, so nothing it starts is ever outside the group). A script file rather than
    ``sh -c``: mpirun passes its path and plain words, nothing to quote."""
    lines = ["#!/bin/sh", "# generated by hvd-sparse testbed up: join host $1's CPU budget, "
             "then exec the rest", 'h="$1"; shift']
    for top in hier.top(tb.name):
        lines.append(f'echo $$ > "{top}/$h/cgroup.procs" || exit 125')
    lines.append('exec "$@"')
    path = join_script(tb)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)


def wrap(tb: Testbed, host: str, argv: list[str]) -> list[str]:
    """``argv`` started inside ``host``'s budget (unchanged when the testbed has none)."""
    return [str(join_script(tb)), host, *argv] if tb.cpu_per_host else list(argv)


def _read(path: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}
    except OSError:
        return {}


def usage(tb: Testbed, hier: Hierarchy | None = None) -> dict[str, dict[str, int]]:
    """Per group now: CPU time used (ns), CFS periods elapsed and throttled, time throttled
    (ns). Counts from the group's creation: subtract two readings for an interval."""
    hier = hier or require()
    out = {}
    for g in group_names(tb):
        cpu = hier.cpu / f"hvd-sparse-{tb.name}" / g
        st = _read(cpu / "cpu.stat")
        if hier.version == 2:
            used, throttled = st.get("usage_usec", 0) * 1000, st.get("throttled_usec", 0) * 1000
        else:
            try:
                used = int((hier.acct / f"hvd-sparse-{tb.name}" / g / "cpuacct.usage")
                           .read_text())
            except OSError:
                used = 0
            throttled = st.get("throttled_time", 0)
        out[g] = {"cpu_ns": used, "periods": st.get("nr_periods", 0),
                  "throttled": st.get("nr_throttled", 0), "throttled_ns": throttled}
    return out


def procs(tb: Testbed, group: str, hier: Hierarchy | None = None) -> list[int]:
    """The processes in a host's group (of its cpu mount)."""
    hier = hier or require()
    try:
        text = (hier.cpu / f"hvd-sparse-{tb.name}" / group / "cgroup.procs").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def groups(name: str) -> list[Path]:
    """The cgroups of testbed ``name`` that exist (top groups last)."""
    hier = detect()
    if hier is None:
        return []
    out: list[Path] = []
    for top in hier.top(name):
        if top.is_dir():
            out += [d for d in top.iterdir() if d.is_dir()] + [top]
    return out


def destroy(name: str) -> list[Path]:
    """Removes the groups of testbed ``name``: what still runs in them is ours (it joined them)
    and is killed first, since a group with processes cannot go. Safe to repeat."""
    found = groups(name)
    for d in found:
        deadline = time.monotonic() + 5
        while True:
            try:
                pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
            except OSError:
                pids = []
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)  # killed processes leave their group as they exit
    return found
