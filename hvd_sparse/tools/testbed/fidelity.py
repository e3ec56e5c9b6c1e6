"""What bound a run on the testbed: each host's CPU time (its cgroup, cpu.py) next to its link's
utilisation (bytes on its switch port over time, against the port's rate), sampled while the
run goes, and a verdict a script can test:

    with fidelity.Monitor(tb) as m:
        launch.run(tb, cmd)
    m.report["verdict"]  # "link-bound", "CPU-bound", "mixed" or "neither"

An interval is link-bound when some link carries >= 95% of its cap in either direction,
CPU-bound when some host used >= 95% of its CPU budget, starved when neither holds while all the
machine's cores were busy (the budget is a cap, not a guarantee: other work on a shared machine
takes from it). A run counts as evidence for a scale claim (``report["evidence"]``) only when
link-bound and (almost) never CPU-bound nor starved: then the hosts' small budgets did not set
its pace, the links did, and it scales by 1/c (docs/SCALE.md).
A rank may use a Monitor around each of its own calls (root, any namespace of the testbed)."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from itertools import pairwise
from pathlib import Path

from pyroute2 import netns

from . import cpu
from .topology import Testbed, parse_rate

AT_CAP = 0.95  # a link or a host budget this full is the bound
BUSY = 0.10  # intervals where no link nor host budget is this full are idle: not counted
CPU_BOUND_MAX = 0.05  # evidence: at most this fraction of busy intervals CPU-bound


class PortCounters:
    """Byte counters of the switch's ports (one per host, named as the host): /proc/net/dev
    as the switch namespace sees it, opened once there; each read is one pread (tens of us),
    where a netlink dump through pyroute2 costs ms."""

    def __init__(self, tb: Testbed) -> None:
        netns.pushns(tb.switch_ns)  # this thread only; the file stays bound to that namespace
        try:
            self.fd = os.open("/proc/thread-self/net/dev", os.O_RDONLY)
        finally:
            netns.popns()

    def read(self) -> dict[str, tuple[int, int, int, int]]:
        """Port -> (rx bytes, tx bytes, rx dropped, tx dropped) at the switch's side: a port's rx
        is its host's transmit."""
        out = {}
        for line in os.pread(self.fd, 1 << 20, 0).decode().splitlines()[2:]:
            name, _, rest = line.partition(":")
            f = rest.split()
            out[name.strip()] = (int(f[0]), int(f[8]), int(f[3]), int(f[11]))
        return out

    def close(self) -> None:
        os.close(self.fd)


def qdisc_drops(tb: Testbed) -> dict[str, int]:
    """Frames each switch port's rate cap (tbf) dropped, toward its host: queue overflow at the
    cap, which incast explains; drops anywhere else are not explained by the links."""
    p = subprocess.run(["ip", "netns", "exec", tb.switch_ns, "tc", "-s", "-j", "qdisc", "show"],
                       capture_output=True, text=True, timeout=10)
    try:
        return {q["dev"]: int(q.get("drops", 0)) for q in json.loads(p.stdout or "[]")
                if q.get("kind") == "tbf"}
    except (ValueError, KeyError):
        return {}


def machine() -> tuple[int, int]:
    """(busy, total) jiffies of all the machine's CPUs (/proc/stat): other work on it too."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


class Monitor:
    """Samples every ``interval`` seconds from start (or ``with``) to stop; ``report`` is the
    dict `summarize` makes of the samples."""

    def __init__(self, tb: Testbed, interval: float = 0.1) -> None:
        self.tb, self.interval = tb, interval
        self.hier = cpu.detect() if tb.cpu_per_host else None
        self.samples: list[dict] = []
        self.report: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ports: PortCounters | None = None
        self._drops: dict[str, int] = {}

    def sample(self) -> dict:
        assert self._ports is not None
        t0 = time.monotonic()
        s = {"links": self._ports.read(), "machine": machine(),
             "cpu": cpu.usage(self.tb, self.hier) if self.hier else {}}
        s["t"] = (t0 + time.monotonic()) / 2  # the reads take a while on a loaded machine
        return s

    def start(self) -> Monitor:
        self._ports = PortCounters(self.tb)
        self._drops = qdisc_drops(self.tb)
        self.samples = [self.sample()]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self.sample())

    def stop(self) -> dict:
        self._stop.set()
        if self._thread:
            self._thread.join()
        if self._ports:
            self.samples.append(self.sample())
            self._ports.close()
            self._ports = None
            after = qdisc_drops(self.tb)
            drops = {k: v - self._drops.get(k, 0) for k, v in after.items()}
            self.report = summarize(self.tb, self.samples, drops)
        return self.report

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def emulated(tb: Testbed) -> str:
    """The cluster the testbed stands for, stated plainly (CPU per host : link rate)."""
    hosts = f"{len(tb.hosts)} hosts"
    if not tb.cpu_per_host:
        return f"{hosts}, no CPU budgets (they share the machine's cores), {tb.rate} links"
    c = tb.cpu_per_host
    one = parse_rate(tb.rate) / c
    return (f"{hosts} of {c:.3g} core : {tb.rate} links, standing for hosts of 1 core : "
            f"{one / 1e9:.3g} Gbit/s links (times x {c:.3g})")


def summarize(tb: Testbed, samples: list[dict], drops: dict[str, int] | None = None) -> dict:
    """Per host: CPU seconds against its budget, link bytes and utilisation (mean over the run,
    and the fullest interval); per run: the share of busy intervals that were link-bound or
    CPU-bound, and the verdict."""
    c = tb.cpu_per_host
    rates = {h.name: parse_rate(h.rate or tb.rate) for h in tb.hosts}
    hosts = {h.name: {"tx_bytes": 0, "rx_bytes": 0, "cpu_s": 0.0, "peak_tx": 0.0, "peak_rx": 0.0,
                      "peak_cpu": 0.0, "intervals_at_cap": 0, "intervals_cpu_bound": 0}
             for h in tb.hosts}
    busy = link_bound = cpu_bound = starved = 0
    for a, b in pairwise(samples):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        at_link = at_cpu = False
        idle = True
        for name, h in hosts.items():
            (rx0, tx0, *_), (rx1, tx1, *_) = a["links"].get(name, (0,) * 4), \
                b["links"].get(name, (0,) * 4)
            # the switch port's rx is what the host sent
            sent, got = rx1 - rx0, tx1 - tx0
            h["tx_bytes"] += sent
            h["rx_bytes"] += got
            u_tx, u_rx = sent * 8 / dt / rates[name], got * 8 / dt / rates[name]
            h["peak_tx"], h["peak_rx"] = max(h["peak_tx"], u_tx), max(h["peak_rx"], u_rx)
            used = 0.0
            if c and name in b["cpu"]:
                used = (b["cpu"][name]["cpu_ns"] - a["cpu"][name]["cpu_ns"]) / 1e9 / dt / c
                h["peak_cpu"] = max(h["peak_cpu"], used)
            if max(u_tx, u_rx) >= AT_CAP:
                h["intervals_at_cap"] += 1
                at_link = True
            if used >= AT_CAP:
                h["intervals_cpu_bound"] += 1
                at_cpu = True
            if max(u_tx, u_rx, used) >= BUSY:
                idle = False
        if not idle:
            busy += 1
            link_bound += at_link
            cpu_bound += at_cpu
            # Neither bound while the machine's cores were all busy: its other work (or the
            # switch, the launcher) took the hosts' time, and the run measured the machine
            (m0, t0), (m1, t1) = a.get("machine", (0, 0)), b.get("machine", (0, 0))
            if t1 > t0 and (m1 - m0) / (t1 - t0) >= AT_CAP and not at_link and not at_cpu:
                starved += 1
    wall = samples[-1]["t"] - samples[0]["t"] if len(samples) > 1 else 0.0
    first, last = samples[0], samples[-1]
    for name, h in hosts.items():
        h["rate"] = rates[name]
        h["tx_util"] = h["tx_bytes"] * 8 / wall / rates[name] if wall else 0.0
        h["rx_util"] = h["rx_bytes"] * 8 / wall / rates[name] if wall else 0.0
        d0, d1 = first["links"].get(name, (0,) * 4), last["links"].get(name, (0,) * 4)
        h["port_drops"] = (d1[2] - d0[2]) + (d1[3] - d0[3])
        h["cap_drops"] = (drops or {}).get(name, 0)
        if c and name in last["cpu"]:
            u0, u1 = first["cpu"][name], last["cpu"][name]
            h["cpu_s"] = (u1["cpu_ns"] - u0["cpu_ns"]) / 1e9
            h["budget_s"] = c * wall
            h["cpu_of_budget"] = h["cpu_s"] / h["budget_s"] if wall else 0.0
            h["periods"] = u1["periods"] - u0["periods"]
            h["throttled"] = u1["throttled"] - u0["throttled"]
            h["throttled_s"] = (u1["throttled_ns"] - u0["throttled_ns"]) / 1e9
    link_frac = link_bound / busy if busy else 0.0
    cpu_frac = cpu_bound / busy if busy else 0.0
    starved_frac = starved / busy if busy else 0.0
    if link_frac and cpu_frac <= CPU_BOUND_MAX:
        verdict = "link-bound"
    elif cpu_frac and not link_frac:
        verdict = "CPU-bound"
    elif cpu_frac:
        verdict = "mixed"
    else:
        verdict = "neither"  # no link and no host at its cap: latency, or waiting
    out = {"emulated": emulated(tb), "cpu_per_host": c, "seconds": wall,
           "interval_s": (wall / (len(samples) - 1)) if len(samples) > 1 else 0.0,
           "busy_intervals": busy, "link_bound": link_frac, "cpu_bound": cpu_frac,
           "starved": starved_frac, "verdict": verdict,
           "evidence": verdict == "link-bound" and starved_frac <= CPU_BOUND_MAX, "hosts": hosts}
    if c:
        period = cpu.period_us(c)
        out["cfs_period_ms"] = period / 1000
        out["max_stall_ms"] = (period - cpu.quota_us(c)) / 1000
        sw0, sw1 = first["cpu"].get(cpu.SWITCH), last["cpu"].get(cpu.SWITCH)
        if sw0 and sw1:
            out["switch_cpu_s"] = (sw1["cpu_ns"] - sw0["cpu_ns"]) / 1e9
    return out


def format_report(r: dict) -> str:
    """The report as a few lines of text (``testbed run`` prints it)."""
    lines = [f"testbed: {r['emulated']}",
             f"{r['seconds']:.2f} s; of {r['busy_intervals']} busy intervals "
             f"{100 * r['link_bound']:.0f}% link-bound (a link >= {100 * AT_CAP:.0f}% of its "
             f"cap), {100 * r['cpu_bound']:.0f}% CPU-bound (a host >= {100 * AT_CAP:.0f}% of "
             f"its budget), {100 * r['starved']:.0f}% starved (the machine's cores all busy, "
             f"neither at its cap): {r['verdict']}"
             + ("" if r["evidence"] else " (not evidence for a scale claim)")]
    if "cfs_period_ms" in r:
        lines.append(f"CFS period {r['cfs_period_ms']:g} ms: a host at its quota waits up to "
                     f"{r['max_stall_ms']:g} ms" + (f"; switch CPU {r['switch_cpu_s']:.2f} s"
                                                    if "switch_cpu_s" in r else ""))
    lines.append("host  cpu s  of budget  peak  throttled  tx MB  tx util  rx MB  rx util  "
                 "peak link  drops")
    for name, h in r["hosts"].items():
        cpu_cols = (f"{h['cpu_s']:6.2f}  {100 * h['cpu_of_budget']:8.0f}%  "
                    f"{100 * h['peak_cpu']:3.0f}%  {h['throttled']:9d}"
                    if "budget_s" in h else f"{'-':>6}  {'-':>9}  {'-':>4}  {'-':>9}")
        lines.append(f"{name:4}  {cpu_cols}  {h['tx_bytes'] / 1e6:5.1f}  "
                     f"{100 * h['tx_util']:6.0f}%  {h['rx_bytes'] / 1e6:5.1f}  "
                     f"{100 * h['rx_util']:6.0f}%  {100 * max(h['peak_tx'], h['peak_rx']):8.0f}%"
                     f"  {h['port_drops'] + h['cap_drops']:5d}")
    return "\n".join(lines)
