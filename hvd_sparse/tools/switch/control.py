"""The emulated switch's control plane: starting it with a program that fits, and talking to
its local control socket (install and remove jobs, list them, read the counters), as
SwitchML's controller does for a Tofino.

    hvd-sparse switch start --port w0 --port w1 ... --aggregate 10.77.0.254:9999
                            [--control PATH] [--auto-groups N] [--slots N]
    hvd-sparse switch jobs [--install TOKEN WORKERS GROUPS | --remove TOKEN | --drop FIRST]
                           [--control PATH]
    hvd-sparse switch stats|limits [--control PATH]

Torch-free: a switch host needs neither torch nor Horovod.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ... import protocol
from . import binary, program

CONTROL = "/run/hvd-sparse/switch.sock"
# The switch geometry, defined once in csrc/omni/protocol.h (hvd_sparse.protocol)
CELLS_PER_SLOT = protocol.SWITCH_CELLS_PER_SLOT  # a slot's largest packet, in passes: 8 KiB
VALUES_PER_PASS = protocol.SWITCH_VALUES_PER_PASS  # int32 values one pass sums (256 B)


class ControlError(RuntimeError):
    """The switch refused a command, or did not answer."""


class Client:
    """One command per datagram to the switch's control socket, one JSON reply."""

    def __init__(self, path: str | Path = CONTROL, timeout: float = 5.0) -> None:
        self.path, self.timeout = str(path), timeout

    def call(self, command: str) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s, \
                tempfile.TemporaryDirectory(prefix="hvd-sparse-ctl-") as d:
            s.bind(os.path.join(d, "client"))  # the switch replies to this address
            s.settimeout(self.timeout)
            try:
                s.sendto(command.encode(), self.path)
                reply = json.loads(s.recv(1 << 20))
            except (OSError, TimeoutError) as e:
                raise ControlError(f"switch control socket {self.path}: {e}") from e
        if "error" in reply:
            raise ControlError(f"switch: {command.split()[0]}: {reply['error']}")
        return reply

    def limits(self) -> dict:
        return self.call("limits")

    def stats(self) -> dict:
        return self.call("stats")

    def jobs(self, token: int | None = None) -> list[dict]:
        """The installed jobs (or the one of ``token``), named by their first slot group: the
        switch never prints a token."""
        return self.call("jobs" if token is None else f"jobs {token}")["jobs"]

    def install(self, token: int, workers: int, groups: int) -> int:
        """Installs a job on ``groups`` slot groups; returns the first one."""
        return self.call(f"install {token} {workers} {groups}")["first"]

    def remove(self, token: int) -> bool:
        return self.call(f"remove {token}")["removed"]

    def drop(self, first: int) -> bool:
        """Removes the job whose slot groups start at ``first`` (its token unknown)."""
        return self.call(f"drop {first}")["removed"]


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


def eal_args(ports: list[str], prefix: str) -> str:
    """EAL arguments for one af_packet port per interface, no hugepages and no PCI."""
    vdevs = " ".join(f"--vdev=net_af_packet{i},iface={p},framesz=16384,blocksz=16384,"
                     "qdisc_bypass=0" for i, p in enumerate(ports))
    return (f"--no-huge --no-pci -m 512 --no-shconf --log-level=warning --file-prefix={prefix} "
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
    st.add_argument("--auto-groups", type=int, default=16,
                    help="slot groups for a job that registers without being installed "
                         "(0: jobs must be installed)")
    for name in ("start", "jobs", "stats", "limits"):
        p = st if name == "start" else sp.add_parser(name)
        p.add_argument("--control", default=CONTROL, help="the control socket's path")
    jobs = sp.choices["jobs"]
    jobs.add_argument("--install", nargs=3, type=int, metavar=("TOKEN", "WORKERS", "GROUPS"))
    jobs.add_argument("--remove", type=int, metavar="TOKEN")
    jobs.add_argument("--drop", type=int, metavar="FIRST", help="remove the job at this group")
    a = ap.parse_args(argv)
    if a.cmd == "start":
        Path(a.control).parent.mkdir(parents=True, exist_ok=True)
        cmd = command(eal_args(a.port, "hvd-sparse-switch"), a.port, aggregate=a.aggregate,
                      control=a.control, slots=a.slots, auto_groups=a.auto_groups)
        if a.aggregate:
            print(program.load(program.aggregation_program(slots=a.slots)).report())
        os.execv(cmd[0], cmd)
    client = Client(a.control)
    try:
        if a.cmd == "jobs" and a.install:
            print(json.dumps({"first": client.install(*a.install)}))
        elif a.cmd == "jobs" and a.remove is not None:
            print(json.dumps({"removed": client.remove(a.remove)}))
        elif a.cmd == "jobs" and a.drop is not None:
            print(json.dumps({"removed": client.drop(a.drop)}))
        else:
            print(json.dumps(client.call(a.cmd), indent=1))
    except ControlError as e:
        print(e, file=sys.stderr)
        return 1
    return 0
