"""The emulated switch's program (hvd_sparse.tools.switch.program): the aggregation program
fits Tofino 1's limits, and the loader refuses, like a P4 compiler, programs that do not (a 13th
stage, a 5th ALU in a stage, wide or shared registers, floating point, too much payload per
pass, too many slots)."""
from __future__ import annotations

import dataclasses

import pytest
import torch  # noqa: F401  (loads libc10, which hvd_sparse._C links against)

from hvd_sparse import _C, protocol
from hvd_sparse.tools import wire
from hvd_sparse.tools.switch.program import (
    Action,
    Limits,
    ProgramError,
    Register,
    Stage,
    aggregation_program,
    load,
    wire_share,
)


def test_the_aggregation_program_fits_tofino_1():
    r = load(aggregation_program())
    lim = Limits()
    assert r.stages <= lim.stages == 12
    assert all(alus <= lim.alus_per_stage for alus, _ in r.per_stage)
    assert r.values_per_pass * 4 == lim.payload_per_pass == 256
    assert r.slots == 8192
    # 64 values = 32 pair registers, one ALU each, plus the round, seen, count, next,
    # overflow, holders and opened registers.
    assert r.alus == 32 + 7
    assert "stages 11 of 12" in r.report()


def test_a_thirteenth_stage_is_refused():
    p = aggregation_program()
    longer = dataclasses.replace(p, stages=(*p.stages, Stage(), Stage()))
    assert len(longer.stages) == 13
    with pytest.raises(ProgramError, match="needs 13 stages, the switch has 12"):
        load(longer)
    load(longer, Limits(stages=20))  # Tofino 2 has 20


@pytest.mark.parametrize("change,message", [
    (lambda p: dataclasses.replace(p, stages=(Stage(actions=tuple(
        Action(f"values{i}", "add") for i in range(5))), *p.stages[1:])),
     "needs 5 stateful ALUs, a stage has 4"),
    (lambda p: dataclasses.replace(p, registers=(Register("round", 96, 16384),
                                                 *p.registers[1:])),
     "96 bits wide, an entry has at most 64"),
    (lambda p: dataclasses.replace(p, stages=(Stage(actions=(Action("round", "fadd"),)),
                                              *p.stages[1:])),
     "no floating point"),
    (lambda p: dataclasses.replace(p, stages=(*p.stages[:-1],
                                              Stage(actions=(Action("values0", "add"),)))),
     "values0 is used in stages 2 and 10"),
    (lambda p: dataclasses.replace(p, stages=(Stage(actions=(Action("round", "read"),
                                                             Action("round", "write"))),
                                              *p.stages[1:])),
     "touches round twice in one pass"),
], ids=["5 ALUs", "96-bit register", "float add", "register in two stages", "twice per pass"])
def test_programs_beyond_the_limits_are_refused(change, message):
    with pytest.raises(ProgramError, match=message):
        load(change(aggregation_program()))


def test_payload_and_pool_limits():
    with pytest.raises(ProgramError, match="a pass touches at most 256 B"):
        load(aggregation_program(values_per_pass=128))
    with pytest.raises(ProgramError, match="32,768 entries"):
        load(aggregation_program(slots=16384))
    load(aggregation_program(slots=4096, values_per_pass=32))


def test_passes_and_line_rate():
    r = load(aggregation_program())
    assert [r.passes(b) for b in (4, 256, 257, 1024)] == [1, 1, 2, 4]
    assert r.line_rate_kept(256, 32) == 1.0
    # 3 extra passes per 1 KiB packet from 4 ports share one recirculation port.
    assert r.line_rate_kept(1024, 4) == pytest.approx(1 / 12)


def test_the_switch_path_fits_one_pass():
    """The geometry workers are told (a slot's values) takes one pass, so a real pipe keeps
    line rate with every port sending; the emulator sums such a packet in one pass and refuses
    a packet that would need two; the price is the headers around 256 B of values."""
    r = load(aggregation_program())
    slot = protocol.SWITCH_CELLS_PER_SLOT * protocol.SWITCH_VALUES_PER_PASS * 4
    assert (slot, r.passes(slot), r.line_rate_kept(slot, 32)) == (256, 1, 1.0)
    assert r.line_rate_kept(8192, 4) == pytest.approx(1 / (31 * 4))  # the old 8 KiB slots
    # 256 B of values in 402 B on the wire (Ethernet 38, IPv4 20, UDP 8, ours 64 + 8 + 8)
    assert wire_share(256) == pytest.approx(256 / 402)
    assert wire_share(8192) > 0.98
    sw = _C.SwitchPipeline(auto_groups=4)
    for values, ok in ((64, True), (128, False)):
        token = 0x90 + values
        sw.handle(wire.header(type=protocol.TYPES["REGISTER"], token=token, worker=0,
                              nworkers=1), ("10.0.0.1", 5000))
        before = sw.counters()
        out = sw.handle(wire.data([(0, protocol.INF)], {0: bytes(4 * values)}, token=token,
                                  worker=0, nworkers=1, dtype=protocol.FIXED32, tensor=1,
                                  block_size=values, nblocks=1, nslots=1), ("10.0.0.1", 5000))
        after = sw.counters()
        got = wire.parse(out[0][1])
        assert (got["type"] == protocol.TYPES["RESULT"]) == ok, got
        assert after["recirculations"] == before["recirculations"]
