"""The aggregation program as a P4-like pipeline, and the loader that fits it to a switch.

A programmable switch runs a fixed pipeline: a parser, a few match-action stages, a deparser.
Each stage has a handful of stateful ALUs, and each ALU updates one register entry of at most
64 bits, once per packet pass, with integer arithmetic only. A packet touches a bounded
payload per pass; more takes recirculation passes, which cost line rate. This module states
those limits (``Limits``, Tofino 1 figures by default), declares the program hvd-sparse
aggregation needs (``aggregation_program``) and checks one against the other (``load``),
refusing, like a compiler, what does not fit. The emulator's data path enforces the same
numbers at run time; this file is the documentation of what a real switch could do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ... import protocol

# Register operations a stateful ALU can do: integer only (no floating point in a switch).
INTEGER_OPS = frozenset({"read", "write", "add", "sub", "min", "max", "or", "and",
                         "add_saturate", "cond_write"})


class ProgramError(ValueError):
    """The program does not fit the switch; the message names the limit and the offender."""


@dataclass(frozen=True)
class Limits:
    """One pipe of a switch. Defaults: Tofino 1, as SwitchML and ATP use it."""

    stages: int = 12                 # match-action stages per pipe
    alus_per_stage: int = 4          # stateful ALUs per stage
    register_bits: int = 64          # one register entry, touched once per pass (2 x 32 bits)
    entries_per_register: int = 16_384  # entries of one ALU's register array (SwitchML's pool)
    payload_per_pass: int = 256      # bytes of payload one pass may touch (64 int32)
    # a job's workers: the seen-bitmap is one 32-bit register
    max_workers: int = protocol.SWITCH_MAX_WORKERS
    recirculation_ports: int = 1     # per pipe: how many extra passes the pipe can absorb
    ports: int = 32                  # front-panel ports per pipe


@dataclass(frozen=True)
class Register:
    """A register array: ``entries`` entries of ``width`` bits, living in one stage."""

    name: str
    width: int
    entries: int


@dataclass(frozen=True)
class Action:
    """One stateful ALU: ``op`` on one entry of register ``register`` per pass."""

    register: str
    op: str
    why: str = ""


@dataclass(frozen=True)
class Stage:
    actions: tuple[Action, ...] = ()
    tables: tuple[str, ...] = ()  # match tables applied in this stage


@dataclass(frozen=True)
class Program:
    name: str
    parser: tuple[str, ...]       # headers extracted, in order
    registers: tuple[Register, ...]
    stages: tuple[Stage, ...]
    deparser: tuple[str, ...]
    values_per_pass: int          # int32 values summed per pass
    slots: int                    # aggregation slots (each with its shadow copy)


@dataclass(frozen=True)
class Resources:
    """What a loaded program uses, of what the switch has."""

    limits: Limits
    stages: int
    alus: int
    register_bits: int
    register_entries: int
    slots: int
    values_per_pass: int
    per_stage: list[tuple[int, int]] = field(default_factory=list)  # (ALUs, entries)

    def passes(self, payload_bytes: int) -> int:
        """Passes through the pipe for a packet carrying ``payload_bytes`` of values."""
        return max(1, math.ceil(payload_bytes / (self.values_per_pass * 4)))

    def line_rate_kept(self, payload_bytes: int, workers: int) -> float:
        """Fraction of line rate a real switch would keep with every port sending such packets
        (``line_rate_kept`` below)."""
        return line_rate_kept(self.passes(payload_bytes), workers, self.limits)

    def report(self) -> str:
        lim = self.limits
        lines = [f"stages {self.stages} of {lim.stages}",
                 f"stateful ALUs {self.alus} of {lim.stages * lim.alus_per_stage}",
                 f"register entries {self.register_entries:,} of "
                 f"{lim.stages * lim.alus_per_stage * lim.entries_per_register:,} "
                 f"({self.register_bits / 8 / 2**20:.1f} MiB)",
                 f"aggregation slots {self.slots:,} (each with a shadow copy)",
                 f"values per pass {self.values_per_pass} int32 "
                 f"({self.values_per_pass * 4} B of {lim.payload_per_pass} B)"]
        slot = protocol.SWITCH_CELLS_PER_SLOT * self.values_per_pass * 4
        lines.append(f"packets: {slot} B of values, {self.passes(slot)} pass(es): line rate "
                     f"kept {self.line_rate_kept(slot, lim.ports):.0%} with {lim.ports} ports "
                     f"sending; values {wire_share(slot):.0%} of the bytes on the wire")
        return "\n".join(lines)


def line_rate_kept(passes: float, workers: int, limits: Limits | None = None) -> float:
    """Fraction of line rate a real switch keeps when ``workers`` ports send, at line rate,
    packets taking ``passes`` passes each (on average): every pass after the first goes through
    a recirculation port, ``limits.recirculation_ports`` per pipe at the ports' rate, which
    takes the extra passes of only so many ports at full rate. The limit modelled: recirculation
    bandwidth per pipe (Tofino 1: one 100G recirculation port per pipe of 16 front ports)."""
    extra = max(0.0, passes - 1)
    if extra == 0:
        return 1.0
    return min(1.0, (limits or Limits()).recirculation_ports / (extra * workers))


def wire_share(payload_bytes: int, lanes: int = 1) -> float:
    """The values' share of a DATA packet's bytes on the wire: Ethernet (with FCS, preamble
    and inter-frame gap), IPv4, UDP, the protocol's header, bitmap and lane entries around
    ``payload_bytes`` of values."""
    around = (14 + 4 + 20) + 20 + 8 + protocol.HEADER_BYTES + protocol.BITMAP_BYTES \
        + lanes * protocol.LANE_BYTES
    return payload_bytes / (payload_bytes + around)


def load(program: Program, limits: Limits | None = None) -> Resources:
    """Fits ``program`` to the switch, or raises ProgramError naming what does not fit."""
    lim = limits or Limits()
    regs = {r.name: r for r in program.registers}
    if len(regs) != len(program.registers):
        raise ProgramError(f"{program.name}: a register array is declared twice")
    if program.values_per_pass * 4 > lim.payload_per_pass:
        raise ProgramError(f"{program.name}: {program.values_per_pass} int32 per pass is "
                           f"{program.values_per_pass * 4} B; a pass touches at most "
                           f"{lim.payload_per_pass} B")
    if len(program.stages) > lim.stages:
        raise ProgramError(f"{program.name}: needs {len(program.stages)} stages, the switch has "
                           f"{lim.stages}")
    home: dict[str, int] = {}
    per_stage = []
    for i, stage in enumerate(program.stages):
        if len(stage.actions) > lim.alus_per_stage:
            raise ProgramError(f"{program.name}: stage {i} needs {len(stage.actions)} stateful "
                               f"ALUs, a stage has {lim.alus_per_stage}")
        entries = 0
        for a in stage.actions:
            if a.op not in INTEGER_OPS:
                raise ProgramError(f"{program.name}: stage {i}: '{a.op}' on {a.register} is not "
                                   "an integer register operation (no floating point in a switch)")
            reg = regs.get(a.register)
            if reg is None:
                raise ProgramError(f"{program.name}: stage {i}: unknown register {a.register}")
            if reg.width > lim.register_bits:
                raise ProgramError(f"{program.name}: register {reg.name} is {reg.width} bits "
                                   f"wide, an entry has at most {lim.register_bits}")
            if reg.entries > lim.entries_per_register:
                raise ProgramError(f"{program.name}: register {reg.name} has {reg.entries:,} "
                                   f"entries, an ALU's array has at most "
                                   f"{lim.entries_per_register:,} (slots x 2 for the shadow "
                                   "copies)")
            if home.setdefault(reg.name, i) != i:
                raise ProgramError(f"{program.name}: register {reg.name} is used in stages "
                                   f"{home[reg.name]} and {i}: a register array lives in one "
                                   "stage and is touched once per pass")
            if sum(1 for b in stage.actions if b.register == a.register) > 1:
                raise ProgramError(f"{program.name}: stage {i} touches {reg.name} twice in one "
                                   "pass")
            entries += reg.entries
        per_stage.append((len(stage.actions), entries))
    used = [regs[name] for name in home]
    return Resources(limits=lim, stages=len(program.stages),
                     alus=sum(a for a, _ in per_stage),
                     register_bits=sum(r.width * r.entries for r in used),
                     register_entries=sum(r.entries for r in used), slots=program.slots,
                     values_per_pass=program.values_per_pass, per_stage=per_stage)


def aggregation_program(slots: int = protocol.SWITCH_CELLS,
                        values_per_pass: int = protocol.SWITCH_VALUES_PER_PASS) -> Program:
    """hvd-sparse's in-network aggregation, one pass per ``values_per_pass`` int32 values.

    Every register array is indexed by ``pool index = slot * 2 + (round & 1)``: two entries
    per slot, the round in progress and its shadow (the previous round's result, for
    retransmissions). Per pass:

    * stage 0: the job table (token -> job, its worker ports, slot range, multicast group) and
      the slot's round register (a packet of another round is stale or a retransmission);
    * stage 1: the seen-bitmap of workers (32 bits: hence 32 workers per job), the count of
      workers seen, the running minimum of the announced next positions (look-ahead) and the
      overflow flag (saturating adds set it; the job then falls back);
    * stages 2 ..: the values, two int32 per 64-bit register entry, one entry per ALU;
    * the last stage: the workers that carried a block this round (``holders``), and the
      multicast of a completed round to the job's group; in the egress, the copy to a round's
      only holder (holders, bridged, against the copy's replication id) drops its value headers
      (flag OWN: its sums are its own blocks). The round's opening time (``opened``, written
      by its first DATA) against the packet's ingress timestamp: a duplicate DATA (its worker
      already in the seen-bitmap) into a round open for ``protocol.HELD_AFTER`` seconds leaves
      as a HELD to its sender, the header alone, naming the lowest worker not seen: a ternary
      table on the bitmap, one entry per worker (``...0 1...1``).
    """
    pairs = values_per_pass // 2  # 64-bit entries: two int32 values each
    entries = 2 * slots
    value_regs = tuple(Register(f"values{i}", 64, entries) for i in range(pairs))
    value_stages = tuple(
        Stage(actions=tuple(Action(f"values{i}", "add_saturate", "two int32 sums")
                            for i in range(j, min(j + 4, pairs))))
        for j in range(0, pairs, 4))
    registers = (Register("round", 32, entries),
                 Register("seen", protocol.SWITCH_MAX_WORKERS, entries),  # a bit per worker
                 Register("count", 32, entries), Register("next_min", 32, entries),
                 Register("overflow", 32, entries),
                 Register("holders", protocol.SWITCH_MAX_WORKERS, entries),
                 Register("opened", 32, entries), *value_regs)
    stages = (
        Stage(actions=(Action("round", "cond_write", "open the next round or spot a stale one"),),
              tables=("jobs",)),
        Stage(actions=(Action("seen", "or", "worker bitmap: retransmission or first arrival"),
                       Action("count", "add", "workers of this round"),
                       Action("next_min", "min", "look-ahead: smallest announced next"),
                       Action("overflow", "or", "a saturated sum poisons the round"))),
        *value_stages,
        Stage(actions=(Action("holders", "or", "workers that carried a block: one alone "
                              "gets the header only"),
                       Action("opened", "cond_write", "the round's first DATA: its time; a "
                              "late duplicate: HELD")),
              tables=("multicast", "lowest_unseen")),
    )
    return Program(name="hvd-sparse aggregation", parser=("ethernet", "ipv4", "udp", "hspo"),
                   registers=registers, stages=stages, deparser=("ethernet", "ipv4", "udp", "hspo"),
                   values_per_pass=values_per_pass, slots=slots)
