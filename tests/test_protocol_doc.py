"""docs/PROTOCOL.md's header table is the code's (hvd_sparse.protocol, from protocol.h) and
hvd_sparse.tools.wire writes and reads it."""
from __future__ import annotations

import re
from pathlib import Path

from hvd_sparse import protocol
from hvd_sparse.tools import wire

ROOT = Path(__file__).resolve().parents[1]


def test_protocol_doc_matches_the_code():
    """docs/PROTOCOL.md's header table, protocol.h's field list (through hvd_sparse._protocol)
    and the bytes hvd_sparse.tools.wire writes are one and the same."""
    doc = (ROOT / "docs" / "PROTOCOL.md").read_text()
    section = doc.split("### Packet format", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\w+)\s*\|(.*)\|\s*$", section, re.M)
    fields = [(name, int(off), int(size)) for off, size, name, _ in rows]
    assert fields == protocol.FIELDS
    assert f"Header, {protocol.HEADER_BYTES} bytes" in section
    assert sum(size for _, _, size in fields) == protocol.HEADER_BYTES
    meaning = {name: text for _, _, name, text in rows}
    types = {name: int(num) for num, name in re.findall(r"(\d+) ([A-Z]+)", meaning["type"])}
    assert types == protocol.TYPES
    dtypes = {name: int(num) for num, name in re.findall(r"(\d+) (\w+)", meaning["dtype"])}
    assert dtypes == {name: code for name, (code, _) in protocol.WIRE_DTYPES.items()}
    flags = {name: int(num) for num, name in re.findall(r"(\d+) ([A-Z]+)", meaning["flags"])}
    assert flags == protocol.FLAGS
    errors = {name: int(num) for num, name in
              re.findall(r"(\d+) ([A-Z]+)", meaning["round"].split("ERROR:")[1])}
    assert errors == protocol.ERRORS
    assert f"`0x{protocol.MAGIC:08X}`" in meaning["magic"]
    assert meaning["version"].strip() == str(protocol.VERSION)
    assert re.search(rf"`INF` =\s+`0x{protocol.INF:08X}`", section)
    # wire.py puts every field, big-endian, at the documented offset, and reads it back.
    values = {name: (0x0123456789ABCDEF >> (8 * (8 - size))) ^ i for i, (name, _, size)
              in enumerate(fields)}
    values["type"] = protocol.TYPES["REGISTER"]  # a header-only packet, for parse()
    raw = wire.header(**values)
    assert len(raw) == protocol.HEADER_BYTES
    for name, off, size in fields:
        assert int.from_bytes(raw[off:off + size], "big") == values[name], name
    assert {k: v for k, v in wire.parse(raw).items() if k in values} == values
