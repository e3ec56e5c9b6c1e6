"""The OmniReduce-style aggregator (csrc/omni/aggregator/) and worker engine
(hvd_sparse._C.OmniWorker) without Horovod, against a float64 numpy reference: workers x
aggregators x dtypes x in/out of place, edge sizes and masks, fresh-zeros outputs, rounding
once, fixed point, worker processes. Helpers: tests/aggregator_helpers.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from aggregator_helpers import (
    WAIT,
    assert_result,
    bits,
    block_sparse,
    f64,
    geometry,
    reference,
    round_once,
    run,
)

from hvd_sparse import blocks, fixedpoint, protocol

ROOT = Path(__file__).resolve().parents[1]


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
