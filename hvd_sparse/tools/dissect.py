"""``hvd-sparse dissect``: what aggregation traffic holds, from a capture or a live interface.

    hvd-sparse dissect FILE.pcap [--port 9999] [--json]
    hvd-sparse dissect --iface eth0 [--count N] [--timeout S] [--write FILE.pcap] [--json]

Per job token: the workers seen, control packets (REGISTER, REGACK, RELEASE, BYE, ERROR), and
per tensor its geometry, slots, rounds, DATA and RESULT counts and retransmissions (a DATA of
the same (worker, tensor, slot, round) seen again; a RESULT of the same (tensor, slot, round)
to the same worker address seen again). Malformed datagrams are listed with the reason.

Packets are read with the scapy layers of ``hvd_sparse.tools.scapy_layer``. Torch-free.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
from collections import Counter, defaultdict
from typing import Any

from scapy.layers.inet import IP, UDP, defragment
from scapy.layers.inet6 import IPv6
from scapy.packet import Packet

from .. import protocol
from .scapy_layer import AGGREGATOR_PORT, Body, HvdSparse, bind_port, block_bytes

_T = protocol.TYPES
_TYPE_NAMES = {code: name for name, code in _T.items()}
_DTYPE_NAMES = {code: name for name, (code, _) in protocol.WIRE_DTYPES.items()}
_ERROR_NAMES = {code: name for name, code in protocol.ERRORS.items()}
MAX_LISTED = 100  # malformed datagrams listed one by one; all are counted


def check(h: HvdSparse, length: int) -> str | None:
    """The dissector's structural view of a datagram of ``length`` bytes with header ``h``:
    None when well formed, else the reason. It follows check_structure in
    csrc/omni/protocol.h (same order, same reason names), plus the bitmap's consistency
    ("bitmap"), which every receiver also checks; what needs the receiver's state (job, lane
    positions, rounds) is not judged. tests/test_dissect.py holds it to the aggregator's
    verdict on the same datagrams."""
    if length >= protocol.HEADER_BYTES and h.flags & protocol.FLAGS["AUTH"]:
        # the trailer (docs/PROTOCOL.md "Authentication") is not part of the structure
        authed = protocol.HEADER_BYTES + protocol.AUTH_BYTES
        length = length - protocol.AUTH_BYTES if length >= authed else 0
    if length < protocol.HEADER_BYTES:
        return "truncated"
    if h.magic != protocol.MAGIC:
        return "magic"
    if h.version != protocol.VERSION:
        return "version"
    if h.type not in _TYPE_NAMES:
        return "type"
    if h.reserved != 0:
        return "reserved"
    if not 0 < h.nworkers <= protocol.MAX_WORKERS or h.worker >= h.nworkers:
        return "worker"
    if h.type not in (_T["DATA"], _T["RESULT"]):
        return None if length == protocol.HEADER_BYTES else "size"
    if h.flags & protocol.FLAGS["OWN"] and h.type != _T["RESULT"]:
        return "flags"
    if h.dtype not in protocol.ELEM_SIZE:
        return "dtype"
    if not 0 < h.lanes <= protocol.MAX_LANES or h.block_size == 0:
        return "layout"
    if h.nslots == 0 or h.nblocks == 0 or h.slot >= h.nslots:
        return "slot"
    if h.present > h.lanes:
        return "count"
    if length != (protocol.HEADER_BYTES + protocol.BITMAP_BYTES
                  + h.lanes * protocol.LANE_BYTES + h.present * block_bytes(h)):
        return "size"
    body = h.getlayer(Body)
    if body is None:  # scapy could not read it although the length is right
        return "body"
    bitmap = body.bitmap
    if bitmap >> h.lanes or bin(bitmap).count("1") != h.present:
        return "bitmap"
    return None


def classify(payload: bytes) -> tuple[HvdSparse | None, str | None]:
    """(parsed packet, None) for a well-formed datagram, else (header or None, reason)."""
    if len(payload) < protocol.HEADER_BYTES:
        return None, "truncated"
    try:
        h = HvdSparse(payload)
    except Exception as e:  # noqa: BLE001 - scapy's own failure is one more malformed reason
        return None, f"undecodable: {type(e).__name__}"
    return h, check(h, len(payload))


def _hexid(x: int) -> str:
    return f"{x:#x}"


class Summary:
    """Accumulates datagrams to and from the aggregation port; ``to_dict`` reports them."""

    def __init__(self, port: int = AGGREGATOR_PORT) -> None:
        self.port = port
        self.datagrams = 0
        self.malformed: Counter[str] = Counter()
        self.malformed_list: list[dict[str, Any]] = []
        self.jobs: dict[int, dict[str, Any]] = {}
        self.addr_worker: dict[tuple[int, str], int] = {}  # (token, ip:port) -> worker id
        self.seen: set[tuple] = set()  # retransmission keys

    def _job(self, token: int) -> dict[str, Any]:
        return self.jobs.setdefault(token, {"workers": set(), "control": Counter(),
                                            "errors": Counter(), "tensors": {},
                                            "authenticated": 0, "epochs": Counter()})

    def add(self, payload: bytes, src: str, dst: str, to_aggregator: bool) -> None:
        """One UDP payload from ``src`` to ``dst`` ("ip:port")."""
        self.datagrams += 1
        h, reason = classify(payload)
        if reason is not None:
            self.malformed[reason] += 1
            if len(self.malformed_list) < MAX_LISTED:
                self.malformed_list.append({"index": self.datagrams - 1, "from": src, "to": dst,
                                            "bytes": len(payload), "reason": reason})
            return
        assert h is not None
        job = self._job(h.token)
        job["authenticated"] += bool(h.flags & protocol.FLAGS["AUTH"])  # carries a trailer
        job["epochs"][h.epoch] += 1  # more than one: a membership changed (or a straggler)
        name = _TYPE_NAMES[h.type]
        if to_aggregator:  # the sender's rank; replies carry the addressee or 0
            job["workers"].add(h.worker)
            self.addr_worker[h.token, src] = h.worker
        if name not in ("DATA", "RESULT"):
            job["control"][name] += 1
            if name == "ERROR":
                job["errors"][_ERROR_NAMES.get(h.round, str(h.round))] += 1
            return
        t = job["tensors"].setdefault(h.tensor, {
            "dtype": _DTYPE_NAMES[h.dtype], "block_size": h.block_size, "nblocks": h.nblocks,
            "lanes": h.lanes, "nslots": h.nslots, "meta": h.meta, "slots": set(),
            "rounds": set(), "complete_slots": set(), "data": 0, "result": 0,
            "retransmissions": Counter(), "per_worker": defaultdict(Counter)})
        t["slots"].add(h.slot)
        t["rounds"].add((h.slot, h.round))
        if name == "DATA":
            t["data"] += 1
            who = h.worker
            key = ("DATA", h.token, h.tensor, h.slot, h.round, h.worker)
        else:
            t["result"] += 1
            who = self.addr_worker.get((h.token, dst), dst)  # by address: RESULTs are shared
            key = ("RESULT", h.token, h.tensor, h.slot, h.round, dst)
            if h.flags & protocol.FLAGS["LAST"]:
                t["complete_slots"].add(h.slot)
            if key not in self.seen:
                t["per_worker"][who]["rounds"] += 1
        t["per_worker"][who][name.lower()] += 1
        if key in self.seen:
            t["retransmissions"][name.lower()] += 1
            t["per_worker"][who][f"{name.lower()}_retransmissions"] += 1
        self.seen.add(key)

    def add_packet(self, p: Packet) -> None:
        """One captured frame; anything but UDP to or from the port is ignored."""
        if UDP not in p or self.port not in (p[UDP].sport, p[UDP].dport):
            return
        u = p[UDP]
        ip = (p[IP].src, p[IP].dst) if IP in p else (
            (f"[{p[IPv6].src}]", f"[{p[IPv6].dst}]") if IPv6 in p else ("?", "?"))
        payload = bytes(u.payload)
        if u.len and u.len - 8 < len(payload):  # Ethernet padding of short frames
            payload = payload[:u.len - 8]
        self.add(payload, f"{ip[0]}:{u.sport}", f"{ip[1]}:{u.dport}", u.dport == self.port)

    def to_dict(self) -> dict[str, Any]:
        jobs = []
        for token, j in self.jobs.items():
            tensors = []
            for tid, t in j["tensors"].items():
                tensors.append({
                    "tensor": _hexid(tid), **{k: t[k] for k in ("dtype", "block_size",
                                                             "nblocks", "lanes", "nslots")},
                    "meta": _hexid(t["meta"]), "slots": len(t["slots"]),
                    "rounds": len(t["rounds"]),
                    "max_round": max(r for _, r in t["rounds"]),
                    "complete_slots": len(t["complete_slots"]), "data": t["data"],
                    "result": t["result"],
                    "retransmissions": {"data": t["retransmissions"]["data"],
                                        "result": t["retransmissions"]["result"]},
                    "per_worker": {str(w): dict(c) for w, c in sorted(
                        t["per_worker"].items(), key=lambda x: str(x[0]))}})
            jobs.append({"token": _hexid(token), "workers": sorted(j["workers"]),
                         "control": dict(j["control"]), "errors": dict(j["errors"]),
                         "authenticated": j["authenticated"],
                         "epochs": {str(e): n for e, n in sorted(j["epochs"].items())},
                         "tensors": tensors})
        return {"port": self.port, "datagrams": self.datagrams,
                "malformed": {"count": sum(self.malformed.values()),
                              "reasons": dict(self.malformed), "listed": self.malformed_list},
                "jobs": jobs}


def summarize(packets: list[Packet], port: int = AGGREGATOR_PORT) -> dict[str, Any]:
    """The report of captured frames (IPv4 fragments reassembled first; IPv6 ones are not,
    and workers never send any: they size datagrams to the path MTU)."""
    s = Summary(port)
    for p in defragment(packets):
        s.add_packet(p)
    return s.to_dict()


def print_report(d: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"{d['datagrams']} datagrams on UDP port {d['port']}, {len(d['jobs'])} job(s), "
              f"{d['malformed']['count']} malformed")
    for j in d["jobs"]:
        ctl = ", ".join(f"{k} {v}" for k, v in sorted(j["control"].items())) or "none"
        errs = ", ".join(f"{k} {v}" for k, v in j["errors"].items())
        epochs = ", ".join(f"{e} ({n})" for e, n in j["epochs"].items())
        t = Table(title=f"job {j['token']}: workers {j['workers']}; epochs {epochs}; "
                        f"control: {ctl}" + (f"; errors: {errs}" if errs else ""))
        for col in ("tensor", "dtype", "blocks x size", "lanes", "slots seen/n", "rounds",
                    "max round", "complete", "DATA", "RESULT", "retx DATA", "retx RESULT"):
            t.add_column(col)
        for x in j["tensors"]:
            t.add_row(x["tensor"], x["dtype"], f"{x['nblocks']} x {x['block_size']}",
                      str(x["lanes"]), f"{x['slots']}/{x['nslots']}", str(x["rounds"]),
                      str(x["max_round"]), str(x["complete_slots"]), str(x["data"]),
                      str(x["result"]), str(x["retransmissions"]["data"]),
                      str(x["retransmissions"]["result"]))
        con.print(t)
    if d["malformed"]["count"]:
        t = Table(title="malformed datagrams (reasons as in csrc/omni/protocol.h)")
        for col in ("#", "from", "to", "bytes", "reason"):
            t.add_column(col)
        for m in d["malformed"]["listed"]:
            t.add_row(str(m["index"]), m["from"], m["to"], str(m["bytes"]), m["reason"])
        con.print(t)
        con.print("by reason: " + ", ".join(f"{k} {v}" for k, v in
                                            sorted(d["malformed"]["reasons"].items())))


CAPTURE_BUFFER = 256 << 20


def _grow_buffer(sock: Any) -> None:
    """Scapy reads (and parses) frames one by one in Python, far slower than a link delivers
    a burst of jumbo frames: a large kernel buffer keeps a job's burst from being dropped
    (root may exceed rmem_max). For long captures at line rate, tcpdump -w and dissect the
    file."""
    raw = getattr(sock, "ins", None)
    if raw is None:
        return
    for opt in (getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF):
        try:
            if opt is not None:
                raw.setsockopt(socket.SOL_SOCKET, opt, CAPTURE_BUFFER)
                return
        except OSError:
            continue


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvd-sparse dissect",
                                description="jobs, tensors, rounds, retransmissions and "
                                            "malformed packets of aggregation traffic")
    p.add_argument("pcap", nargs="?", help="a capture file (pcap or pcapng)")
    p.add_argument("--iface", help="capture live on this interface live (Ctrl-C or SIGTERM stops)")
    p.add_argument("--count", type=int, default=0, help="live: stop after N frames")
    p.add_argument("--timeout", type=float, default=None, help="live: stop after S seconds")
    p.add_argument("--write", help="live: also save the frames to this pcap file")
    p.add_argument("--port", type=int, default=AGGREGATOR_PORT, help="the aggregators' port")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if (a.pcap is None) == (a.iface is None):
        print("hvd-sparse dissect: give a capture file or --iface", file=sys.stderr)
        return 2
    if a.port != AGGREGATOR_PORT:
        bind_port(a.port)
    from scapy.config import conf
    from scapy.error import Scapy_Exception
    from scapy.sendrecv import sniff
    from scapy.utils import rdpcap, wrpcap
    try:
        if a.pcap:
            packets = list(rdpcap(a.pcap))
        else:
            def ready() -> None:
                print(f"hvd-sparse dissect: listening on {a.iface}", file=sys.stderr,
                      flush=True)
            # Fragments too (offset or more-fragments set): reassembled before the report.
            bpf = f"udp port {a.port} or (ip[6:2] & 0x3fff != 0)"
            sock = conf.L2listen(iface=a.iface, filter=bpf)
            _grow_buffer(sock)
            # SIGINT and SIGTERM end the capture (scapy stops on KeyboardInterrupt) and the
            # report follows. Set explicitly: a process started in the background inherits
            # SIGINT ignored, and Python then leaves it so.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.default_int_handler)
            try:
                packets = list(sniff(opened_socket=sock, count=a.count, timeout=a.timeout,
                                     started_callback=ready))
            finally:
                sock.close()
            if a.write:
                wrpcap(a.write, packets)
    except (OSError, ValueError, Scapy_Exception) as e:
        print(f"hvd-sparse dissect: {e}", file=sys.stderr)
        return 1
    d = summarize(packets, a.port)
    if a.json:
        print(json.dumps(d, indent=1))
    else:
        print_report(d)
    return 0
