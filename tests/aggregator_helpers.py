"""Shared by the tests of the aggregator (tests/test_aggregator_*.py), the switch pipeline, the
dissector and the protocol simulation: real aggregator processes (the ``aggs`` fixture: the
binary hvd_sparse.aggregator.binary() names, port 0, --port-file; killed at teardown) and
in-process workers (``make_workers``: hvd_sparse._C.OmniWorker; both fixtures, and
``fuzz_job``, are tests/conftest.py's), data and its float64 numpy
reference, and junk packets built with hvd_sparse.tools.wire (the library's packet builder).

Sums: the aggregator adds in float64 and rounds once to the wire dtype, so float32, float16 and
bfloat16 results must equal the float64 sum rounded once (exactly); float64 results depend on
the arrival order only in the last bits. Every wait has a timeout.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from hvd_sparse import aggregator, blocks, protocol
from hvd_sparse.config import format_address
from hvd_sparse.tools import wire

HOST = "127.0.0.1"
INF = protocol.INF
T = protocol.TYPES
WAIT = 60.0  # generous: the test machine is shared and loaded


# ------------------------------------------------------------------------------------------
# Aggregator processes and workers
# ------------------------------------------------------------------------------------------

class Agg:
    """One aggregator process; its stdout (the stats lines) goes to a file. ``host``: the
    address it binds, an IPv6 one bare ("::1"; "::": both families, reached at ::1)."""

    def __init__(self, directory: Path, workers: int, flags: tuple[str, ...],
                 host: str = HOST) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "stdout.log"
        port_file = directory / "port"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [str(aggregator.binary()), "--bind", format_address(host, 0), "--port-file",
                 str(port_file), "--workers", str(workers), *flags],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"aggregator did not start: {self.log.read_text()}")
            time.sleep(0.005)
        self.port = int(port_file.read_text())
        self.addr = ({"::": "::1", "0.0.0.0": HOST}.get(host, host), self.port)

    def stat_lines(self) -> list[dict]:
        prefix = "hvd-sparse aggregator stats "
        text = self.log.read_text()
        lines = text.split("\n")[:-1]  # complete lines only: the last may be half written
        return [json.loads(line[len(prefix):]) for line in lines if line.startswith(prefix)]

    def stats(self, timeout: float = 15) -> dict:
        """Counters now: SIGUSR1, then the new stats line."""
        n = len(self.stat_lines())
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.stat_lines()
            if len(lines) > n:
                return lines[-1]
            time.sleep(0.01)
        raise AssertionError(f"no stats line after SIGUSR1 within {timeout}s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15) -> dict:
        """SIGTERM; returns the stats line printed at exit."""
        self.proc.terminate()
        assert self.proc.wait(timeout=timeout) == 0
        return self.stat_lines()[-1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=15)


# ------------------------------------------------------------------------------------------
# Data and reference
# ------------------------------------------------------------------------------------------

def block_sparse(rng: np.random.Generator, numel: int, bs: int, density: float,
                 dtype: torch.dtype, force: tuple[int, ...] = ()) -> torch.Tensor:
    """Whole blocks non-zero at random (``force``: blocks that are non-zero regardless)."""
    nb = -(-numel // bs)
    mask = rng.random(nb) < density
    mask[list(force)] = True
    x = np.zeros((nb, bs))
    x[mask] = rng.standard_normal((int(mask.sum()), bs)) * rng.choice([1e-3, 1.0, 30.0])
    return torch.from_numpy(x.reshape(-1)[:numel].copy()).to(dtype)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float64 -> nearest bfloat16 (ties to even), rounded once (normal range)."""
    m, e = np.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1: bfloat16 keeps 8 significant bits
    return np.ldexp(np.rint(np.ldexp(m, 8)), e - 8)


def round_once(s: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The float64 sum rounded once to ``dtype``."""
    if dtype == torch.float64:
        return torch.from_numpy(s.copy())
    if dtype == torch.float32:
        return torch.from_numpy(s.astype(np.float32))
    if dtype == torch.float16:
        return torch.from_numpy(s.astype(np.float16))  # numpy rounds float64 -> half directly
    return torch.from_numpy(round_bf16(s)).to(torch.bfloat16)  # exact: already bf16 values


def f64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


def reference(inputs: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    dtype = inputs[0].dtype
    s = np.sum([f64(x) for x in inputs], axis=0)
    ref = round_once(s, dtype)
    if scale != 1.0:  # the worker scales the rounded sum as torch does: x.mul_(scale)
        ref = ref * scale
    return ref


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_result(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    if ref.dtype == torch.float64:
        np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12,
                                   err_msg=what)
    else:
        if bits(out) != bits(ref):
            bad = (f64(out) != f64(ref)).nonzero()[0]
            raise AssertionError(f"{what}: {len(bad)} elements differ from the float64 sum "
                                 f"rounded once, first at {bad[:5]}: got {f64(out)[bad[:5]]}, "
                                 f"want {f64(ref)[bad[:5]]}")


def geometry(numel: int, bs: int, dtype: torch.dtype, k: int, payload: int = 16384,
             slots: int = 64) -> tuple[int, int, int]:
    """(nblocks, lanes, nslots) as docs/PROTOCOL.md defines them."""
    nb = -(-numel // bs)
    esize = protocol.ELEM_SIZE[blocks.DTYPE_CODES[dtype]]
    return nb, *protocol.layout(nb, bs, esize, payload, k * slots)


def run(workers, inputs: list[torch.Tensor], tensor_id: int, bs: int, *, inplace: bool,
        scale: float = 1.0, meta: int = 7, order=None):
    """Every worker reduces its input; returns (outputs, finish() stats)."""
    ins = [x.clone() for x in inputs]
    outs = ins if inplace else [torch.zeros_like(x) for x in ins]
    ranks = order or range(len(workers))
    tickets = {r: workers[r].submit(tensor_id, ins[r], outs[r], bs, meta, None, f"t{tensor_id}",
                                    scale) for r in ranks}
    for r, w in enumerate(workers):
        assert w.wait(tickets[r], WAIT), f"worker {r} did not finish tensor {tensor_id}"
    return outs, [w.finish(tickets[r]) for r, w in enumerate(workers)]


# ------------------------------------------------------------------------------------------
# Malformed and foreign packets while a job runs
# ------------------------------------------------------------------------------------------

def patch(raw: bytes, **fields: int) -> bytes:
    """``raw`` with some header fields changed (a packet no consistent builder would make)."""
    h = wire.parse(raw)
    values = {name: h[name] for name, _, _ in protocol.FIELDS}
    return wire.header(**{**values, **fields}) + raw[protocol.HEADER_BYTES:]


def round0(slot: int, nblocks: int, nslots: int, lanes: int, rng) -> list[tuple[int, int]]:
    """A valid round-0 lane table of a slot (offset 0 or INF, next beyond it or INF)."""
    table = []
    for lane in range(lanes):
        length = protocol.stream_length(slot, lane, nblocks, nslots, lanes)
        if length == 0:
            table.append((INF, INF))
        else:
            table.append((0, INF if length == 1 or rng.random() < 0.5
                          else int(rng.integers(1, length))))
    return table


class Job:
    """The legitimate job of the fuzz test: 3 in-process workers on one aggregator."""
    n, bs, numel, token, dtype = 3, 32, 32 * 400 + 9, 0xABCDEF, torch.float32
    payload, slots = 512, 8
    nblocks, lanes, nslots = geometry(numel, bs, dtype, 1, payload, slots)


def junk_packets(kind: str, seed: int, tensor: int, raw: bytes) -> tuple[str, bytes]:
    """(expected outcome, packet): 'malformed' and 'unknown' are counted exactly; 'fuzzy'
    packets go to the running tensor and end as malformed, stale or duplicate."""
    rng = np.random.default_rng(seed)
    fresh = 0xF000_0000 + seed  # a tensor id the job never uses
    nb, lanes, ns, bs = Job.nblocks, Job.lanes, Job.nslots, Job.bs
    slot = int(rng.integers(0, ns))
    table = round0(slot, nb, ns, lanes, rng)
    live = [lane for lane in range(lanes) if table[lane][0] != INF]
    blk = rng.standard_normal(bs).astype(np.float32).tobytes()
    base = {"token": Job.token, "worker": int(rng.integers(0, Job.n)), "nworkers": Job.n,
            "tensor": fresh, "slot": slot, "round": 0, "block_size": bs, "nblocks": nb,
            "nslots": ns, "meta": 7, "dtype": 0}
    carried = dict.fromkeys(live, blk)  # lane -> block: every live lane carries one
    valid = wire.data(table, carried, **base)
    if kind == "random":
        return "malformed", raw
    if kind == "truncated":
        return "malformed", valid[:int(rng.integers(0, len(valid)))]
    if kind == "extended":
        return "malformed", valid + raw[:15] + b"\0"
    if kind == "magic":
        return "malformed", wire.data(table, carried, **{
            **base, "magic": int(rng.integers(0, 2 ** 32)) ^ protocol.MAGIC or 1})
    if kind == "version":
        return "malformed", wire.data(table, carried, **{**base, "version": int(  # 1: older
            rng.choice([0, protocol.VERSION - 1, protocol.VERSION + 1, 255]))})
    if kind == "type":
        return "malformed", wire.data(table, carried, **{**base, "type": int(
            rng.choice([0, 8, 9, 200, 255]))})
    if kind == "dtype":  # no wire dtype (fixed32, the last, is one)
        return "malformed", wire.data(table, carried, **{**base, "dtype": int(
            rng.integers(len(protocol.WIRE_DTYPES), 256))})
    if kind == "agg-bound type":  # RESULT/REGACK/ERROR sent to an aggregator, real token
        t = int(rng.choice([T["RESULT"], T["REGACK"], T["ERROR"]]))
        if t == T["RESULT"]:
            return "malformed", wire.data(table, carried, **{**base, "type": t,
                                                             "tensor": tensor})
        return "malformed", wire.header(**{**base, "type": t})
    if kind == "worker":
        return "malformed", wire.data(table, carried, **{
            **base, "worker": int(rng.integers(Job.n, 2 ** 16))})
    if kind == "nworkers":  # a valid worker of a job of another size
        return "malformed", wire.data(table, carried, **{
            **base, "nworkers": Job.n + 1 + int(rng.integers(0, 100)), "worker": 0})
    if kind == "slot":
        return "malformed", wire.data(table, carried, **{
            **base, "tensor": tensor, "slot": ns + int(rng.integers(0, 1000))})
    if kind == "present>lanes":
        return "malformed", patch(valid, present=lanes + 1)
    if kind == "length":
        return "malformed", patch(valid, present=len(live) + 1)[:-1]
    # lane-table and bitmap errors on a fresh tensor (round 0): exact, and no state created
    mutated = list(table)
    lane = int(rng.choice(live))
    if kind == "bitmap beyond lanes":  # a block on lane `lanes`, one past the table
        return "malformed", wire.data(table, {**carried, lanes: blk}, **base)
    one_short = patch(valid, present=len(live) - 1)[:-len(blk)]  # the bitmap says one more
    if kind == "bitmap != present":
        return "malformed", one_short
    if kind == "bit on empty lane":
        dead = [x for x in range(lanes) if x not in live]
        if not dead:
            return "malformed", one_short
        return "malformed", wire.data(table, {**carried, dead[0]: blk}, **base)
    if kind == "offset not current":
        mutated[lane] = (int(rng.integers(1, 2 ** 31)), INF)
    elif kind == "next <= offset":
        mutated[lane] = (0, 0)
    elif kind == "next beyond stream":
        length = protocol.stream_length(slot, lane, nb, ns, lanes)
        mutated[lane] = (0, length + int(rng.integers(0, 5)))
    elif kind == "offset on empty lane":
        dead = [x for x in range(lanes) if x not in live] or [lane]
        mutated[dead[0]] = (0, INF) if dead[0] != lane else (INF, 1)
    elif kind == "other tensor params, bad lanes":  # the running tensor, other nblocks/meta
        mutated[lane] = (0, 0)
        other = {**base, "tensor": tensor,
                 **(({"nblocks": nb + 1 + int(rng.integers(0, 50))}, {"meta": 8},
                     {"dtype": 1, "block_size": bs // 2})[int(rng.integers(0, 3))])}
        return "malformed", wire.data(mutated, carried, **other)
    elif kind == "running tensor, bad lanes":
        mutated[lane] = (5, 3)  # invalid in every round
        return "fuzzy", wire.data(mutated, carried, **{
            **base, "tensor": tensor, "round": int(rng.integers(0, 6)),
            "flags": int(rng.integers(0, 4))})
    elif kind == "foreign token":
        return "unknown", wire.data(table, carried, **{
            **base, "tensor": tensor, "token": Job.token ^ int(rng.integers(1, 2 ** 63))})
    elif kind == "foreign release/bye":
        return "unknown", wire.header(**{
            **base, "tensor": tensor, "type": int(rng.choice([T["RELEASE"], T["BYE"]])),
            "token": Job.token ^ int(rng.integers(1, 2 ** 63))})
    else:
        raise AssertionError(kind)
    return "malformed", wire.data(mutated, carried, **base)


KINDS = ["random", "truncated", "extended", "magic", "version", "type", "dtype",
         "agg-bound type", "worker", "nworkers", "slot", "present>lanes", "length",
         "bitmap beyond lanes", "bitmap != present", "bit on empty lane", "offset not current",
         "next <= offset", "next beyond stream", "offset on empty lane",
         "other tensor params, bad lanes", "running tensor, bad lanes", "foreign token",
         "foreign release/bye"]


def sync(sock: socket.socket, agg: Agg) -> None:
    """Every datagram this socket sent before has been handled: a REGISTER of the wrong size
    is answered (ERROR) in order, creating nothing."""
    sock.sendto(wire.header(type=T["REGISTER"], token=0x5111C, worker=0, nworkers=1000),
                agg.addr)
    sock.settimeout(10)
    while True:
        p = wire.parse(sock.recv(70000))
        if p["token"] == 0x5111C:
            assert p["type"] == T["ERROR"]
            return


def reduce_under_junk(fuzz_job, tensor: int, seed: int, packets: list[bytes],
                      what: str) -> dict:
    """Reduces one tensor of the fuzz job while ``packets`` reach its aggregator: half while
    the tensor waits for rank 2, half during it. Every rank's result must be exact; returns
    how the aggregator's counters moved."""
    agg, ws, sock, _ = fuzz_job
    rng = np.random.default_rng(seed)
    ins = [block_sparse(rng, Job.numel, Job.bs, 0.2, Job.dtype, force=(0,) if r == 1 else ())
           for r in range(Job.n)]
    ref = reference(ins)
    sync(sock, agg)
    before = agg.stats()
    outs = [torch.zeros_like(x) for x in ins]
    tickets = [ws[r].submit(tensor, ins[r], outs[r], Job.bs, 7, None, what, 1.0)
               for r in range(2)]
    half = len(packets) // 2
    for p in packets[:half]:
        sock.sendto(p, agg.addr)
    tickets.append(ws[2].submit(tensor, ins[2], outs[2], Job.bs, 7, None, what, 1.0))
    for p in packets[half:]:
        sock.sendto(p, agg.addr)
    for r, w in enumerate(ws):
        assert w.wait(tickets[r], WAIT), f"rank {r} did not finish under {what}"
    for r, w in enumerate(ws):
        w.finish(tickets[r])
        assert_result(outs[r], ref, f"rank {r} under {what}")
    sync(sock, agg)
    after = agg.stats()
    assert agg.alive()
    return {k: after[k] - before[k] for k in after}
