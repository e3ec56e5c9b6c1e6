"""Every scheme x dtype x density x size against Horovod's dense allreduce in float64, on every
rank, bit-identical across ranks; async reductions submitted in different orders on different
ranks, op=Sum with scaling factors, Compression.sparse, in place.

Under horovodrun (2 and 4 ranks) and mpirun; staged through host memory as a GPU tensor is
(HVD_SPARSE_CPU_AS_DEVICE: the same path for CPU tensors); over IPv6 (the job's aggregator
bound to ::1 and reached there, HVD_SPARSE_AGGREGATOR_HOST); HVD_SPARSE_TEST_DEVICE=cuda: the
tensors on the GPU, the references on the CPU (gpu launches, skipped without a GPU).
"""
from __future__ import annotations

import os
from collections import Counter

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import DEVICE, close_to, codec_paths, differing_ranks, digest, start

import hvd_sparse
from hvd_sparse import basics, device

# The full grid at 2 ranks; under mpirun and staged: 2 of its 4 dtypes, 4 of its 7 shapes
# (HVD_SPARSE_TEST_QUICK=1); at 4 ranks (over 5 minutes of this 2-core machine in full, nearly
# 4 with two dtypes) float32 alone (=float32): the 16-bit dtypes go the same way at 2 ranks.
LAUNCHES = [
    Launch(np=2, timeout=480),
    Launch(np=4, env={"HVD_SPARSE_TEST_QUICK": "float32"}, timeout=480, extended=True),
    Launch("mpirun", np=2, env={"HVD_SPARSE_TEST_QUICK": "1"}, timeout=480),
    Launch(np=2, id="staged-gloo-np2", timeout=480,
           env={"HVD_SPARSE_TEST_QUICK": "1", "HVD_SPARSE_CPU_AS_DEVICE": "1"}),
    Launch(np=2, id="ipv6-gloo-np2", timeout=480,
           env={"HVD_SPARSE_TEST_QUICK": "1", "HVD_SPARSE_AGGREGATOR_HOST": "::1"}),
    Launch(np=2, id="cuda-np2", gpu=True, timeout=600,
           env={"HVD_SPARSE_TEST_QUICK": "1", "HVD_SPARSE_TEST_DEVICE": "cuda"}),
    Launch(np=4, id="cuda-np4", gpu=True, timeout=600,
           env={"HVD_SPARSE_TEST_QUICK": "1", "HVD_SPARSE_TEST_DEVICE": "cuda"}),
]

SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DENSITIES = [0.0, 1e-4, 0.01, 0.3, 1.0]
# 1,048,577 float32 or float64: over 4 MiB, so out of place lands in fresh zeros (blocks.zeros)
SHAPES = [(1,), (255,), (256,), (257,), (1_048_577,), (3, 5, 7), (1000, 33)]
QUICK = os.environ.get("HVD_SPARSE_TEST_QUICK", "")
if QUICK:
    DTYPES = [torch.float32] if QUICK == "float32" else [torch.float32, torch.float16]
    SHAPES = [(1,), (257,), (3, 5, 7), (100_003,)]
# (k, scheme, dtype, density, shape): k seeds the data and picks the op
GRID = [(k, *c) for k, c in enumerate(((s, d, x, sh) for s in SCHEMES for d in DTYPES
                                       for x in DENSITIES for sh in SHAPES), start=1)]
STAGED = DEVICE != "cpu" or bool(os.environ.get("HVD_SPARSE_CPU_AS_DEVICE"))
# What each grid case ran on this rank: name -> (scheme asked, scheme that ran, reason)
RAN: dict[str, tuple[str, str, str | None]] = {}
# Per scheme asked, the fewest grid cases that must run it ("auto": decide, rather than be sent
# dense as small), full grid and quick. A case may go elsewhere only with a reason, and the one
# reason here is "small": under small_bytes=1024, omnireduce and auto go dense. That depends on
# dtype and shape alone, so the counts are exact, measured: omnireduce and auto run in 65 of
# the 140 full cases (float32 4 of 7 shapes, float64 5, float16 and bfloat16 2 each, x 5
# densities), 15 of the 40 quick ones (float32 (257,) and (100003,), float16 (100003,)), 10 of
# the 20 float32 ones; dense, allgather and zen in all. The floor is the count itself: one case
# more going elsewhere fails.
ALL, SENT = {"1": (40, 15), "float32": (20, 10), "": (140, 65)}[QUICK]
FLOORS = {"dense": ALL, "allgather": ALL, "zen": ALL, "omnireduce": SENT, "auto": SENT}


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start(small_bytes=1024)  # small threshold low so "auto" takes its sparse paths in tests


def sample(shape: tuple[int, ...], density: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Block-clustered sparse data: whole 256-blocks chosen at ``density``, half-filled."""
    g = torch.Generator().manual_seed(seed)
    numel = int(torch.tensor(shape).prod())
    nblocks = (numel + 255) // 256
    chosen = (torch.rand(nblocks, generator=g) < density).repeat_interleave(256)[:numel]
    fill = torch.rand(numel, generator=g) < 0.5
    values = torch.randn(numel, generator=g) * (chosen & fill)
    if density > 0 and seed % 2 == 0:
        values[0] = 1.5  # index 0 must never be dropped
    if density >= 1.0:
        values = torch.randn(numel, generator=g)
    return values.reshape(shape).to(dtype).to(DEVICE)


def f64(t: torch.Tensor) -> torch.Tensor:
    """The reference's input: float64 on the CPU, which Horovod's CPU operations reduce."""
    return t.double().cpu()


def grid_id(case: tuple) -> str:
    _, scheme, dtype, density, shape = case
    return f"{scheme}-{str(dtype)[6:]}-{density:g}-{'x'.join(map(str, shape))}"


def test_the_grid_has_at_least_100_cases():
    assert len(GRID) >= 100, f"only {len(GRID)} cases"


@pytest.mark.parametrize("case", GRID, ids=[grid_id(c) for c in GRID])
def test_matches_dense_and_is_identical_on_every_rank(case):
    k, scheme, dtype, _, _ = case
    name = "/".join(grid_id(case).split("-", 3))
    t = sample(case[4], case[3], dtype, seed=1000 * k + hvd.rank())
    op = hvd.Sum if k % 3 == 0 else hvd.Average
    ref = hvd.allreduce(f64(t), name=f"ref.{name}", op=op)
    out = hvd_sparse.allreduce(t, name=name, op=op, scheme=scheme)
    differ = differing_ranks(digest(out), name)  # before any assert: every rank takes part
    m = hvd_sparse.metrics()[name]
    RAN[name] = (scheme, m["scheme"], m.get("reason"))
    assert scheme in ("auto", m["scheme"]) or "reason" in m, \
        f"reduced by scheme {m['scheme']!r}, not {scheme!r}, unsaid"
    assert close_to(out, ref, dtype, DEVICE) == ""
    assert differ == [], f"result differs from rank 0's on ranks {differ}"


def test_enough_cases_ran_the_scheme_asked_for():
    """Right after the grid: the cases that ran the scheme asked for, counted per scheme, at
    least FLOORS, the same on every rank (a case accepted with a reason ran something else)."""
    ran = Counter(asked for asked, got, reason in RAN.values()
                  if got == asked or (asked == "auto" and reason is None))
    counts = {s: ran[s] for s in SCHEMES}
    every = hvd.allgather_object(counts, name="grid.ran")
    assert [c for c in every if c != counts] == [], f"ranks counted otherwise: {every}"
    asked = Counter(c[1] for c in GRID)
    low = [s for s in SCHEMES if counts[s] < FLOORS[s]]
    assert low == [], "too few cases ran the scheme asked for: " + ", ".join(
        f"{s} {counts[s]} of {asked[s]} (floor {FLOORS[s]})" for s in SCHEMES)


def test_auto_choice_is_visible_and_consistent():
    choice = {n: m["scheme"] for n, m in hvd_sparse.metrics().items()
              if n.startswith("auto/float32/0.01")}
    choices = hvd.allgather_object(choice, name="auto.choices")
    assert choices[0], "metrics() recorded no auto choice"
    assert all(c == choices[0] for c in choices), "ranks chose different schemes"
    assert set(choices[0].values()) <= {"dense", "allgather", "zen", "omnireduce"}


def test_blocks_one_rank_holds_alone_are_left_out_of_its_results():
    """Each rank holds one block of a packet alone and shares another: its copy of the RESULT
    leaves its own lane out (flag OWN) and it writes its block as the aggregators sum it (-0
    summed to +0), so every rank has the same bits, those of Horovod's float64 sum rounded
    once; it receives the others' blocks and the shared one, not its own."""
    n, rank = hvd.size(), hvd.rank()
    t = torch.zeros(256 * 64, dtype=torch.float32)  # blocks 0..n: lanes of the first packet
    g = torch.Generator().manual_seed(rank)
    t[256 * rank:256 * (rank + 1)] = torch.randn(256, generator=g)
    t[256 * rank:256 * (rank + 1):5] = -0.0
    t[256 * n:256 * (n + 1)] = torch.randn(256, generator=g)  # every rank's
    ref = hvd.allreduce(t.double(), op=hvd.Sum, name="own.ref").float()
    out = hvd_sparse.allreduce(t, name="own", scheme="omnireduce", op=hvd.Sum)
    assert differing_ranks(digest(out), "own") == []
    assert digest(out) == digest(ref)
    m = hvd_sparse.metrics()["own"]
    assert m["scheme"] == "omnireduce" and m["bytes_received"] == n * 256 * 4, m


def test_auto_stops_asking_for_a_tensor_that_keeps_going_dense():
    """A full tensor under auto goes dense; past STEADY such calls it goes dense without the
    ranks' stats allgather, but for a look every LOOK_AGAIN calls. Every result equals
    Horovod's allreduce in float64, and every rank skips the same calls."""
    from hvd_sparse.schemes.auto import LOOK_AGAIN, STEADY

    asked = []
    for call in range(LOOK_AGAIN + 2):
        t = torch.randn(300_000, generator=torch.Generator().manual_seed(10 * call + hvd.rank()))
        ref = hvd.allreduce(t.double(), name=f"ref.steady.{call}", op=hvd.Average)
        out = hvd_sparse.allreduce(t, name="steady", scheme="auto")
        assert close_to(out, ref, torch.float32) == ""
        m = hvd_sparse.metrics()["steady"]
        assert m["scheme"] == "dense", m
        asked.append("stats" in m["stages_ms"])
    assert asked == [True] * STEADY + [False] * (LOOK_AGAIN - STEADY) + [True, False], asked
    assert all(a == asked for a in hvd.allgather_object(asked, name="steady.asked"))


def test_async_out_of_order():
    """Several reductions in flight, submitted and synchronized in different orders per rank."""
    rank = hvd.rank()
    names = [f"ooo.{i}" for i in range(6)]
    tensors = {n: sample((5000,), 0.05, torch.float32, seed=i * 7 + rank)
               for i, n in enumerate(names)}
    # References first, in one order: a blocking Horovod call mixed into the waits below could
    # itself deadlock against a peer that waits on a different tensor.
    refs = {n: hvd.allreduce(f64(tensors[n]), name=f"ref.{n}", op=hvd.Sum) for n in names}
    order = names if rank % 2 == 0 else names[::-1]
    handles = {n: hvd_sparse.allreduce_async(
        tensors[n], name=n, op=hvd.Sum, scheme=SCHEMES[names.index(n) % len(SCHEMES)])
        for n in order}
    errors = []
    for n in (order[::-1] if rank % 2 == 0 else order):
        err = close_to(hvd_sparse.synchronize(handles[n]), refs[n], torch.float32, DEVICE)
        if err != "":
            errors.append(f"{n}: {err}")
    assert errors == []


def test_scaling_factors():
    t = sample((20000,), 0.05, torch.float32, seed=hvd.rank())
    ref = hvd.allreduce(f64(t), name="ref.scaled", op=hvd.Average,
                        prescale_factor=0.5, postscale_factor=3.0)
    errs = []
    for s in SCHEMES:
        out = hvd_sparse.allreduce(t, name=f"scaled.{s}", op=hvd.Average, scheme=s,
                                   prescale_factor=0.5, postscale_factor=3.0)
        errs += [f"{s}: {e}" for e in [close_to(out, ref, torch.float32, DEVICE)] if e != ""]
    assert errs == []


def test_compression_is_functional():
    """hvd.allreduce(t, compression=Compression.sparse()) returns a new tensor, as Horovod
    promises, and leaves t alone (Horovod's optimizer alone gets an in-place reduction)."""
    t = sample((20000,), 0.05, torch.float32, seed=hvd.rank() + 3)
    orig = t.clone()
    ref = hvd.allreduce(f64(t), name="ref.compression", op=hvd.Sum, postscale_factor=3.0)
    errs = []
    for s in SCHEMES:
        out = hvd.allreduce(t, name=f"compression.{s}", op=hvd.Sum, postscale_factor=3.0,
                            compression=hvd_sparse.Compression.sparse(scheme=s))
        errs += [f"{s}: {e}" for e in [close_to(out, ref, torch.float32, DEVICE)] if e != ""]
        if not torch.equal(t, orig):
            errs.append(f"{s}: the input was modified")
            t.copy_(orig)
    assert errs == []


def test_inplace():
    errs = []
    for s in SCHEMES:
        for dtype in (torch.float32, torch.float16):
            base = sample((300, 90), 0.05, dtype, seed=hvd.rank() + 5)
            ref = hvd.allreduce(f64(base), name=f"ref.inplace.{s}.{dtype}")
            for layout, t in (("contiguous", base.clone()), ("transposed", base.clone().t())):
                want = ref if layout == "contiguous" else ref.t()
                out = hvd_sparse.allreduce_(t, name=f"inplace.{s}.{dtype}.{layout}", scheme=s)
                if out is not t:
                    errs.append(f"{s}/{dtype}/{layout}: not the same tensor")
                if (e := close_to(t, want, dtype, DEVICE)) != "":
                    errs.append(f"{s}/{dtype}/{layout}: {e}")
    assert errs == []


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_inplace_bits(scheme, dtype):
    """allreduce_ rewrites only the blocks some rank sent: the rest must still come out +0
    (-0 included), the same bits as out of place, on every rank. (Auto may clear -0 in
    all-zero blocks and then pick dense: equal values, the same bits on every rank.)"""
    rank = hvd.rank()
    base = sample((40_000,), 0.02, dtype, seed=rank + 11)
    if rank % 2:  # -0 on some ranks only: unsent blocks must not keep it
        base[base == 0] = -0.0
    out = hvd_sparse.allreduce(base, name=f"bits.{scheme}.{dtype}", scheme=scheme)
    t = hvd_sparse.allreduce_(base.clone(), name=f"bits_.{scheme}.{dtype}", scheme=scheme)
    differ = differing_ranks(digest(t), f"bits.{scheme}.{dtype}")
    ints = torch.int64 if dtype == torch.float64 else torch.int32
    assert (torch.equal(t, out) if scheme == "auto"
            else torch.equal(t.view(ints), out.view(ints))), "in place differs from out of place"
    assert differ == [], f"result differs from rank 0's on ranks {differ}"


def test_the_aggregators_are_where_the_launch_says():
    """Rank 0's aggregator process, bound to and reached at 127.0.0.1, or at ::1 under
    HVD_SPARSE_AGGREGATOR_HOST=::1 (bound to ::1 alone: no IPv4 datagram reaches it)."""
    omni = basics.state().omni
    want = os.environ.get("HVD_SPARSE_AGGREGATOR_HOST", "127.0.0.1")
    assert omni.placement == "rank0" and {h for h, _ in omni.addrs} == {want}, omni.addrs
    assert hvd_sparse.metrics()  # the grid above ran through them (FLOORS)


def test_every_tensor_went_the_path_of_this_run():
    """Staged through host memory exactly when the tensors are a device's (or pose as one)."""
    assert device.CPU_AS_DEVICE == bool(os.environ.get("HVD_SPARSE_CPU_AS_DEVICE"))
    staged = ["staged" in m for m in hvd_sparse.metrics().values()]
    counts = sum(staged), len(staged) - sum(staged)
    assert (counts[1] == 0 < counts[0]) if STAGED else counts[0] == 0, counts
    assert codec_paths() == ""  # CUDA tensors: the kernels ran, not torch operations
