"""What a testbed is: its hosts, their addresses and link settings, kept in a state file so
that every later command (``run``, ``set``, ``status``, ``down``) finds what ``up`` made."""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ... import runfile
from ...config import format_address
from ...protocol import AGGREGATOR_PORT

STATE_DIR = Path(os.environ.get("HVD_SPARSE_TESTBED_DIR", "/run/hvd-sparse"))
SUBNET = "10.77.0"  # every testbed has its own switch, so testbeds never see each other's
SUBNET6 = "fd77::"  # with ``ipv6``: a unique-local /64 beside the IPv4 one


MAX_RATE = 8 * (2**32 - 1)  # tbf's rate field: 32-bit bytes per second (about 34 Gbit/s)


def parse_rate(rate: str | float) -> int:
    """'1gbit', '250mbit', '1e9' -> bits per second (tc's spelling of rates)."""
    bps = int(runfile.parse_rate(rate))
    if not 0 < bps <= MAX_RATE:
        raise ValueError(f"link rate {rate!r}: must be above 0 and at most 34gbit (tbf's limit)")
    return bps


@dataclass
class Host:
    name: str  # w0.. (workers), a0.. (aggregator hosts)
    ns: str  # its network namespace
    ip: str
    loss: float = 0.0  # drop rate of frames to and from it on the switch
    down: bool = False  # its link is cut
    dup: float = 0.0  # share of frames to and from it the switch sends twice
    reorder: float = 0.0  # share of frames to and from it the switch holds back (reordered)
    rate: str = ""  # its link's rate when set apart from the testbed's
    ip6: str = ""  # its IPv6 address on a testbed with ``ipv6`` ("": none)

    @property
    def port(self) -> str:
        """Its port on the switch (the veth end in the switch namespace)."""
        return self.name


@dataclass
class Testbed:
    name: str = "hvdsp"  # prefix of every namespace and veth it creates
    workers: int = 4
    aggregators: int = 1
    rate: str = "1gbit"
    mtu: int = 1500
    loss: float = 0.0  # drop rate on every switch port
    loss_proto: str = "all"  # "all" or "udp": what the drop rules apply to
    transport: str = "udp"  # the aggregators': kernel sockets, or DPDK on an af_packet vdev
    switch: str = "bridge"  # a Linux bridge, or "emu": the emulated switch (DPDK, MAC learning)
    auth: bool = True  # aggregators take only authenticated jobs (the testbed's secret file)
    cpu_per_host: float = 0.0  # each host's CPU budget in cores (cpu.py); 0: none
    # the aggregators' --workers: -1 the testbed's workers; 0 jobs of any size (an elastic
    # job's ranks change as workers leave and come back)
    aggregator_workers: int = -1
    # Hosts get IPv6 addresses (fd77::N) beside their IPv4 ones, and the aggregators bind
    # and are reached at those (MPI keeps IPv4); the udp transport and the bridge only.
    ipv6: bool = False
    hosts: list[Host] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)  # aggregator host -> its process

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.name):
            raise ValueError(f"testbed name {self.name!r}: 1-8 lowercase letters or digits "
                             "(veth names must fit 15 characters)")
        if not 1 <= self.workers <= 64 or not 0 <= self.aggregators <= 16:
            raise ValueError("workers must be in [1, 64] and aggregators in [0, 16]")
        if self.cpu_per_host < 0:
            raise ValueError(f"cpu_per_host must be >= 0 (0: no budget), got {self.cpu_per_host}")
        if self.loss_proto not in ("all", "udp"):
            raise ValueError("loss_proto must be 'all' or 'udp'")
        if self.transport not in ("udp", "dpdk"):
            raise ValueError("transport must be 'udp' or 'dpdk'")
        if self.switch not in ("bridge", "emu"):
            raise ValueError("switch must be 'bridge' or 'emu'")
        if self.ipv6 and (self.transport != "udp" or self.switch != "bridge"):
            raise ValueError("ipv6 needs the udp transport and the bridge switch: the DPDK "
                             "aggregator and the emulated switch build Ethernet/IPv4/UDP frames "
                             "and answer ARP only (docs/PROTOCOL.md, Transports and frames)")
        parse_rate(self.rate)
        if not self.hosts:
            def v6(n: int) -> str:
                return f"{SUBNET6}{n}" if self.ipv6 else ""

            self.hosts = [Host(f"w{i}", f"{self.name}-w{i}", f"{SUBNET}.{i + 1}", ip6=v6(i + 1))
                          for i in range(self.workers)]
            self.hosts += [Host(f"a{k}", f"{self.name}-a{k}", f"{SUBNET}.{101 + k}",
                                ip6=v6(101 + k)) for k in range(self.aggregators)]

    @property
    def switch_ns(self) -> str:
        return f"{self.name}-sw"

    @property
    def switch_address(self) -> str:
        """Where the emulated switch aggregates (an address no host has)."""
        return f"{SUBNET}.254:{AGGREGATOR_PORT}"

    @property
    def switch_control(self) -> Path:
        return self.log_dir() / "switch.sock"

    @property
    def rate_bps(self) -> int:
        return parse_rate(self.rate)

    @property
    def worker_hosts(self) -> list[Host]:
        return [h for h in self.hosts if h.name.startswith("w")]

    @property
    def aggregator_hosts(self) -> list[Host]:
        return [h for h in self.hosts if h.name.startswith("a")]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"testbed {self.name!r} has no host {name!r} "
                       f"(hosts: {', '.join(h.name for h in self.hosts)})")

    def hostname(self, h: Host) -> str:
        """The name ``h`` has inside the testbed's namespaces: ``a0.hvdsp`` (names.py)."""
        return f"{h.name}.{self.name}"

    def address(self, h: Host) -> str:
        """Where jobs reach host ``h``'s aggregator: its IPv6 address with ``ipv6``."""
        return h.ip6 if self.ipv6 else h.ip

    def aggregator_addresses(self, by_name: bool = False) -> str:
        """HVD_SPARSE_AGGREGATORS for jobs on this testbed: by address, or by host name (a
        job that names them so follows an aggregator host that moves)."""
        return ",".join(f"{self.hostname(h)}:{AGGREGATOR_PORT}" if by_name
                        else format_address(self.address(h), AGGREGATOR_PORT)
                        for h in self.aggregator_hosts)

    @staticmethod
    def state_path(name: str) -> Path:
        return STATE_DIR / f"testbed-{name}.json"

    def log_dir(self) -> Path:
        return STATE_DIR / f"testbed-{self.name}"

    def secret_file(self) -> Path:
        """The secret its aggregators run with, which its jobs authenticate with."""
        return self.log_dir() / "secret"

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path(self.name).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(self.state_path(self.name))

    @classmethod
    def load(cls, name: str) -> Testbed:
        path = cls.state_path(name)
        if not path.exists():
            raise FileNotFoundError(f"no testbed {name!r} is up ({path} missing): "
                                    f"run `hvd-sparse testbed up --name {name}` first")
        d = json.loads(path.read_text())
        d["hosts"] = [Host(**h) for h in d["hosts"]]
        return cls(**d)
