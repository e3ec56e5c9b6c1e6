"""The aggregation protocol (docs/PROTOCOL.md) as Python values: constants, header fields,
dtype codes and the stream geometry.

Read from the one definition, csrc/omni/protocol.h and csrc/blocks.h, through the small
extension ``hvd_sparse._protocol`` (plain CPython API): nothing here is retyped, and nothing
needs torch or Horovod, so aggregator hosts and packet tools can import it.
"""
from __future__ import annotations

from ._protocol import (
    AGGREGATOR_PORT,
    AGGREGATOR_SENDER,
    AUTH_BYTES,
    BITMAP_BYTES,
    HEADER_BYTES,
    HELD_AFTER,
    INF,
    LANE_BYTES,
    MAGIC,
    MAX_DATAGRAM,
    MAX_LANES,
    MAX_WORKERS,
    SWITCH_CELLS,
    SWITCH_CELLS_PER_SLOT,
    SWITCH_MAX_WORKERS,
    SWITCH_VALUES_PER_PASS,
    TAG_BYTES,
    VERSION,
)
from ._protocol import DTYPES as _DTYPES
from ._protocol import ERRORS as _ERRORS
from ._protocol import FIELDS as _FIELDS
from ._protocol import FLAGS as _FLAGS
from ._protocol import TYPES as _TYPES
from ._protocol import WIRE_DTYPES as _WIRE_DTYPES
from ._protocol import layout as _layout
from ._protocol import stream_block as _stream_block
from ._protocol import stream_length as _stream_length

# The constants, as named in protocol.h: MAGIC, VERSION, HEADER_BYTES, BITMAP_BYTES, LANE_BYTES (per
# lane: {uint32 offset, uint32 next}), INF (lane position "none"), MAX_LANES, MAX_WORKERS,
# MAX_DATAGRAM (largest UDP payload over IPv4, and below IPv6's), AGGREGATOR_PORT (the UDP port of
# the docs, testbed and images). Authentication: a packet flagged AUTH ends with AUTH_BYTES of
# trailer, {uint64 sequence number, TAG_BYTES of GMAC tag}; an aggregator's sender id in the nonce
# is AGGREGATOR_SENDER + its index in the job's list (a worker's: its worker id). HELD_AFTER:
# seconds a round waits before a resend into it is answered HELD. The switch's (docs/PROTOCOL.md
# "In-network aggregation"), the emulator's defaults and what its program declares:
# SWITCH_VALUES_PER_PASS (int32 values one pass sums, 256 B), SWITCH_CELLS_PER_SLOT (cells, i.e.
# passes, one slot holds), SWITCH_MAX_WORKERS (workers per job: a 32-bit seen-bitmap), SWITCH_CELLS
# (cells of the register pool). A switch's REGACK carries the geometry it actually has, which the
# worker engine reads (OmniWorker.slot_geometry(), payload_bytes()).
__all__ = ["AGGREGATOR_PORT", "AGGREGATOR_SENDER", "AUTH_BYTES", "BITMAP_BYTES", "DTYPES",
           "ELEM_SIZE", "ERRORS", "FIELDS", "FIXED32", "FLAGS", "HEADER_BYTES", "HELD_AFTER",
           "INF", "LANE_BYTES", "MAGIC", "MAX_DATAGRAM", "MAX_LANES", "MAX_WORKERS",
           "SWITCH_CELLS", "SWITCH_CELLS_PER_SLOT", "SWITCH_MAX_WORKERS", "SWITCH_VALUES_PER_PASS",
           "TAG_BYTES", "TYPES", "VERSION", "WIRE_DTYPES", "layout", "stream_block",
           "stream_length"]

TYPES: dict[str, int] = dict(_TYPES)  # packet type name -> code
FLAGS: dict[str, int] = dict(_FLAGS)
ERRORS: dict[str, int] = dict(_ERRORS)  # ERROR packets' code (in the round field)
FIELDS: list[tuple[str, int, int]] = [tuple(f) for f in _FIELDS]  # (name, offset, size)
DTYPES: dict[str, tuple[int, int]] = dict(_DTYPES)  # tensor dtype "float32" -> (code, size)
# What DATA and RESULT may carry: the tensor dtypes and "fixed32" (int32 fixed point)
WIRE_DTYPES: dict[str, tuple[int, int]] = dict(_WIRE_DTYPES)
FIXED32: int = WIRE_DTYPES["fixed32"][0]
ELEM_SIZE: dict[int, int] = {code: size for code, size in WIRE_DTYPES.values()}  # code -> bytes


def layout(nblocks: int, block_size: int, esize: int, payload: int,
           max_slots: int) -> tuple[int, int]:
    """(lanes, nslots) of a tensor of ``nblocks`` blocks: as many lanes as ``payload`` bytes of
    values hold (1 .. MAX_LANES), one slot per packet's worth of blocks, at most ``max_slots``."""
    return _layout(nblocks, block_size, esize, payload, max_slots)


def stream_length(slot: int, lane: int, nblocks: int, nslots: int, lanes: int) -> int:
    """Positions of the stream that is ``lane`` of ``slot``."""
    return _stream_length(slot, lane, nblocks, nslots, lanes)


def stream_block(slot: int, lane: int, pos: int, nslots: int, lanes: int) -> int:
    """Block index at position ``pos`` of the stream that is ``lane`` of ``slot``."""
    return _stream_block(slot, lane, pos, nslots, lanes)
