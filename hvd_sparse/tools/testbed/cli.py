"""``hvd-sparse testbed {up,run,set,status,down}``."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from . import launch, lifecycle, links, loss
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
    u.add_argument("--loss", type=float, default=0.0, help="drop rate on every switch port")
    u.add_argument("--loss-proto", choices=("all", "udp"), default="all",
                   help="drop any frame, or only UDP (keeps MPI's TCP out of it)")
    r = sp("run", "run CMD with one rank per worker host (Horovod, or torch.distributed)")
    r.add_argument("--timeout", type=float, default=None, help="seconds before it is stopped")
    r.add_argument("--launcher", choices=launch.LAUNCHERS, default="mpirun",
                   help="mpirun: Horovod ranks under Open MPI; torch: torch.distributed ranks "
                        "(RANK, WORLD_SIZE, MASTER_ADDR=w0 as torchrun sets them; Gloo on eth0)")
    r.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks on each worker host (they share its link and aggregator shard)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    s = sp("set", "change loss, rate or link state while jobs run")
    s.add_argument("--host", help="w0.., a0..; default: every port (loss, rate)")
    s.add_argument("--loss", type=float)
    s.add_argument("--rate")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--down", dest="link_up", action="store_false", default=None)
    g.add_argument("--up", dest="link_up", action="store_true")
    st = sp("status", "hosts, addresses, rates and byte counters")
    st.add_argument("--json", action="store_true")
    sp("down", "remove everything the testbed created")
    return p


def status(tb: Testbed) -> dict:
    c = links.counters(tb)
    return {"name": tb.name, "rate": tb.rate, "mtu": tb.mtu, "loss": tb.loss,
            "loss_proto": tb.loss_proto, "dropped_by_loss": loss.dropped(tb),
            "aggregators": tb.aggregator_addresses(), "transport": tb.transport,
            "switch": tb.switch, "auth": tb.auth,
            "hosts": [{"host": h.name, "namespace": h.ns, "ip": h.ip, "loss": h.loss,
                       "rate": h.rate or tb.rate,
                       "link": "down" if h.down else "up",
                       "processes": len(links.pids_in(h.ns)), **c[h.name]} for h in tb.hosts]}


def _print_status(d: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"testbed {d['name']}: {d['rate']} links, MTU {d['mtu']}, loss {d['loss']} "
                    f"({d['loss_proto']}), {d['dropped_by_loss']} frames dropped by loss rules")
    for col in ("host", "namespace", "ip", "rate", "link", "loss", "processes", "rx MB",
                "tx MB"):
        t.add_column(col)
    for h in d["hosts"]:
        t.add_row(h["host"], h["namespace"], h["ip"], h["rate"], h["link"], f"{h['loss']:g}",
                  str(h["processes"]), f"{h['rx_bytes'] / 1e6:.1f}", f"{h['tx_bytes'] / 1e6:.1f}")
    Console().print(t)
    if d["aggregators"]:
        print(f"aggregators: {d['aggregators']}")


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.cmd == "up":
            tb = lifecycle.up(Testbed(a.name, a.workers, a.aggregators, a.rate, a.mtu, a.loss,
                                      a.loss_proto, a.transport, a.switch, a.auth))
            _print_status(status(tb))
        elif a.cmd == "down":
            removed = lifecycle.down(a.name)
            print(f"testbed {a.name}: removed {len(removed)} namespace(s)")
        elif a.cmd == "set":
            lifecycle.update(Testbed.load(a.name), a.host, a.loss, a.rate, a.link_up)
        elif a.cmd == "status":
            d = status(Testbed.load(a.name))
            print(json.dumps(d, indent=1)) if a.json else _print_status(d)
        elif a.cmd == "run":
            lifecycle.require_root()
            cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
            return launch.run(Testbed.load(a.name), cmd, timeout=a.timeout,
                              launcher=a.launcher, per_host=a.ranks_per_host).returncode
    except (OSError, ValueError, KeyError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"hvd-sparse testbed {a.cmd}: {e}", file=sys.stderr)
        return 1
    return 0
