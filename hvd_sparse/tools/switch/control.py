"""The emulated switch's control plane: starting it with a program that fits, and talking to
its local control socket (install and remove jobs, list them, read the counters), as
SwitchML's controller does for a Tofino.

    hvd-sparse switch start --port w0 --port w1 ... --aggregate 10.77.0.254:9999
                            [--control PATH] [--auto-groups N] [--slots N]
    hvd-sparse switch jobs [--install TOKEN WORKERS GROUPS [IP,IP,..] | --remove TOKEN |
                            --drop FIRST] [--control PATH]
    hvd-sparse switch host PORT MAC IP [--control PATH]
    hvd-sparse switch stats|limits [--control PATH]

Torch-free: a switch host needs neither torch nor Horovod.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ... import protocol
from ...switch_control import Client, ControlError
from . import binary, program

CONTROL = "/run/hvd-sparse/switch.sock"
# The switch geometry, defined once in csrc/omni/protocol.h (hvd_sparse.protocol)
CELLS_PER_SLOT = protocol.SWITCH_CELLS_PER_SLOT  # a slot's largest packet, in passes: one
VALUES_PER_PASS = protocol.SWITCH_VALUES_PER_PASS  # int32 values one pass sums (256 B)


def command(eal: str, names: list[str], *, aggregate: str | None = None,
            control: str | Path | None = None, slots: int = protocol.SWITCH_CELLS,
            auto_groups: int = 0,
            hold: float = 2.0, ready_file: str | Path | None = None,
            limits: program.Limits | None = None) -> list[str]:
    """The switch's command line. With ``aggregate`` the aggregation program is loaded first:
    a program that does not fit ``limits`` raises ProgramError, as a P4 compiler refuses it."""
    cmd = [str(binary()), "--dpdk", eal, "--names", ",".join(names)]
    if ready_file:
        cmd += ["--ready-file", str(ready_file)]
    if control:
        cmd += ["--control", str(control)]
    if aggregate:
        res = program.load(program.aggregation_program(slots=slots), limits)
        cmd += ["--aggregate", aggregate, "--cells", str(res.slots),
                "--values-per-pass", str(res.values_per_pass),
                "--cells-per-slot", str(CELLS_PER_SLOT), "--auto-groups", str(auto_groups),
                "--hold", str(hold)]
    return cmd


def with_line_rate(stats: dict) -> dict:
    """The switch's counters, with what a real pipeline would make of the program as run: its
    passes per packet and the fraction of line rate kept with every port sending
    (program.line_rate_kept)."""
    agg = stats.get("aggregation")
    if agg and agg["packets"]:
        agg["passes_per_packet"] = agg["passes"] / agg["packets"]
        agg["line_rate_kept"] = program.line_rate_kept(agg["passes_per_packet"],
                                                       len(stats["ports"]))
    return stats


def eal_args(ports: list[str], prefix: str) -> str:
    """EAL arguments for one af_packet port per interface, no hugepages and no PCI. Memory:
    the mbuf pool takes 9.5 MiB a port (csrc/switch/main.cpp), the rest fits in 64 MiB; without
    hugepages -m reserves address space, pages are touched as frames use them."""
    mem = 64 + 10 * len(ports)
    vdevs = " ".join(f"--vdev=net_af_packet{i},iface={p},framesz=16384,blocksz=16384,"
                     "qdisc_bypass=0" for i, p in enumerate(ports))
    return (f"--no-huge --no-pci -m {mem} --no-shconf --log-level=warning --file-prefix={prefix} "
            f"{vdevs}")


def wait_ready(proc: subprocess.Popen, ready: Path, log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the emulated switch did not start: " + log.read_text()[-1000:])
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hvd-sparse switch")
    sp = ap.add_subparsers(dest="cmd", required=True)
    st = sp.add_parser("start", help="run the switch in the foreground on these interfaces")
    st.add_argument("--port", action="append", required=True, help="an interface (repeat)")
    st.add_argument("--aggregate", help="IP:PORT the switch owns and aggregates at")
    st.add_argument("--slots", type=int, default=protocol.SWITCH_CELLS,
                    help="aggregation cells (pool size)")
    st.add_argument("--auto-groups", type=int, default=0,
                    help="slot groups for a job that registers without being installed; its "
                         "workers are then bound first come among the bound hosts (0: jobs "
                         "must be installed, each worker bound to its host)")
    for name in ("start", "jobs", "stats", "limits", "host"):
        p = st if name == "start" else sp.add_parser(name)
        p.add_argument("--control", default=CONTROL, help="the control socket's path")
    jobs = sp.choices["jobs"]
    jobs.add_argument("--install", nargs="+", metavar="TOKEN WORKERS GROUPS [IP,IP,..]",
                      help="install a job; with addresses, each worker bound to its host")
    jobs.add_argument("--remove", type=int, metavar="TOKEN")
    jobs.add_argument("--drop", type=int, metavar="FIRST", help="remove the job at this group")
    host = sp.choices["host"]
    host.description = "bind a host: the switch takes aggregation traffic from bound hosts only"
    for arg in ("port", "mac", "ip"):
        host.add_argument(arg)
    a = ap.parse_args(argv)
    if a.cmd == "jobs" and a.install and len(a.install) not in (3, 4):
        ap.error("--install TOKEN WORKERS GROUPS [IP,IP,..]")
    if a.cmd == "start":
        Path(a.control).parent.mkdir(parents=True, exist_ok=True)
        cmd = command(eal_args(a.port, "hvd-sparse-switch"), a.port, aggregate=a.aggregate,
                      control=a.control, slots=a.slots, auto_groups=a.auto_groups)
        if a.aggregate:
            print(program.load(program.aggregation_program(slots=a.slots)).report())
        os.execv(cmd[0], cmd)
    client = Client(a.control)
    try:
        if a.cmd == "host":
            client.bind(a.port, a.mac, a.ip)
            print(json.dumps({"bound": True}))
        elif a.cmd == "jobs" and a.install:
            token, workers, groups = (int(x) for x in a.install[:3])
            ips = a.install[3].split(",") if len(a.install) == 4 else None
            print(json.dumps({"first": client.install(token, workers, groups, ips)}))
        elif a.cmd == "jobs" and a.remove is not None:
            print(json.dumps({"removed": client.remove(a.remove)}))
        elif a.cmd == "jobs" and a.drop is not None:
            print(json.dumps({"removed": client.drop(a.drop)}))
        elif a.cmd == "stats":
            print(json.dumps(with_line_rate(client.stats()), indent=1))
        else:
            print(json.dumps(client.call(a.cmd), indent=1))
    except ControlError as e:
        print(e, file=sys.stderr)
        return 1
    return 0
