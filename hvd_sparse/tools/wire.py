"""Packets of the aggregation protocol, in Python, for tests, dissectors and tools.

Built from the one definition in csrc/omni/protocol.h (through ``hvd_sparse.protocol``), not
retyped: field names, offsets and sizes come from there. Torch-free; the data path never uses
this module.
"""
from __future__ import annotations

import struct
from typing import Any

from ..protocol import (
    BITMAP_BYTES,
    ELEM_SIZE,
    FIELDS,
    HEADER_BYTES,
    LANE_BYTES,
    MAGIC,
    TYPES,
    VERSION,
)

_HEADER = struct.Struct(">" + "".join({1: "B", 2: "H", 4: "I", 8: "Q"}[size]
                                      for _, _, size in FIELDS))
# The fields are packed back to back; the C++ definition must say the same.
assert [sum(f[2] for f in FIELDS[:i]) for i in range(len(FIELDS))] == [f[1] for f in FIELDS]
assert _HEADER.size == HEADER_BYTES


def header(**fields: int) -> bytes:
    """A header with the given fields; magic and version default to the protocol's, epoch to
    1 (a job's first membership, what ``OmniWorker`` sends by default), the others to 0."""
    values = {"magic": MAGIC, "version": VERSION, "epoch": 1, **fields}
    return _HEADER.pack(*(values.get(name, 0) for name, _, _ in FIELDS))


def data(lanes: list[tuple[int, int]], blocks: dict[int, bytes], **fields: int) -> bytes:
    """A DATA (or RESULT) packet: ``lanes`` = [(offset, next)] per lane, ``blocks`` = lane ->
    block bytes; the header's lanes and present fields are filled in."""
    bitmap = sum(1 << lane for lane in blocks)
    body = struct.pack(">Q", bitmap) + b"".join(struct.pack(">II", o, n) for o, n in lanes)
    fields = {"type": TYPES["DATA"], **fields, "lanes": len(lanes), "present": len(blocks)}
    return header(**fields) + body + b"".join(blocks[lane] for lane in sorted(blocks))


def parse(packet: bytes) -> dict[str, Any]:
    """Header fields, plus for DATA/RESULT: bitmap, lanes [(offset, next)] and block bytes."""
    out: dict[str, Any] = dict(zip([f[0] for f in FIELDS], _HEADER.unpack_from(packet),
                                   strict=True))
    if out["type"] in (TYPES["DATA"], TYPES["RESULT"]):
        pos = HEADER_BYTES
        (out["bitmap"],) = struct.unpack_from(">Q", packet, pos)
        pos += BITMAP_BYTES
        out["lane_table"] = [struct.unpack_from(">II", packet, pos + LANE_BYTES * i)
                             for i in range(out["lanes"])]
        pos += LANE_BYTES * out["lanes"]
        size = out["block_size"] * ELEM_SIZE.get(out["dtype"], 4)
        out["blocks"] = [packet[pos + i * size: pos + (i + 1) * size]
                         for i in range(out["present"])]
    return out
