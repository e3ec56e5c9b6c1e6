"""The OmniReduce-style aggregator (csrc/omni/aggregator/) and worker engine
(hvd_sparse._C.OmniWorker) without Horovod, against a float64 numpy reference.

Every aggregator is a real process started by the ``aggs`` fixture (port 0, --port-file) and
killed at teardown; every wait has a timeout. Sums: the aggregator adds in float64 and rounds
once to the wire dtype, so float32, float16 and bfloat16 results must equal the float64 sum
rounded once (exactly); float64 results depend on the arrival order only in the last bits.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_sparse import _C, blocks, fixedpoint, protocol
from hvd_sparse.tools import wire

ROOT = Path(__file__).resolve().parents[1]
BINARY = ROOT / "hvd_sparse" / "bin" / "hvd-sparse-aggregator"
HOST = "127.0.0.1"
INF = protocol.INF
T = protocol.TYPES
WAIT = 60.0  # generous: the test machine is shared and loaded


# ------------------------------------------------------------------------------------------
# Aggregator processes
# ------------------------------------------------------------------------------------------

class Agg:
    """One aggregator process; its stdout (the stats lines) goes to a file."""

    def __init__(self, directory: Path, workers: int, flags: tuple[str, ...]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "stdout.log"
        port_file = directory / "port"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [str(BINARY), "--bind", f"{HOST}:0", "--port-file", str(port_file),
                 "--workers", str(workers), *flags],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"aggregator did not start: {self.log.read_text()}")
            time.sleep(0.005)
        self.port = int(port_file.read_text())
        self.addr = (HOST, self.port)

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


@pytest.fixture
def aggs(tmp_path):
    started: list[Agg] = []

    def start(workers: int, *flags: str) -> Agg:
        a = Agg(tmp_path / f"agg{len(started)}", workers, flags)
        started.append(a)
        return a

    yield start
    for a in started:
        a.kill()


@pytest.fixture
def make_workers():
    made: list = []

    def make(agg_list: list[Agg], n: int, token: int = 0x5EED, register: bool = True, **kw):
        ws = [_C.OmniWorker([a.addr for a in agg_list], token, r, n, **kw) for r in range(n)]
        made.extend(ws)
        if register:
            for w in ws:
                w.register(15.0)
        return ws

    yield make
    for w in made:
        w.close()


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
# 1. Correctness: workers x aggregators x dtypes x in/out of place
# ------------------------------------------------------------------------------------------

def cases(rng: np.random.Generator, n: int):
    """(name, inputs, block_size, inplace, scale) covering the matrix of the brief."""
    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for inplace in (False, True):
            bs = int(rng.choice([64, 100, 256]))
            numel = bs * int(rng.integers(150, 400)) + int(rng.integers(1, bs))  # partial tail
            nb = -(-numel // bs)
            ins = [block_sparse(rng, numel, bs, float(rng.uniform(0.02, 0.3)), dtype,
                                force=((0,) if r == n - 1 else ()) + ((nb - 1,) if r == 0 else ()))
                   for r in range(n)]
            out.append((f"{dtype} inplace={inplace} bs={bs}", ins, bs, inplace, 1.0))
    numel = 64 * 200 + 33
    zeros = [torch.zeros(numel) for _ in range(n)]
    out.append(("all zero, out of place", zeros, 64, False, 1.0))
    out.append(("all zero, in place", zeros, 64, True, 1.0))
    dense = [block_sparse(rng, numel, 64, 1.0, torch.float32) for _ in range(n)]
    out.append(("density 1.0", dense, 64, False, 1.0))
    out.append(("density 1.0 in place", dense, 64, True, 1.0))
    # one worker holds nothing; the others hold disjoint halves
    mixed = [torch.zeros(numel) for _ in range(n)]
    for r in range(1, n):
        mixed[r] = block_sparse(rng, numel, 64, 0.2, torch.float32)
    out.append(("one empty worker", mixed, 64, False, 1.0))
    for dtype, scale in ((torch.float32, 0.125), (torch.float32, 1 / 3), (torch.float64, 1 / 3),
                         (torch.float16, 1 / 3), (torch.bfloat16, 0.1)):
        ins = [block_sparse(rng, numel, 64, 0.2, dtype) for _ in range(n)]
        out.append((f"scale {scale} {dtype}", ins, 64, False, scale))
        out.append((f"scale {scale} {dtype} in place", ins, 64, True, scale))
    return out


@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (3, 1), (8, 1), (1, 2), (2, 2), (3, 2), (8, 2)])
def test_sum_matches_float64_reference(aggs, make_workers, n, k):
    agg_list = [aggs(n) for _ in range(k)]
    # small packets and few slots: many slots over both aggregators, several rounds per slot
    ws = make_workers(agg_list, n, payload_bytes=2048, slots_per_aggregator=8)
    rng = np.random.default_rng(1000 * n + k)
    todo = cases(rng, n)
    # all tensors in flight at once, submitted in a different order by every rank
    tickets = {}
    for r, w in enumerate(ws):
        order = list(range(len(todo)))
        np.random.default_rng(r).shuffle(order)
        for i in order:
            name, ins, bs, inplace, scale = todo[i]
            x = ins[r].clone()
            o = x if inplace else torch.zeros_like(x)
            tickets[r, i] = (w.submit(100 + i, x, o, bs, 7, None, name, scale), o)
    for (r, i), (t, _) in tickets.items():
        assert ws[r].wait(t, WAIT), f"rank {r} case {todo[i][0]} did not finish"
    for i, (name, ins, bs, _, scale) in enumerate(todo):
        ref = reference(ins, scale)
        outs = []
        for r in range(n):
            st_ = ws[r].finish(tickets[r, i][0])
            nb, lanes, nslots = geometry(ins[0].numel(), bs, ins[0].dtype, k, 2048, 8)
            assert (st_["lanes"], st_["nslots"]) == (lanes, nslots), name
            outs.append(tickets[r, i][1])
        assert_result(outs[0], ref, f"n={n} k={k} {name}")
        for r in range(1, n):
            assert bits(outs[r]) == bits(outs[0]), f"{name}: rank {r} differs from rank 0"
    assert all(a.alive() for a in agg_list)
    for a in agg_list:
        s = a.stats()
        assert s["malformed"] == 0 and s["unknown_job"] == 0 and s["mismatch"] == 0, s
        assert s["tensors"] == len(todo) if k == 1 else s["tensors"] > 0, s


def test_edge_sizes_and_masks(aggs, make_workers):
    """Tensors smaller than a block, one element past a block, blocks as large as a datagram
    allows; a mask that marks more blocks than are non-zero (they travel as zeros)."""
    n = 3
    ws = make_workers([aggs(n), aggs(n)], n)
    rng = np.random.default_rng(3)
    todo = [(1, 64), (63, 64), (65, 64), (16000 * 3 + 1, 16000), (8191 * 5 + 2, 8191)]
    for i, (numel, bs) in enumerate(todo):
        ins = [block_sparse(rng, numel, bs, 0.6, torch.float32, force=(0,) if r == 1 else ())
               for r in range(n)]
        outs, _ = run(ws, ins, 10 + i, bs, inplace=i % 2 == 1)
        for o in outs:
            assert_result(o, reference(ins), f"numel={numel} bs={bs}")
    numel, bs = 64 * 90 + 1, 64
    ins = [block_sparse(rng, numel, bs, 0.1, torch.float32) for _ in range(n)]
    outs, tickets = [torch.zeros_like(x) for x in ins], []
    for r, w in enumerate(ws):
        mask = (ins[r].new_zeros(91 * 64).index_copy_(0, torch.arange(numel), ins[r])
                .view(91, 64) != 0).any(1).to(torch.uint8)
        if r == 0:
            mask[::3] = 1  # a superset: zero blocks sent as zeros
        tickets.append(w.submit(30, ins[r], outs[r], bs, 7, mask, "masked", 1.0))
    for r, w in enumerate(ws):
        assert w.wait(tickets[r], WAIT)
        w.finish(tickets[r])
        assert_result(outs[r], reference(ins), f"mask rank {r}")


def test_only_blocks_some_worker_sends_are_written(aggs, make_workers):
    """Out of place the output is not zeroed by the worker: the caller passes zeros (fresh pages
    that stay unmapped where nothing lands). Prefilled with NaN, it must keep NaN exactly in
    the blocks zero on every worker and hold the sum elsewhere."""
    n, bs = 3, 64
    ws = make_workers([aggs(n)], n, payload_bytes=2048, slots_per_aggregator=8)
    rng = np.random.default_rng(9)
    numel = bs * 333 + 5
    ins = [block_sparse(rng, numel, bs, 0.05, torch.float32) for _ in range(n)]
    outs = [torch.full_like(x, float("nan")) for x in ins]
    tickets = [w.submit(5, ins[r], outs[r], bs, 7, None, "nan", 1.0) for r, w in enumerate(ws)]
    for r, w in enumerate(ws):
        assert w.wait(tickets[r], WAIT)
        w.finish(tickets[r])
    nonzero = torch.zeros(-(-numel // bs) * bs, dtype=torch.bool)
    nonzero[:numel] = (torch.stack(ins) != 0).any(0)
    sent = nonzero.view(-1, bs).any(1).repeat_interleave(bs)[:numel]
    ref = reference(ins)
    for o in outs:
        assert bool(o[~sent].isnan().all()), "a block no worker sent was written"
        assert_result(o[sent], ref[sent], "blocks some worker sent")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_large_output_in_fresh_zeros(aggs, make_workers, dtype):
    """What the omnireduce scheme does out of place: a fresh-zeros output (a new mapping above
    4 MiB), 1% of the blocks non-zero per worker, scaled."""
    n, bs = 2, 256
    ws = make_workers([aggs(n)], n)
    rng = np.random.default_rng(blocks.DTYPE_CODES[dtype])
    numel = 2**21 + 77
    ins = [block_sparse(rng, numel, bs, 0.01, dtype, force=(0,) if r else ()) for r in range(n)]
    outs = [blocks.zeros(numel, dtype) for _ in range(n)]
    tickets = [w.submit(6, ins[r], outs[r], bs, 7, None, "fresh", 0.5) for r, w in enumerate(ws)]
    for r, w in enumerate(ws):
        assert w.wait(tickets[r], WAIT)
        w.finish(tickets[r])
    for o in outs:
        assert_result(o, reference(ins, 0.5), f"fresh zeros {dtype}")


def test_half_precision_sums_are_rounded_once(aggs, make_workers):
    """1 + 2^-11 + 2^-24 lies just above a float16 tie; float32 has no room for the 2^-24, so
    rounding float64 -> float32 -> float16 gives 1.0 where rounding once gives 1 + 2^-10.
    Likewise for bfloat16 with 1 + 2^-8 + 2^-30."""
    ws = make_workers([aggs(3)], 3)
    for dtype, parts in ((torch.float16, (1.0, 2.0 ** -11, 2.0 ** -24)),
                         (torch.bfloat16, (1.0, 2.0 ** -8, 2.0 ** -30))):
        ins = [torch.full((8,), p, dtype=dtype) for p in parts]
        assert all(float(x[0]) == p for x, p in zip(ins, parts, strict=True))  # exact inputs
        outs, _ = run(ws, ins, 1 + blocks.DTYPE_CODES[dtype], 8, inplace=False)
        ref = reference(ins)
        assert float(ref[0]) == 1 + (2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7)
        for o in outs:
            assert_result(o, ref, f"{dtype}")


def fixed_reference(inputs: list[torch.Tensor], e: int, scale: float) -> torch.Tensor:
    """docs/PROTOCOL.md "Fixed point" in numpy: q = rint(x 2^e) (ties to even) per rank, the
    exact integer sum, times 2^-e and the scale in float64, rounded once to the dtype."""
    q = [np.rint(np.ldexp(f64(x), e)).astype(np.int64) for x in inputs]
    return round_once(np.ldexp(np.sum(q, axis=0).astype(np.float64), -e) * scale,
                      inputs[0].dtype)


def test_fixed_point_matches_the_integer_model(aggs, make_workers):
    """Workers submitted with an exponent send fixed32 (4-byte geometry whatever the dtype) and
    every rank gets the bytes of the integer model above, for every dtype, in and out of place,
    scaled or not, including ties (2.5 and 3.5 steps round to 2 and 4) and huge exponents."""
    n, k, payload, slots = 3, 2, 2048, 8
    ws = make_workers([aggs(n) for _ in range(k)], n, payload_bytes=payload,
                      slots_per_aggregator=slots)
    rng = np.random.default_rng(8)
    todo = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for inplace, scale in ((False, 1.0), (True, 1 / 3)):
            bs, numel = 64, 64 * 150 + 17
            ins = [block_sparse(rng, numel, bs, 0.2, dtype, force=(0,)) for _ in range(n)]
            m = max(float(x.abs().max()) for x in ins)
            e = fixedpoint.exponent(m, n)
            ins[0][:2] = torch.tensor([2.5, 3.5], dtype=torch.float64).mul(2.0 ** -e).to(dtype)
            assert torch.equal(ins[0][:2].double(), torch.tensor([2.5, 3.5]) * 2.0 ** -e)
            todo.append((f"{dtype} inplace={inplace} scale={scale:g}", ins, e, inplace, scale))
    # Tiny float64 values: an exponent beyond float64's normal powers of two (2^1026).
    ins = [block_sparse(rng, 64 * 40, 64, 0.5, torch.float64, force=(0,)) * 1e-300
           for _ in range(n)]
    e = fixedpoint.exponent(max(float(x.abs().max()) for x in ins), n)
    assert e > 1022
    todo.append(("float64 tiny", ins, e, False, 1.0))
    tickets = {}
    for r, w in enumerate(ws):
        for i, (name, ins, e, inplace, scale) in enumerate(todo):
            x = ins[r].clone()
            o = x if inplace else torch.zeros_like(x)
            tickets[r, i] = w.submit(300 + i, x, o, 64, 7, None, name, scale, exponent=e), o
    for (r, i), (t, _) in tickets.items():
        assert ws[r].wait(t, WAIT), f"rank {r} case {todo[i][0]} did not finish"
    for i, (name, ins, e, _, scale) in enumerate(todo):
        ref = fixed_reference(ins, e, scale)
        nb = -(-ins[0].numel() // 64)
        for r in range(n):
            st_ = ws[r].finish(tickets[r, i][0])
            assert (st_["lanes"], st_["nslots"]) == protocol.layout(nb, 64, 4, payload, k * slots)
            out = tickets[r, i][1]
            assert bits(out) == bits(ref), f"{name}: rank {r} differs from the integer model"


def test_fixed_point_overflow_fails_the_tensor_by_name(aggs, make_workers):
    """A rank that uses a larger exponent than agreed makes a sum leave the int32 range: the
    aggregator answers ERROR OVERFLOW and every rank raises naming the tensor, at once."""
    agg = aggs(2)
    ws = make_workers([agg], 2)
    x = torch.full((256,), 3.0)
    e = fixedpoint.exponent(3.0, 2)
    t0 = time.monotonic()
    tickets = [w.submit(9, x.clone(), torch.zeros(256), 64, 7, None, "grad.w", 1.0,
                        exponent=e + 4 * (r == 0)) for r, w in enumerate(ws)]
    for w, t in zip(ws, tickets, strict=True):
        assert w.wait(t, WAIT)
        with pytest.raises(RuntimeError, match=r"tensor 'grad.w': fixed-point overflow"):
            w.finish(t)
    assert time.monotonic() - t0 < 10, "an overflow is reported, not timed out"
    assert agg.stats()["overflow"] == 1


def test_worker_processes(aggs, tmp_path):
    """8 workers in 3 separate processes (3, 3 and 2 OmniWorkers), K = 2 aggregators."""
    n, k = 8, 2
    groups = [[0, 3, 6], [1, 4, 7], [2, 5]]
    agg_list = [aggs(n) for _ in range(k)]
    rng = np.random.default_rng(8)
    specs = []
    for j, (dtype, inplace) in enumerate([(torch.float32, False), (torch.float32, True),
                                           (torch.bfloat16, False), (torch.float64, True)]):
        bs = 128
        numel = bs * 300 + 77
        ins = [block_sparse(rng, numel, bs, 0.1, dtype, force=(0,) if r == 3 else ())
               for r in range(n)]
        for r, x in enumerate(ins):
            np.save(tmp_path / f"in{j}_{r}.npy", f64(x))
        specs.append((str(dtype).split(".")[1], inplace, bs, ins))
    child = r"""
import json, sys, numpy as np, torch
from hvd_sparse import _C
d, ports, n, ranks, specs = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), \
    json.loads(sys.argv[4]), json.loads(sys.argv[5])
ws = {r: _C.OmniWorker([("127.0.0.1", p) for p in ports], 77, r, n, payload_bytes=4096,
                       slots_per_aggregator=4) for r in ranks}
for w in ws.values():
    w.register(30.0)
tickets = {}
for j, (dtype, inplace, bs) in enumerate(specs):
    for r, w in ws.items():
        x = torch.from_numpy(np.load(f"{d}/in{j}_{r}.npy")).to(getattr(torch, dtype))
        o = x if inplace else torch.zeros_like(x)
        tickets[j, r] = (w.submit(j, x, o, bs, 3, None, f"x{j}", 1.0), o)
for (j, r), (t, o) in tickets.items():
    assert ws[r].wait(t, 60.0), (j, r)
    ws[r].finish(t)
    np.save(f"{d}/out{j}_{r}.npy", o.to(torch.float64).numpy())
for w in ws.values():
    w.close()
"""
    ports = json.dumps([a.port for a in agg_list])
    spec_arg = json.dumps([[s[0], s[1], s[2]] for s in specs])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", child, str(tmp_path), ports, str(n),
                               json.dumps(g), spec_arg], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for g in groups]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    for j, (dtype, _, _, ins) in enumerate(specs):
        ref = reference(ins)
        outs = [torch.from_numpy(np.load(tmp_path / f"out{j}_{r}.npy")).to(ins[0].dtype)
                for r in range(n)]
        assert_result(outs[0], ref, f"processes: {dtype}")
        for r in range(1, n):
            assert bits(outs[r]) == bits(outs[0]), f"{dtype}: rank {r} differs from rank 0"


# ------------------------------------------------------------------------------------------
# 2. Loss, duplication, reordering
# ------------------------------------------------------------------------------------------

LOSS = [  # (id, aggregator flags, worker kwargs, counters that must have moved)
    ("agg-drop-in-1%", ("--drop-rate", "0.01"), {}, ("injected_drops", "w:retransmits")),
    ("agg-drop-in-10%", ("--drop-rate", "0.1"), {}, ("injected_drops", "w:retransmits")),
    ("agg-drop-out-1%", ("--drop-rate-out", "0.01"), {}, ("injected_drops", "retransmits")),
    ("agg-drop-out-10%", ("--drop-rate-out", "0.1"), {}, ("injected_drops", "retransmits")),
    ("worker-drop-10%", (), {"drop_rate": 0.1}, ("w:injected_drops", "retransmits")),
    ("agg-dup", ("--dup-rate", "0.2"), {}, ("injected_dups", "duplicates+retransmits")),
    ("worker-dup", (), {"dup_rate": 0.2}, ("duplicates+retransmits",)),
    ("agg-reorder", ("--reorder-rate", "0.5"), {}, ("rounds",)),
    ("everything", ("--drop-rate", "0.1", "--drop-rate-out", "0.1", "--dup-rate", "0.1",
                    "--reorder-rate", "0.3"), {"drop_rate": 0.05, "dup_rate": 0.05},
     ("injected_drops", "injected_dups", "retransmits", "w:retransmits")),
]


@pytest.mark.parametrize("flags,kw,moved", [c[1:] for c in LOSS], ids=[c[0] for c in LOSS])
def test_loss_duplication_reordering_give_identical_results(aggs, make_workers, flags, kw,
                                                            moved):
    n, bs = 4, 64
    rng = np.random.default_rng(4)
    numel = bs * 500 + 5
    ins = [block_sparse(rng, numel, bs, 0.15, torch.float32, force=(0,) if r == 2 else ())
           for r in range(n)]
    ref = reference(ins)
    clean = make_workers([aggs(n)], n, token=1, payload_bytes=1024, slots_per_aggregator=16)
    lossless, _ = run(clean, ins, 5, bs, inplace=False)
    assert_result(lossless[0], ref, "lossless")

    agg = aggs(n, *flags, "--seed", "3")
    ws = make_workers([agg], n, token=2, payload_bytes=1024, slots_per_aggregator=16,
                      seed=11, **kw)
    for tid, inplace in ((5, False), (6, True)):
        outs, _ = run(ws, ins, tid, bs, inplace=inplace)
        for r, o in enumerate(outs):
            assert bits(o) == bits(lossless[0]), f"rank {r} inplace={inplace}"
    s = agg.stats()
    wstats = [w.stats() for w in ws]
    for counter in moved:
        if counter.startswith("w:"):
            value = sum(x[counter[2:]] for x in wstats)
        else:
            value = sum(s[c] for c in counter.split("+"))
        assert value > 0, f"{counter} did not move: {s} {wstats}"
    assert s["malformed"] == 0 and s["mismatch"] == 0, s
    assert agg.alive()


# ------------------------------------------------------------------------------------------
# 3. Malformed and foreign packets while a job runs
# ------------------------------------------------------------------------------------------

def packet(lane_table, blocks: list[bytes], bitmap: int | None = None, **fields) -> bytes:
    """A DATA packet with every field given explicitly (no consistency enforced)."""
    if bitmap is None:
        bitmap = (1 << len(blocks)) - 1
    body = struct.pack(">Q", bitmap) + b"".join(struct.pack(">II", o, x) for o, x in lane_table)
    fields = {"type": T["DATA"], "lanes": len(lane_table), "present": len(blocks), **fields}
    return wire.header(**fields) + body + b"".join(blocks)


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
    blocks = [blk] * len(live)
    bitmap = sum(1 << lane for lane in live)
    valid = packet(table, blocks, bitmap, **base)
    if kind == "random":
        return "malformed", raw
    if kind == "truncated":
        return "malformed", valid[:int(rng.integers(0, len(valid)))]
    if kind == "extended":
        return "malformed", valid + raw[:15] + b"\0"
    if kind == "magic":
        return "malformed", packet(table, blocks, bitmap, **{
            **base, "magic": int(rng.integers(0, 2 ** 32)) ^ protocol.MAGIC or 1})
    if kind == "version":
        return "malformed", packet(table, blocks, bitmap, **{**base, "version": int(
            rng.choice([0, 2, 255]))})
    if kind == "type":
        return "malformed", packet(table, blocks, bitmap, **{**base, "type": int(
            rng.choice([0, 8, 9, 200, 255]))})
    if kind == "dtype":
        return "malformed", packet(table, blocks, bitmap, **{**base, "dtype": int(
            rng.integers(4, 256))})
    if kind == "agg-bound type":  # RESULT/REGACK/ERROR sent to an aggregator, real token
        t = int(rng.choice([T["RESULT"], T["REGACK"], T["ERROR"]]))
        if t == T["RESULT"]:
            return "malformed", packet(table, blocks, bitmap, **{**base, "type": t,
                                                                 "tensor": tensor})
        return "malformed", wire.header(**{**base, "type": t})
    if kind == "worker":
        return "malformed", packet(table, blocks, bitmap, **{
            **base, "worker": int(rng.integers(Job.n, 2 ** 16))})
    if kind == "nworkers":  # a valid worker of a job of another size
        return "malformed", packet(table, blocks, bitmap, **{
            **base, "nworkers": Job.n + 1 + int(rng.integers(0, 100)), "worker": 0})
    if kind == "slot":
        return "malformed", packet(table, blocks, bitmap, **{
            **base, "tensor": tensor, "slot": ns + int(rng.integers(0, 1000))})
    if kind == "present>lanes":
        return "malformed", packet(table, blocks, bitmap, **{**base, "present": lanes + 1})
    if kind == "length":
        return "malformed", packet(table, blocks, bitmap, **{
            **base, "present": len(blocks) + 1})[:-1]
    # lane-table and bitmap errors on a fresh tensor (round 0): exact, and no state created
    mutated = list(table)
    lane = int(rng.choice(live))
    if kind == "bitmap beyond lanes":
        return "malformed", packet(table, blocks, bitmap | (1 << lanes), **{
            **base, "present": len(blocks) + 1}) + blk
    if kind == "bitmap != present":
        return "malformed", packet(table, blocks[1:], bitmap, **base)
    if kind == "bit on empty lane":
        dead = [x for x in range(lanes) if x not in live]
        if not dead:
            return "malformed", packet(table, blocks[1:], bitmap, **base)
        return "malformed", packet(table, blocks + [blk], bitmap | (1 << dead[0]), **base)
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
        return "malformed", packet(mutated, blocks, bitmap, **other)
    elif kind == "running tensor, bad lanes":
        mutated[lane] = (5, 3)  # invalid in every round
        return "fuzzy", packet(mutated, blocks, bitmap, **{
            **base, "tensor": tensor, "round": int(rng.integers(0, 6)),
            "flags": int(rng.integers(0, 4))})
    elif kind == "foreign token":
        return "unknown", packet(table, blocks, bitmap, **{
            **base, "tensor": tensor, "token": Job.token ^ int(rng.integers(1, 2 ** 63))})
    elif kind == "foreign release/bye":
        return "unknown", wire.header(**{
            **base, "tensor": tensor, "type": int(rng.choice([T["RELEASE"], T["BYE"]])),
            "token": Job.token ^ int(rng.integers(1, 2 ** 63))})
    else:
        raise AssertionError(kind)
    return "malformed", packet(mutated, blocks, bitmap, **base)


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


@pytest.fixture
def fuzz_job(aggs, make_workers):
    agg = aggs(Job.n, "--threads", "2")
    ws = make_workers([agg], Job.n, token=Job.token, payload_bytes=Job.payload,
                      slots_per_aggregator=Job.slots)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((HOST, 0))
    yield agg, ws, sock, [0]
    sock.close()


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


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(junk=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2 ** 20),
                               st.binary(min_size=0, max_size=300)), min_size=1, max_size=40))
def test_fuzz_malformed_and_foreign_packets_during_a_job(fuzz_job, junk):
    counter = fuzz_job[3]
    counter[0] += 1
    tensor = 1000 + counter[0]
    built = [junk_packets(kind, seed + 7919 * i, tensor, raw)
             for i, (kind, seed, raw) in enumerate(junk)]
    d = reduce_under_junk(fuzz_job, tensor, counter[0], [p for _, p in built], "fuzz")
    want = {x: sum(1 for e, _ in built if e == x) for x in ("malformed", "unknown", "fuzzy")}
    kinds = sorted({k for k, _, _ in junk})
    assert d["unknown_job"] == want["unknown"], (d, want, kinds)
    assert want["malformed"] <= d["malformed"] <= want["malformed"] + want["fuzzy"], (
        d, want, kinds)
    assert d["malformed"] + d["stale"] + d["duplicates"] >= want["malformed"] + want["fuzzy"]
    assert d["mismatch"] == 0 and d["jobs"] == 0, (d, kinds)
    assert d["tensors"] == 1, f"malformed packets created tensor state: {d} {kinds}"


def test_malformed_packet_cannot_redirect_results(aggs):
    """Python workers speak the protocol by hand: the RESULT is the sum, sent to the workers'
    own addresses; a malformed DATA carrying the job token and a worker id (here for the
    round in progress) changes nothing, so the RESULT still goes to that worker, not to the
    sender of the junk."""
    agg = aggs(2)
    token = 0xC0FFEE
    w = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    try:
        for s in w:
            s.bind((HOST, 0))
            s.settimeout(5)
        for r in range(2):
            w[r].sendto(wire.header(type=T["REGISTER"], token=token, worker=r, nworkers=2),
                        agg.addr)
            assert wire.parse(w[r].recv(100))["type"] == T["REGACK"]
        vals = [np.arange(4, dtype=np.float32) + 1, np.full(4, 0.5, dtype=np.float32)]
        geom = {"token": token, "nworkers": 2, "tensor": 9, "slot": 0, "round": 0,
                "block_size": 4, "nblocks": 1, "nslots": 1, "meta": 1, "dtype": 0}
        w[1].sendto(packet([(0, INF)], [vals[1].tobytes()], **geom, worker=1), agg.addr)
        # the attacker holds the token: malformed DATA (bad lane table) as worker 1
        w[2].sendto(packet([(3, 1)], [vals[1].tobytes()], **geom, worker=1), agg.addr)
        sync(w[2], agg)
        w[0].sendto(packet([(0, INF)], [vals[0].tobytes()], **geom, worker=0), agg.addr)
        for r in range(2):
            res = wire.parse(w[r].recv(1000))
            assert res["type"] == T["RESULT"] and res["round"] == 0 and res["present"] == 1
            assert res["flags"] & protocol.FLAGS["LAST"]
            assert res["lane_table"] == [(0, INF)] and res["bitmap"] == 1
            np.testing.assert_array_equal(np.frombuffer(res["blocks"][0], np.float32),
                                          vals[0] + vals[1])
        w[2].settimeout(0.3)
        with pytest.raises(TimeoutError):
            w[2].recv(1000)
        # a lost RESULT: the retransmitted DATA of round 0 gets the stored copy back
        w[1].sendto(packet([(0, INF)], [vals[1].tobytes()], **geom, worker=1), agg.addr)
        again = wire.parse(w[1].recv(1000))
        assert again["type"] == T["RESULT"] and again["round"] == 0
        for r in range(2):
            w[r].sendto(wire.header(type=T["RELEASE"], token=token, worker=r, nworkers=2,
                                    tensor=9), agg.addr)
        sync(w[2], agg)
        s = agg.stats()
        # the junk came after worker 1's DATA of the round: a duplicate, answered by nothing
        assert s["released"] == 1 and s["retransmits"] == 1, s
        assert s["malformed"] + s["duplicates"] == 1 and s["tensors"] == 1, s
    finally:
        for s in w:
            s.close()


def test_tensor_mismatch_fails_every_worker(aggs, make_workers):
    ws = make_workers([aggs(3)], 3, timeout=20)
    rng = np.random.default_rng(0)
    for tid, variant in ((1, "numel"), (2, "meta"), (3, "dtype")):
        ins = [block_sparse(rng, 64 * 100 + 3, 64, 0.5, torch.float32) for _ in range(3)]
        meta = [7, 7, 7]
        if variant == "numel":
            ins[2] = block_sparse(rng, 64 * 130, 64, 0.5, torch.float32)
        elif variant == "meta":
            meta[1] = 8
        else:
            ins[0] = ins[0].double()
        outs = [x.clone() for x in ins]
        t0 = time.monotonic()
        tickets = [w.submit(tid, ins[r], outs[r], 64, meta[r], None, f"m{tid}", 1.0)
                   for r, w in enumerate(ws)]
        for r, w in enumerate(ws):
            assert w.wait(tickets[r], WAIT)
            with pytest.raises(RuntimeError, match="mismatch"):
                w.finish(tickets[r])
        assert time.monotonic() - t0 < 15, "a mismatch is reported, not timed out"


def test_tensor_mismatch_on_tensor_id_zero(aggs, make_workers):
    ws = make_workers([aggs(2)], 2, timeout=1.5)
    ins = [torch.ones(64), torch.ones(128)]  # one slot each; block counts differ
    tickets = [w.submit(0, ins[r], ins[r].clone(), 64, 7, None, "zero", 1.0)
               for r, w in enumerate(ws)]
    for r, w in enumerate(ws):
        assert w.wait(tickets[r], WAIT)
        with pytest.raises(RuntimeError, match="mismatch"):
            w.finish(tickets[r])


# ------------------------------------------------------------------------------------------
# 4. Two jobs on one aggregator
# ------------------------------------------------------------------------------------------

def test_two_jobs_share_an_aggregator_without_mixing(aggs, make_workers):
    agg = aggs(2)
    a = make_workers([agg], 2, token=111, payload_bytes=1024, slots_per_aggregator=4)
    b = make_workers([agg], 2, token=222, payload_bytes=1024, slots_per_aggregator=4)
    rng = np.random.default_rng(2)
    ins_a = [block_sparse(rng, 64 * 300 + 1, 64, 0.3, torch.float32) for _ in range(2)]
    ins_b = [block_sparse(rng, 64 * 300 + 1, 64, 0.3, torch.float32) for _ in range(2)]
    outs = {}
    tickets = []
    for job, ws, ins in (("a", a, ins_a), ("b", b, ins_b)):  # same tensor id, interleaved
        for r, w in enumerate(ws):
            outs[job, r] = torch.zeros_like(ins[r])
            tickets.append((w, w.submit(42, ins[r], outs[job, r], 64, 7, None, "same", 1.0)))
    for w, t in tickets:
        assert w.wait(t, WAIT)
        w.finish(t)
    for job, ins in (("a", ins_a), ("b", ins_b)):
        for r in range(2):
            assert_result(outs[job, r], reference(ins), f"job {job} rank {r}")
    # RELEASE goes out as a tensor finishes, from each worker's socket: the aggregator may count
    # it a moment after the ranks are done.
    deadline = time.monotonic() + 10
    while (s := agg.stats())["released"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s["jobs"] == 2 and s["tensors"] == 2 and s["released"] == 2, s


# ------------------------------------------------------------------------------------------
# 5. Registration; 6. a dead aggregator
# ------------------------------------------------------------------------------------------

def test_register_refused_for_a_job_of_another_size(aggs, make_workers):
    agg = aggs(3)
    (w0, _) = make_workers([agg], 2, register=False)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"refused.*{HOST}:{agg.port}|"
                                           rf"{HOST}:{agg.port}.*refused"):
        w0.register(10.0)
    assert time.monotonic() - t0 < 5
    assert agg.stats()["jobs"] == 0


def test_register_with_nobody_listening_times_out_naming_the_address(make_workers):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    s.close()
    w = _C.OmniWorker([(HOST, port)], 5, 0, 1)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=re.escape(f"{HOST}:{port}")):
            w.register(1.0)
        assert 0.9 < time.monotonic() - t0 < 5
    finally:
        w.close()


def test_killed_aggregator_fails_the_tensor_naming_it(aggs, make_workers):
    """K = 2; aggregator 1 dies (SIGKILL) while a large tensor streams: every worker's finish()
    raises within about the timeout, naming 127.0.0.1:PORT of the dead one."""
    a0, a1 = aggs(2), aggs(2)
    timeout = 2.0
    # one block per packet, one slot per aggregator: thousands of rounds per slot
    ws = make_workers([a0, a1], 2, timeout=timeout, payload_bytes=1024, slots_per_aggregator=1)
    rng = np.random.default_rng(6)
    ins = [block_sparse(rng, 1 << 21, 256, 1.0, torch.float32) for _ in range(2)]
    outs = [torch.empty_like(x) for x in ins]
    tickets = [ws[0].submit(1, ins[0], outs[0], 256, 7, None, "big", 1.0)]
    time.sleep(0.1)
    tickets.append(ws[1].submit(1, ins[1], outs[1], 256, 7, None, "big", 1.0))
    time.sleep(0.02)
    assert not ws[1].poll(tickets[1]), "finished before the kill: make the tensor larger"
    a1.kill()
    t0 = time.monotonic()
    for w, t in zip(ws, tickets, strict=True):
        assert w.wait(t, timeout + 10), "no hang"
        with pytest.raises(RuntimeError, match=re.escape(f"{HOST}:{a1.port}")):
            w.finish(t)
    assert time.monotonic() - t0 < timeout + 5
    assert a0.alive()


# ------------------------------------------------------------------------------------------
# 7. Command line
# ------------------------------------------------------------------------------------------

def test_cli_help():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", mod, *args, "--help"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for mod, args in (("hvd_sparse.tools.cli", ["aggregator"]),
                               ("hvd_sparse.aggregator", []))]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        assert "--bind ADDR:PORT" in out and "--workers" in out, out
    direct = subprocess.run([str(BINARY), "--help"], capture_output=True, text=True, timeout=10)
    assert direct.returncode == 0 and "--drop-rate" in direct.stderr
    bad = subprocess.run([str(BINARY), "--bogus"], capture_output=True, text=True, timeout=10)
    assert bad.returncode == 2 and "--bogus" in bad.stderr


def test_periodic_stats_and_stats_at_exit(aggs):
    agg = aggs(2, "--stats", "0.2")
    first = agg.log.read_text().splitlines()[0]
    assert first.startswith(f"hvd-sparse aggregator listening on {HOST}:{agg.port}")
    deadline = time.monotonic() + 20
    while len(agg.stat_lines()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = agg.stat_lines()
    assert len(lines) >= 3, agg.log.read_text()
    assert {"rx_packets", "retransmits", "malformed", "injected_drops"} <= set(lines[0])
    n = len(lines)
    final = agg.stop()
    assert len(agg.stat_lines()) > n and final["rx_packets"] == 0


def test_parent_pid_exit_stops_the_aggregator(tmp_path):
    """The aggregator's parent (standing in for rank 0) is SIGKILLed: the aggregator exits."""
    pid_file = tmp_path / "agg.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([{str(BINARY)!r}, '--bind', '127.0.0.1:0', '--workers', '1',"
        " '--parent-pid', str(os.getpid())], stdout=subprocess.DEVNULL)\n"
        f"open({str(pid_file)!r} + '.tmp', 'w').write(str(p.pid))\n"
        f"os.rename({str(pid_file)!r} + '.tmp', {str(pid_file)!r})\n"
        "time.sleep(120)\n")])
    agg_pid = None
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        agg_pid = int(pid_file.read_text())
        time.sleep(0.3)
        assert process_alive(agg_pid), "the aggregator must run while its parent lives"
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while process_alive(agg_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(agg_pid), "aggregator outlived its parent"
    finally:
        parent.kill()
        if agg_pid and process_alive(agg_pid):
            os.kill(agg_pid, signal.SIGKILL)


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------------------------
# 8. The spec's header table is the code's
# ------------------------------------------------------------------------------------------

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
