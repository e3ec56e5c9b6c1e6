"""The aggregation protocol (docs/PROTOCOL.md) as Python values: constants, header fields,
dtype codes and the stream geometry.

Read from the one definition, csrc/omni/protocol.h and csrc/blocks.h, through the small
extension ``hvd_sparse._protocol`` (plain CPython API): nothing here is retyped, and nothing
needs torch or Horovod, so aggregator hosts and packet tools can import it.
"""
from __future__ import annotations

from . import _protocol as _p

MAGIC: int = _p.MAGIC
VERSION: int = _p.VERSION
HEADER_BYTES: int = _p.HEADER_BYTES
BITMAP_BYTES: int = _p.BITMAP_BYTES
LANE_BYTES: int = _p.LANE_BYTES  # per lane: {uint32 offset, uint32 next}
INF: int = _p.INF  # lane position "none"
MAX_LANES: int = _p.MAX_LANES
MAX_WORKERS: int = _p.MAX_WORKERS
MAX_DATAGRAM: int = _p.MAX_DATAGRAM  # largest UDP payload over IPv4
AGGREGATOR_PORT: int = _p.AGGREGATOR_PORT  # the UDP port of the docs, testbed and images

# The switch (docs/PROTOCOL.md "In-network aggregation"): the emulator's defaults and what
# switch_emu.program declares. A switch's REGACK carries the geometry it actually has, which the
# worker engine reads (OmniWorker.slot_geometry(), payload_bytes()).
SWITCH_VALUES_PER_PASS: int = _p.SWITCH_VALUES_PER_PASS  # int32 values one pass sums (256 B)
SWITCH_CELLS_PER_SLOT: int = _p.SWITCH_CELLS_PER_SLOT  # cells (passes) one slot holds
SWITCH_MAX_WORKERS: int = _p.SWITCH_MAX_WORKERS  # workers per job: a 32-bit seen-bitmap
SWITCH_CELLS: int = _p.SWITCH_CELLS  # cells of the register pool

TYPES: dict[str, int] = dict(_p.TYPES)  # packet type name -> code
FLAGS: dict[str, int] = dict(_p.FLAGS)
ERRORS: dict[str, int] = dict(_p.ERRORS)  # ERROR packets' code (in the round field)
FIELDS: list[tuple[str, int, int]] = [tuple(f) for f in _p.FIELDS]  # (name, offset, size)
DTYPES: dict[str, tuple[int, int]] = dict(_p.DTYPES)  # tensor dtype "float32" -> (code, size)
# What DATA and RESULT may carry: the tensor dtypes and "fixed32" (int32 fixed point)
WIRE_DTYPES: dict[str, tuple[int, int]] = dict(_p.WIRE_DTYPES)
FIXED32: int = WIRE_DTYPES["fixed32"][0]
ELEM_SIZE: dict[int, int] = {code: size for code, size in WIRE_DTYPES.values()}  # code -> bytes


def layout(nblocks: int, block_size: int, esize: int, payload: int,
           max_slots: int) -> tuple[int, int]:
    """(lanes, nslots) of a tensor of ``nblocks`` blocks: as many lanes as ``payload`` bytes of
    values hold (1 .. MAX_LANES), one slot per packet's worth of blocks, at most ``max_slots``."""
    return _p.layout(nblocks, block_size, esize, payload, max_slots)


def stream_length(slot: int, lane: int, nblocks: int, nslots: int, lanes: int) -> int:
    """Positions of the stream that is ``lane`` of ``slot``."""
    return _p.stream_length(slot, lane, nblocks, nslots, lanes)


def stream_block(slot: int, lane: int, pos: int, nslots: int, lanes: int) -> int:
    """Block index at position ``pos`` of the stream that is ``lane`` of ``slot``."""
    return _p.stream_block(slot, lane, pos, nslots, lanes)
