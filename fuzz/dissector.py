"""Fuzz target: ``hvd-sparse dissect`` (hvd_sparse/tools/dissect.py) over a script of
datagrams (fuzz/pyharness.py; control byte: bit 0 set for a datagram to the aggregation port,
bits 1-2 the worker it comes from or goes to, bit 7 as a captured IPv4 frame, through scapy,
``Summary.add_packet`` and ``summarize``, rather than as a UDP payload).

Each datagram's verdict (``classify``, ``check``) must be the aggregator's: a fresh
``_C.AggregatorCore`` counts as malformed exactly the datagrams whose reason is neither None
nor "bitmap" (the dissector's one check beyond check_structure, which a receiver applies only
to a DATA of a job it knows). The reports of all of them must be JSON. The dissector reports
malformed datagrams and never raises: it has no clean refusal.
"""
from __future__ import annotations

import json

import torch  # noqa: F401 - loads the libraries hvd_sparse._C links against
from pyharness import datagrams
from scapy.layers.inet import IP, UDP
from scapy.packet import Raw

from hvd_sparse import _C
from hvd_sparse.tools import dissect
from hvd_sparse.tools.scapy_layer import AGGREGATOR_PORT

CLEAN: tuple[type[BaseException], ...] = ()
AGGREGATOR = ("10.0.0.100", AGGREGATOR_PORT)
WELL_FORMED = (None, "bitmap")


def aggregator_says_malformed(payload: bytes) -> bool:
    core = _C.AggregatorCore()  # no job, no secret: its verdict is the structure's alone
    core.handle(payload, ("10.0.0.1", 5000))
    return core.counters()["malformed"] == 1


def test_one_input(data: bytes) -> None:
    summary, frames = dissect.Summary(), []
    for ctl, payload in datagrams(data):
        w = ctl >> 1 & 3
        worker = (f"10.0.0.{1 + w}", 5000 + w)
        src, dst = (worker, AGGREGATOR) if ctl & 1 else (AGGREGATOR, worker)
        _, reason = dissect.classify(payload)
        if aggregator_says_malformed(payload) != (reason not in WELL_FORMED):
            raise AssertionError(f"the dissector says {reason!r} of a datagram the aggregator "
                                 f"takes for {'malformed' if reason in WELL_FORMED else 'sound'}"
                                 f": {payload.hex()}")
        if ctl & 0x80:
            frame = IP(src=src[0], dst=dst[0]) / UDP(sport=src[1], dport=dst[1]) / Raw(payload)
            frames.append(IP(bytes(frame)))
        else:
            summary.add(payload, "{}:{}".format(*src), "{}:{}".format(*dst), bool(ctl & 1))
    json.dumps(summary.to_dict())
    if frames:
        json.dumps(dissect.summarize(frames))
