"""``hvd-sparse testbed {up,run,set,move,status,down}``."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from . import cpu, fidelity, launch, lifecycle, links, loss
from .topology import Testbed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvd-sparse testbed",
                                description="an emulated cluster in network namespaces")
    sub = p.add_subparsers(dest="cmd", required=True)

    def sp(name: str, help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help)
        s.add_argument("--name", default="hvdsp", help="testbed name (namespace prefix)")
        return s

    u = sp("up", "create the hosts, links and aggregators")
    u.add_argument("--workers", type=int, default=4)
    u.add_argument("--aggregators", type=int, default=1, help="aggregator hosts")
    u.add_argument("--rate", default="1gbit", help="every link's rate, both directions")
    u.add_argument("--mtu", type=int, default=1500)
    u.add_argument("--transport", choices=("udp", "dpdk"), default="udp",
                   help="the aggregators' transport (dpdk: an af_packet vdev on the host's veth)")
    u.add_argument("--switch", choices=("bridge", "emu"), default="bridge",
                   help="the switch: a Linux bridge, or the emulated switch (DPDK, MAC learning)")
    u.add_argument("--no-auth", dest="auth", action="store_false",
                   help="aggregators without a secret: jobs run unauthenticated "
                        "(HVD_SPARSE_AUTH=0)")
    u.add_argument("--any-job-size", action="store_true",
                   help="the aggregators take jobs of any number of ranks, not only of --workers "
                        "(an elastic job's size changes: run --launcher horovodrun)")
    u.add_argument("--ipv6", action="store_true",
                   help="hosts get IPv6 addresses (fd77::N) too, and the aggregators bind and "
                        "are reached at those (udp transport, bridge switch only)")
    u.add_argument("--loss", type=float, default=0.0, help="drop rate on every switch port")
    u.add_argument("--loss-proto", choices=("all", "udp"), default="all",
                   help="drop any frame, or only UDP (keeps MPI's TCP out of it)")
    u.add_argument("--cpu-per-host", default=None, metavar="CORES|auto",
                   help="each host's CPU budget in cores (a cgroup per host, e.g. 0.25); "
                        "auto: the machine's cores / hosts. Default: none")
    r = sp("run", "run CMD with one rank per worker host (Horovod, or torch.distributed)")
    r.add_argument("--timeout", type=float, default=None, help="seconds before it is stopped")
    r.add_argument("--launcher", choices=launch.LAUNCHERS, default="mpirun",
                   help="mpirun: Horovod ranks under Open MPI; torch: torch.distributed ranks "
                        "(RANK, WORLD_SIZE, MASTER_ADDR=w0 as torchrun sets them; Gloo on eth0); "
                        "horovodrun: a Horovod elastic job (Gloo; horovodrun in w0's namespace, "
                        "ssh to the others; at least half the ranks)")
    r.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks on each worker host (they share its link and aggregator shard)")
    r.add_argument("--report", metavar="PATH",
                   help="write what bound the run (per host CPU and link use, verdict) as "
                        "JSON; a summary is printed to stderr either way")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    s = sp("set", "change loss, rate, link state, duplication or reordering while jobs run")
    s.add_argument("--host", help="w0.., a0..; default: every port (loss, rate)")
    s.add_argument("--loss", type=float)
    s.add_argument("--rate")
    s.add_argument("--dup", type=float,
                   help="share of frames to and from --host the switch sends twice")
    s.add_argument("--reorder", type=float,
                   help="share of frames to and from --host held back behind the others")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--down", dest="link_up", action="store_false", default=None)
    g.add_argument("--up", dest="link_up", action="store_true")
    m = sp("move", "move an aggregator host to another address, as a rescheduled pod: its "
                   "name (a0.NAME) follows")
    m.add_argument("--host", required=True, help="a0, a1, ...")
    m.add_argument("--ip", required=True, help="its new address, e.g. 10.77.0.150")
    st = sp("status", "hosts, addresses, rates and byte counters")
    st.add_argument("--json", action="store_true")
    sp("down", "remove everything the testbed created")
    return p


def status(tb: Testbed) -> dict:
    c = links.counters(tb)
    used = cpu.usage(tb) if tb.cpu_per_host else {}

    def budget(host: str) -> dict:
        if host not in used:
            return {}
        u = used[host]
        return {"cpu_budget": tb.cpu_per_host, "cpu_s": u["cpu_ns"] / 1e9,
                "cpu_periods": u["periods"], "cpu_throttled": u["throttled"],
                "cpu_throttled_s": u["throttled_ns"] / 1e9,
                "cgroup_processes": len(cpu.procs(tb, host))}

    return {"name": tb.name, "rate": tb.rate, "mtu": tb.mtu, "loss": tb.loss,
            "loss_proto": tb.loss_proto, "dropped_by_loss": loss.dropped(tb),
            "aggregators": tb.aggregator_addresses(), "transport": tb.transport,
            "switch": tb.switch, "auth": tb.auth, "cpu_per_host": tb.cpu_per_host,
            "ipv6": tb.ipv6,
            "emulated": fidelity.emulated(tb),
            **({"cfs_period_us": cpu.period_us(tb.cpu_per_host),
                "cfs_quota_us": cpu.quota_us(tb.cpu_per_host),
                "switch_cpu_s": used[cpu.SWITCH]["cpu_ns"] / 1e9} if used else {}),
            "hosts": [{"host": h.name, "namespace": h.ns, "ip": h.ip, "ip6": h.ip6, "loss": h.loss,
                       "dup": h.dup, "reorder": h.reorder,
                       "rate": h.rate or tb.rate,
                       "link": "down" if h.down else "up",
                       "processes": len(links.pids_in(h.ns)), **c[h.name], **budget(h.name)}
                      for h in tb.hosts]}


def _print_status(d: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"testbed {d['name']}: {d['rate']} links, MTU {d['mtu']}, loss {d['loss']} "
                    f"({d['loss_proto']}), {d['dropped_by_loss']} frames dropped by loss rules")
    v6 = any(h["ip6"] for h in d["hosts"])
    cols = ["host", "namespace", "ip", *(["ip6"] if v6 else []), "rate", "link", "loss", "dup",
            "reorder", "processes", "rx MB", "tx MB"]
    budgets = bool(d["cpu_per_host"])
    cols += ["CPU budget", "CPU s", "throttled"] if budgets else []
    for col in cols:
        t.add_column(col)
    for h in d["hosts"]:
        row = [h["host"], h["namespace"], h["ip"], *([h["ip6"]] if v6 else []), h["rate"],
               h["link"], f"{h['loss']:g}",
               f"{h['dup']:g}", f"{h['reorder']:g}", str(h["processes"]),
               f"{h['rx_bytes'] / 1e6:.1f}", f"{h['tx_bytes'] / 1e6:.1f}"]
        if budgets:
            row += [f"{h['cpu_budget']:.3g} core", f"{h['cpu_s']:.2f}",
                    f"{h['cpu_throttled']}/{h['cpu_periods']}"]
        t.add_row(*row)
    # to a pipe or a log, rich would cut the table to 80 columns: every column then reads "…"
    Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200).print(t)
    print(d["emulated"])
    if budgets:
        print(f"CFS period {d['cfs_period_us'] / 1000:g} ms, quota {d['cfs_quota_us'] / 1000:g} "
              f"ms a host; switch CPU {d['switch_cpu_s']:.2f} s (no quota)")
    if d["aggregators"]:
        print(f"aggregators: {d['aggregators']}")


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.cmd == "up":
            share = 0.0
            if a.cpu_per_host == "auto":
                share = cpu.auto_share(a.workers + a.aggregators)
            elif a.cpu_per_host is not None:
                share = float(a.cpu_per_host)
                if share <= 0:
                    raise ValueError(f"--cpu-per-host must be > 0 or auto, got {a.cpu_per_host}")
            tb = lifecycle.up(Testbed(a.name, a.workers, a.aggregators, a.rate, a.mtu, a.loss,
                                      a.loss_proto, a.transport, a.switch, a.auth,
                                      cpu_per_host=share, ipv6=a.ipv6,
                                      aggregator_workers=0 if a.any_job_size else -1))
            _print_status(status(tb))
        elif a.cmd == "down":
            removed = lifecycle.down(a.name)
            print(f"testbed {a.name}: removed {len(removed)} namespace(s)")
        elif a.cmd == "set":
            lifecycle.update(Testbed.load(a.name), a.host, a.loss, a.rate, a.link_up, a.dup,
                             a.reorder)
        elif a.cmd == "move":
            tb = lifecycle.move(Testbed.load(a.name), a.host, a.ip)
            print(f"testbed {a.name}: {a.host} ({tb.hostname(tb.host(a.host))}) now at {a.ip}")
        elif a.cmd == "status":
            d = status(Testbed.load(a.name))
            print(json.dumps(d, indent=1)) if a.json else _print_status(d)
        elif a.cmd == "run":
            lifecycle.require_root()
            cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
            tb = Testbed.load(a.name)
            with fidelity.Monitor(tb) as mon:
                rc = launch.run(tb, cmd, timeout=a.timeout, launcher=a.launcher,
                                per_host=a.ranks_per_host).returncode
            print(fidelity.format_report(mon.report), file=sys.stderr)
            if a.report:
                with open(a.report, "w") as f:
                    json.dump(mon.report, f, indent=1)
            return rc
    except (OSError, ValueError, KeyError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"hvd-sparse testbed {a.cmd}: {e}", file=sys.stderr)
        return 1
    return 0
