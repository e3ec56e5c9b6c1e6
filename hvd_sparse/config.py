"""Run-time options: ``hvd_sparse.init(**kwargs)`` or ``HVD_SPARSE_*`` environment variables."""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .runfile import parse_rate

SCHEMES = ("dense", "allgather", "zen", "omnireduce", "switch", "auto")
LAYOUTS = ("auto", "colocated", "rank0")
# ``wire``: the 16-bit type float32 and float64 values may travel as ("": their own)
WIRES = ("", "bf16")


@dataclass
class Config:
    """The options of both front ends (``hvd_sparse.init(**kwargs)``,
    ``hvd_sparse.ddp.State(**kwargs)``); each is also read from ``HVD_SPARSE_<NAME>`` (the
    name upper-cased), see ``from_env_and_kwargs``.

    Attributes:
        block_size: the codec's block, in elements: the unit shipped. Element-wise
            sparsifiers want a small one (1..32).
        scheme: "dense", "allgather", "zen", "omnireduce", "switch" or "auto".
        timeout: seconds any wait may take before ``HvdSparseError``.
        small_bytes: "auto" and "omnireduce" send tensors smaller than this dense.
        probe: the network probe at init: "auto" (cached), "force", "off".
        cache_dir: where the probed network model is cached.
        log_level: the level of the library's logger (``logging.getLogger("hvd_sparse")``).
        threads: codec threads per rank; 0: cores / ranks on this host.
        aggregators: omnireduce: "host:port,..." (or a list) of running aggregators, each
            a name, an IPv4 address or an IPv6 one in brackets ("[fd00::1]:9999"); a name
            with both IPv4 and IPv6 addresses is reached over IPv4. Empty: the job starts its
            own (``aggregator_layout``).
        aggregator_layout: where the job's own aggregators run: "colocated", on every host of
            the job (its lowest rank starts them, slots spread over all: every host link
            carries about the same bytes); "rank0", all on rank 0's host; "auto": colocated
            when the ranks span several hosts.
        local_aggregators: how many each host that runs them starts; -1: one per 4 of the
            ranks they serve (the host's own when colocated, the job's on rank 0's host), at
            least 1; 0: none.
        aggregator_host: the address workers reach the job's own aggregators at (each host's
            own: its environment's value when colocated), a name, an IPv4 or an IPv6 address
            (bare or in brackets); "": automatic.
        fallback: when aggregation fails: "error" raises, "dense" redoes it dense.
        auth: omnireduce: authenticate every packet to and from the aggregators
            (docs/PROTOCOL.md "Authentication"); turn off only on a fabric no one else can
            reach.
        secret_file: the deployment's secret the configured aggregators were started with
            (their ``--secret-file``); read by rank 0 only. Local aggregators get a fresh one
            per job.
        fixed_point: omnireduce: send values as int32 fixed point with one agreed exponent per
            tensor (what a switch sums; docs/PROTOCOL.md "Fixed point"); tensors holding
            NaN/Inf go dense.
        switch: scheme "switch": the in-network aggregator ("ip:port", "[ipv6]:port"; set by
            ``hvd-sparse testbed run`` when the testbed's switch is the emulator, which is
            IPv4 only); "": none.
        switch_control: the switch's control socket: rank 0 installs the job there with every
            worker's address, so that the switch takes the job's packets from those hosts only
            (set by ``hvd-sparse testbed run``); "": the switch must install jobs at their
            first REGISTER.
        switch_fixed_float64: scheme "switch" with float64 tensors: off, they go to the
            aggregators (or dense), exact; on, through the switch in fixed point (relative
            error up to about nworkers^2 x 2^-31).
        wire: "bf16": float32 and float64 tensors travel as bfloat16 values (half the bytes,
            as Horovod's ``Compression.fp16``, with float32's range), summed in float32 by the
            codecs and aggregators, rounded to bfloat16 once on the way back and widened
            again; "": values in their own dtype.
        payload_bytes: block values per datagram (block fusion); the default holds 63 float32
            blocks.
        slots: slots per aggregator per tensor: packets in flight per tensor.
        rto: least retransmission timeout, seconds; above it srtt + 4 rttvar of measured
            round times.
        metrics_file: run file for ``hvd-sparse analyze`` (runfile.py): every call recorded,
            rank 0 writes it at shutdown and exit ("{rank}" in the path: every rank); "": none.
        metrics_records: the latest calls the run file keeps (about 500 bytes each).
        link_rate: the hosts' link rate ("10gbit", or bit/s): the base of utilization.
        ports: "LO-HI": every UDP socket the job opens for aggregation (the job's own
            aggregators, each rank's worker socket toward aggregators or a switch) binds a port
            in this range, the one a firewall opens; "": any free port.
    """

    block_size: int = 256
    scheme: str = "auto"
    timeout: float = 30.0
    small_bytes: int = 64 * 1024
    probe: str = "auto"
    cache_dir: str = str(Path.home() / ".cache" / "hvd_sparse")
    log_level: str = "WARNING"
    threads: int = 0
    aggregators: str | list = ""
    aggregator_layout: str = "auto"
    local_aggregators: int = -1
    aggregator_host: str = ""
    fallback: str = "error"
    auth: bool = True
    secret_file: str = ""
    fixed_point: bool = False
    switch: str = ""
    switch_control: str = ""
    switch_fixed_float64: bool = False
    wire: str = ""
    payload_bytes: int = 64512
    slots: int = 64
    rto: float = 0.05
    metrics_file: str = ""
    metrics_records: int = 50_000
    link_rate: str | float = ""
    ports: str = ""

    def validate(self) -> Config:
        """Checks every option's value.

        Returns:
            The config itself.

        Raises:
            ValueError: an option out of range, naming it (an unknown scheme, layout, probe or
                fallback, a malformed ``link_rate``, ``switch`` address, ...).
        """
        if self.block_size < 1 or self.block_size > 1 << 24:
            raise ValueError(f"block_size must be in [1, 2**24], got {self.block_size}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if not _finite_positive(self.timeout):  # NaN and inf too: no wait could end at them
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {self.timeout}")
        if self.aggregator_layout not in LAYOUTS:
            raise ValueError(f"aggregator_layout must be one of {LAYOUTS}, "
                             f"got {self.aggregator_layout!r}")
        if self.probe not in ("auto", "force", "off"):
            raise ValueError(f"probe must be 'auto', 'force' or 'off', got {self.probe!r}")
        if self.fallback not in ("error", "dense"):
            raise ValueError(f"fallback must be 'error' or 'dense', got {self.fallback!r}")
        if not 1 <= self.slots <= 4096 or self.payload_bytes < 1 or not _finite_positive(self.rto):
            raise ValueError(f"slots must be in [1, 4096], payload_bytes >= 1 and rto finite and "
                             f"> 0, got {self.slots}, {self.payload_bytes}, {self.rto}")
        if self.threads < 0 or self.small_bytes < 0 or self.local_aggregators < -1:
            raise ValueError(f"threads and small_bytes must be >= 0 and local_aggregators >= -1 "
                             f"(-1: automatic), got threads={self.threads}, small_bytes="
                             f"{self.small_bytes}, local_aggregators={self.local_aggregators}")
        if self.wire not in WIRES:
            raise ValueError(f"wire must be one of {WIRES}, got {self.wire!r}")
        if self.metrics_records < 1:
            raise ValueError(f"metrics_records must be >= 1, got {self.metrics_records}")
        # what logs.configure sets the logger to: a level logging knows by name
        if not isinstance(logging.getLevelName(str(self.log_level).upper()), int):
            raise ValueError(f"log_level must be a logging level name (DEBUG, INFO, WARNING, "
                             f"ERROR, CRITICAL), got {self.log_level!r}")
        if self.link_rate:
            parse_rate(self.link_rate)
        self.aggregator_list()
        self.switch_address()
        self.port_range()
        if self.aggregator_host:
            self.aggregator_host = _host("aggregator_host", str(self.aggregator_host))
        return self

    def port_range(self) -> tuple[int, int]:
        """``ports`` parsed.

        Returns:
            (LO, HI), both included; (0, 0) when any port will do.

        Raises:
            ValueError: ``ports`` is not "LO-HI" with 1 <= LO <= HI <= 65535.
        """
        if not self.ports:
            return 0, 0
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(self.ports))
        lo, hi = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"ports must be 'LO-HI' with 1 <= LO <= HI <= 65535 "
                             f"(HVD_SPARSE_PORTS), got {self.ports!r}")
        return lo, hi

    def aggregates(self) -> bool:
        """Whether the job joins aggregators: configured ones, or its own.

        Returns:
            False only with no ``aggregators`` and ``local_aggregators`` 0.
        """
        return bool(self.aggregator_list()) or self.local_aggregators != 0

    def aggregator_list(self) -> list[tuple[str, int]]:
        """``aggregators`` parsed.

        Returns:
            [(host, port), ...], an IPv6 address without its brackets; empty when none is
            configured.

        Raises:
            ValueError: an entry is not ``host:port`` or ``[IPv6]:port``.
        """
        items = self.aggregators
        if isinstance(items, str):
            items = items.split(",")
        out = []
        for item in items:
            if isinstance(item, tuple | list):
                out.append(_address("aggregators", format_address(str(item[0]).strip("[]"),
                                                                  item[1])))
                continue
            item = item.strip()
            if item:
                out.append(_address("aggregators", item))
        return out

    def switch_address(self) -> tuple[str, int] | None:
        """``switch`` parsed.

        Returns:
            (ip, port), or None when no switch is configured.

        Raises:
            ValueError: it is not ``ip:port`` or ``[IPv6]:port``.
        """
        return _address("switch", self.switch.strip()) if self.switch.strip() else None


def _finite_positive(x: float) -> bool:
    try:
        return math.isfinite(x) and x > 0
    except OverflowError:  # an int beyond the floats
        return False


ACCEPTED = ("host:port, IPv4:port or [IPv6]:port (e.g. node1:9999, 10.0.0.1:9999, "
            "[fd00::1]:9999), port in 1..65535")


def format_address(host: str, port: int | str) -> str:
    """``host:port``, an IPv6 address in brackets (``[fd00::1]:9999``).

    Args:
        host: a name, an IPv4 or an IPv6 address (without brackets).
        port: the port.

    Returns:
        The text that ``aggregators`` and ``switch`` accept.
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host(option: str, host: str, item: str | None = None) -> str:
    """``host`` checked: an IPv6 literal (brackets stripped) that is not link-local, or
    anything without a colon (a name or an IPv4 address, resolved when used)."""
    item = host if item is None else item
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" not in bare and bare == host and bare.strip() and not any(c.isspace() for c in bare):
        return bare
    what = (ACCEPTED if item is not host else
            "a name, an IPv4 address or an IPv6 one (fd00::1 or [fd00::1])")
    try:
        ip = ipaddress.IPv6Address(bare)
    except ValueError:
        raise ValueError(f"{option}: expected {what}, got {item!r}") from None
    if ip.is_link_local or ip.scope_id:
        raise ValueError(f"{option}: link-local IPv6 addresses (fe80::/10, %zone) are not "
                         f"supported (they need an interface): expected {what} with a global "
                         f"or unique-local (fd00::/8) address, got {item!r}")
    return str(ip)


def _address(option: str, item: str) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, sep, port = item.rpartition("]:")
        host += "]" if sep else ""
    else:
        host, _, port = item.rpartition(":")
        if ":" in host:  # "fd00::1:9999": where the address ends is a guess
            raise ValueError(f"{option}: an IPv6 address takes brackets before its port "
                             f"([fd00::1]:9999): expected {ACCEPTED}, got {item!r}")
    # ASCII digits (str.isdigit takes "²", which int() refuses), a port a socket can reach
    if not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise ValueError(f"{option}: expected {ACCEPTED}, got {item!r}")
    if host.startswith("[") != host.endswith("]") or host == "[]":
        raise ValueError(f"{option}: expected {ACCEPTED}, got {item!r}")
    return _host(option, host, item), int(port)


def _parse(env: str, kind: type) -> object:
    if kind is not bool:
        return kind(env)
    if env.strip().lower() in ("1", "true", "yes", "on"):  # bool("0") would be True
        return True
    if env.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {env!r}")


def from_env_and_kwargs(**kwargs: object) -> Config:
    """The options: keyword arguments win over ``HVD_SPARSE_<NAME>`` variables, which win over
    the defaults.

    A variable is parsed as its field's default's type (booleans: 1/0, true/false, yes/no,
    on/off).

    Args:
        **kwargs: ``Config`` fields; None: not given (the variable or default holds).

    Returns:
        The validated config.

    Raises:
        TypeError: an unknown option.
        ValueError: a variable that does not parse, or an option out of range.

    Example:
        >>> cfg = from_env_and_kwargs(scheme="allgather", timeout=60)
    """
    values: dict[str, object] = {}
    for f in dataclasses.fields(Config):
        var = f"HVD_SPARSE_{f.name.upper()}"
        env = os.environ.get(var)
        if env is not None:
            try:
                values[f.name] = _parse(env, type(f.default))
            except ValueError as e:  # int() and float() name neither the option nor the variable
                raise ValueError(f"{var} ({f.name}): {e}") from None
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise TypeError(f"unknown hvd_sparse option(s): {sorted(unknown)}")
    given = {k: v for k, v in kwargs.items() if v is not None}
    values.update(given)
    try:
        return Config(**values).validate()  # type: ignore[arg-type]
    except ValueError as e:  # name the variables behind the refused options
        named = [f"HVD_SPARSE_{n.upper()}={os.environ[f'HVD_SPARSE_{n.upper()}']!r}"
                 for n in values if n not in given and f"HVD_SPARSE_{n.upper()}" in os.environ
                 and re.search(rf"\b{n}\b", str(e))]
        if named:
            raise ValueError(f"{e} (from {', '.join(named)})") from None
        raise
