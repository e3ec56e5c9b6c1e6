"""Scapy layers of the aggregation protocol (docs/PROTOCOL.md), bound to the aggregation port.

Generated from the one description, ``hvd_sparse.protocol`` (csrc/omni/protocol.h): the
header's fields are ``protocol.FIELDS`` (name, offset, size), its enums ``TYPES``, ``DTYPES``
and ``FLAGS``; the DATA/RESULT body's lengths come from the header (lanes, present,
block_size, the dtype's element size). No offset or constant is retyped here. Torch-free.

    >>> from hvd_sparse.tools.scapy_layer import HvdSparse, Body, Lane
    >>> p = HvdSparse(type="DATA", token=5, dtype="float32", block_size=2, nblocks=1,
    ...               nslots=1, nworkers=1) / Body(bitmap=1, lane_table=[Lane(offset=0)],
    ...                                             blocks=[bytes(8)])
    >>> HvdSparse(bytes(p)).lanes   # lanes and present are counted from the body
    1
"""
from __future__ import annotations

from typing import Any

from scapy.fields import (
    ByteField,
    EnumField,
    FieldListField,
    FlagsField,
    IntField,
    LongField,
    PacketListField,
    ShortField,
    StrLenField,
    XByteField,
    XIntField,
    XLongField,
    XShortField,
    XStrFixedLenField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from .. import protocol
from ..protocol import AGGREGATOR_PORT

_PLAIN = {1: ByteField, 2: ShortField, 4: IntField, 8: LongField}
_HEX = {1: XByteField, 2: XShortField, 4: XIntField, 8: XLongField}
_FMT = {1: "B", 2: "H", 4: "I", 8: "Q"}  # big-endian struct codes, for enum fields
_SHOWN_HEX = {"magic", "token", "tensor", "meta"}  # identifiers, not quantities
_ENUMS = {"type": {code: name for name, code in protocol.TYPES.items()},
          "dtype": {code: name for name, (code, _) in protocol.WIRE_DTYPES.items()}}
_DEFAULTS = {"magic": protocol.MAGIC, "version": protocol.VERSION, "epoch": 1}
# Left None, these are counted from the body when the packet is built (as wire.data does).
_COUNTED = ("lanes", "present")
OFFSETS: dict[str, tuple[int, int]] = {name: (off, size) for name, off, size in protocol.FIELDS}


def _field(name: str, size: int) -> Any:
    default = None if name in _COUNTED else _DEFAULTS.get(name, 0)
    if name in _ENUMS:
        return EnumField(name, default, _ENUMS[name], fmt=_FMT[size])
    if name == "flags":
        return FlagsField(name, default, 8 * size, {v: k for k, v in protocol.FLAGS.items()})
    return (_HEX if name in _SHOWN_HEX else _PLAIN)[size](name, default)


def block_bytes(header: Packet) -> int:
    """Bytes of one block of this header's tensor (0 for an unknown dtype)."""
    return header.block_size * protocol.ELEM_SIZE.get(header.dtype, 0)


class HvdSparse(Packet):
    """The fixed header (``protocol.HEADER_BYTES``), one scapy field per entry of
    ``protocol.FIELDS``."""

    name = "hvd-sparse"
    fields_desc = [_field(name, size) for name, _, size in protocol.FIELDS]

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        if self.type in (protocol.TYPES["DATA"], protocol.TYPES["RESULT"]) and \
                self.dtype in protocol.ELEM_SIZE:
            return Body
        if self.flags & protocol.FLAGS["AUTH"]:
            return Trailer
        return super().guess_payload_class(payload)  # Raw: bytes a control packet must lack

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        body = self.payload if isinstance(self.payload, Body) else None
        counts = {"lanes": len(body.lane_table) if body else 0,
                  "present": len(body.blocks) if body else 0}
        for name in _COUNTED:
            if getattr(self, name) is None:
                off, size = OFFSETS[name]
                pkt = pkt[:off] + counts[name].to_bytes(size, "big") + pkt[off + size:]
        return pkt + pay

    def mysummary(self) -> str:
        return self.sprintf("hvd-sparse %type% token=%token% epoch=%epoch% worker=%worker% "
                            "tensor=%tensor% slot=%slot% round=%round%")


_LANE_FIELD = protocol.LANE_BYTES // 2  # {uint32 offset, uint32 next}
assert 2 * _LANE_FIELD == protocol.LANE_BYTES


class Lane(Packet):
    """One lane table entry: the lane's position this round and the sender's next one."""

    name = "lane"
    fields_desc = [_PLAIN[_LANE_FIELD]("offset", 0), _PLAIN[_LANE_FIELD]("next", protocol.INF)]

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        return b"", s  # the rest is the next entry, not this one's payload


def _header(body: Packet) -> Packet | None:
    return body.underlayer if isinstance(body.underlayer, HvdSparse) else None


class Body(Packet):
    """DATA/RESULT after the header: the lane bitmap, ``lanes`` lane entries and ``present``
    blocks of ``block_size`` values in the header's dtype (raw little-endian bytes)."""

    name = "hvd-sparse body"
    fields_desc = [
        _HEX[protocol.BITMAP_BYTES]("bitmap", 0),
        PacketListField("lane_table", [], Lane,
                        count_from=lambda p: h.lanes if (h := _header(p)) else 0),
        FieldListField("blocks", [],
                       StrLenField("", b"",
                                   length_from=lambda p: block_bytes(h) if (h := _header(p))
                                   else 0),
                       count_from=lambda p: h.present if (h := _header(p)) else 0),
    ]

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        h = _header(self)
        if h is not None and h.flags & protocol.FLAGS["AUTH"]:
            return Trailer
        return super().guess_payload_class(payload)


class Trailer(Packet):
    """What ends a packet flagged AUTH: its sequence number and GMAC tag."""

    name = "hvd-sparse auth"
    fields_desc = [_PLAIN[protocol.AUTH_BYTES - protocol.TAG_BYTES]("seq", 0),
                   XStrFixedLenField("tag", bytes(protocol.TAG_BYTES), protocol.TAG_BYTES)]


def bind_port(port: int) -> None:
    """Dissects UDP to and from ``port`` as the protocol (the aggregators' port)."""
    bind_layers(UDP, HvdSparse, dport=port)
    bind_layers(UDP, HvdSparse, sport=port)


bind_port(AGGREGATOR_PORT)  # the testbed's (`hvd-sparse testbed up`)
