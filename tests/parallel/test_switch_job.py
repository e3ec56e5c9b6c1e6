"""One job on the netns testbed with the emulated switch in place of the bridge (4 worker hosts,
1 aggregator host), launched by tests/test_switch_emu.py on its testbed (no LAUNCHES of its
own), with -k choosing the tests:

    not test_refused   MPI (Horovod's dense allreduce), allgather and omnireduce through the
                       aggregator host cross the switch; scheme "switch" sums in it
    test_aggregate     only scheme "switch" (under loss)
    test_refused       the switch refuses the job (its pool is full): scheme "switch" goes to
                       the aggregator host, with its reason

Scheme "switch": float32, float16 and bfloat16 at element densities 0 .. 1 equal the float64
sum of Horovod's allreduce within the fixed-point bound (hvd_sparse.fixedpoint.error_bound)
plus one rounding to the dtype, bit-identical on every rank; tensors in flight together; what
the switch cannot take (NaN, a block larger than a slot, float64 unless fixed point is asked
for) falls back with its reason, exactly.
"""
from __future__ import annotations

import hashlib
import itertools
import os

import horovod.torch as hvd
import pytest
import shapes
import torch
from hypothesis import given
from hypothesis import strategies as st
from ranktools import close_to, start

import hvd_sparse
from hvd_sparse import fixedpoint

LAUNCHES = []  # tests/test_switch_emu.py launches it on its testbed

NUMEL = 1 << 18
DENSITIES = (0.0, 1e-4, 0.01, 0.3, 1.0)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WORLD = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "4"))
_names = itertools.count()


def data(seed: int, dtype: torch.dtype, density: float = 0.1, block: bool = True) -> torch.Tensor:
    """Random values in ``density`` of the 256-blocks (``block``) or of the elements."""
    g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
    if block:
        keep = (torch.rand(NUMEL // 256, generator=g) < density)[:, None].expand(-1, 256)
    else:
        keep = torch.rand(NUMEL // 256, 256, generator=g) < density
    return (torch.randn(NUMEL // 256, 256, generator=g) * 3 * keep).reshape(-1).to(dtype)


def schemes() -> str:
    bad = []
    for i, scheme in enumerate(("dense", "allgather", "omnireduce")):
        for dtype in (torch.float32, torch.float16):
            t = data(i, dtype)
            ref = hvd.allreduce(t.double(), name=f"ref.{scheme}.{dtype}", op=hvd.Sum)
            out = hvd_sparse.allreduce(t, name=f"s.{scheme}.{dtype}", scheme=scheme, op=hvd.Sum)
            if (why := close_to(out, ref, dtype)) != "":
                bad.append(f"{scheme} {dtype}: {why}")
    return "; ".join(bad)


def bounded(out: torch.Tensor, ref: torch.Tensor, inputs: torch.Tensor) -> str:
    """'' when ``out`` is within the fixed-point bound of the float64 sum ``ref``, plus one
    rounding to its dtype, and bit-identical on every rank; else why not."""
    m = float(hvd.allreduce(inputs.double().abs().max().reshape(1), op=hvd.Max,
                            name="bound.max")) if inputs.numel() else 0.0
    bound = fixedpoint.error_bound(m, hvd.size())
    info = torch.finfo(out.dtype)
    allowed = bound + info.eps * (ref.abs() + bound) + info.smallest_normal * info.eps
    err = (out.double() - ref).abs()
    if out.dtype != inputs.dtype or not bool((err <= allowed).all()):
        worst = int((err - allowed).argmax())
        return (f"{out.dtype}: error {float(err[worst]):g} > allowed {float(allowed[worst]):g} "
                f"at {worst} (bound {bound:g})")
    digest = hashlib.sha256(out.view(torch.int16 if out.element_size() == 2 else torch.int32)
                            .numpy().tobytes()).hexdigest()
    digests = hvd.allgather_object(digest, name="bound.digest")
    return "" if len(set(digests)) == 1 else f"{out.dtype}: ranks differ: {digests}"


def went_through_switch(name: str) -> str:
    m = hvd_sparse.metrics()[name]
    return "" if m["scheme"] == "switch" and "reason" not in m else f"{name}: {m}"


def aggregate() -> str:
    bad = []
    for dtype in DTYPES:
        for k, density in enumerate(DENSITIES):
            t = data(10 + k, dtype, density, block=False)
            name = f"sw.{dtype}.{density}"
            ref = hvd.allreduce(t.double(), name=f"ref.{name}", op=hvd.Sum)
            out = hvd_sparse.allreduce(t, name=name, scheme="switch", op=hvd.Sum)
            for why in (bounded(out, ref, t), went_through_switch(name)):
                if why != "":
                    bad.append(f"density {density}: {why}")
    # Average (the op's scale applies after the integer sum), in place
    t = data(20, torch.float32, 0.05)
    x = t.clone()
    ref = hvd.allreduce(t.double(), name="ref.avg", op=hvd.Average)
    hvd_sparse.allreduce_(t, name="sw.avg", scheme="switch", op=hvd.Average)
    bad += [w for w in (bounded(t, ref, x), went_through_switch("sw.avg")) if w]
    return "; ".join(bad)


def in_flight_together() -> str:
    """Tensors submitted together take turns in the switch: every one is right."""
    ts = [data(30 + i, torch.float32, 0.2) for i in range(4)]
    refs = [hvd.allreduce(t.double(), name=f"ref.fl{i}", op=hvd.Sum) for i, t in enumerate(ts)]
    handles = [hvd_sparse.allreduce_async(t, name=f"fl{i}", scheme="switch", op=hvd.Sum)
               for i, t in enumerate(ts)]
    outs = [hvd_sparse.synchronize(h) for h in handles]
    return "; ".join(w for i, (o, r, t) in enumerate(zip(outs, refs, ts, strict=True))
                     for w in (bounded(o, r, t), went_through_switch(f"fl{i}")) if w)


def falls_back() -> str:
    """NaN on one rank goes elsewhere, with the reason, and a block larger than a switch slot
    through the switch in finer blocks; both give what Horovod's allreduce gives."""
    bad = []
    t = data(40, torch.float32)
    if hvd.rank() == 1:
        t[7] = float("nan")
    ref = hvd.allreduce(t.double(), name="ref.nan", op=hvd.Sum)
    out = hvd_sparse.allreduce(t, name="sw.nan", scheme="switch", op=hvd.Sum)
    if (why := close_to(out, ref, torch.float32)) != "":
        bad.append(f"nan: {why}")
    if hvd_sparse.metrics()["sw.nan"].get("reason") != "switch: non-finite":
        bad.append(f"nan: {hvd_sparse.metrics()['sw.nan']}")
    t = data(41, torch.float32)
    ref = hvd.allreduce(t.double(), name="ref.big", op=hvd.Sum)
    # 2112 values: 33 passes of 64 where a slot holds one; halved to blocks of 33, one pass
    # each, the tensor goes through the switch all the same
    out = hvd_sparse.allreduce(t, name="sw.big", scheme="switch", op=hvd.Sum, block_size=2112)
    if (why := close_to(out, ref, torch.float32)) != "":
        bad.append(f"block 2112: {why}")
    if why := went_through_switch("sw.big"):
        bad.append(f"block 2112: {why}")
    # float64: exact (through the aggregator host) unless fixed point is asked for, then
    # through the switch within the fixed-point bound
    t = data(42, torch.float64)
    ref = hvd.allreduce(t, name="ref.f64", op=hvd.Sum)
    out = hvd_sparse.allreduce(t, name="sw.f64", scheme="switch", op=hvd.Sum)
    if why := close_to(out, ref, torch.float64):
        bad.append(f"float64: {why}")
    if not hvd_sparse.metrics()["sw.f64"].get("reason", "").startswith("switch: float64"):
        bad.append(f"float64: {hvd_sparse.metrics()['sw.f64']}")
    hvd_sparse.init(probe="off", timeout=20.0, switch_fixed_float64=True)
    out = hvd_sparse.allreduce(t, name="sw.f64.fixed", scheme="switch", op=hvd.Sum)
    bad += [f"float64 fixed: {w}" for w in (bounded(out, ref, t),
                                             went_through_switch("sw.f64.fixed")) if w]
    hvd_sparse.init(probe="off", timeout=20.0)
    return "; ".join(bad)


def refused() -> str:
    """The switch refused the job at init: every switch tensor goes to the aggregator host, with
    the reason, and sums as Horovod's allreduce does."""
    t = data(50, torch.float32)
    ref = hvd.allreduce(t.double(), name="ref.refused", op=hvd.Sum)
    out = hvd_sparse.allreduce(t, name="sw.refused", scheme="switch", op=hvd.Sum)
    bad = [w for w in [close_to(out, ref, torch.float32)] if w]
    m = hvd_sparse.metrics()["sw.refused"]
    if (m.get("scheme"), m.get("reason")) != ("omnireduce", "switch: no switch"):
        bad.append(f"{m}")
    return "; ".join(bad)


def probed(cache: str) -> str:
    """A fresh probe with the switch joined times it in blocks that fit its one-pass packets (a
    256-block does not: init once failed with the switch's UNSUPPORTED), fits its terms, and
    a reduction through the switch after it sums as Horovod does."""
    hvd_sparse.init(probe="force", timeout=20.0, cache_dir=cache)
    try:
        net = hvd_sparse.basics.state().net
        bad = [] if net.switch is not None and net.source == "probe" else [f"model: {net}"]
        t = data(60, torch.float32, 0.05)
        ref = hvd.allreduce(t.double(), name="ref.probed", op=hvd.Sum)
        out = hvd_sparse.allreduce(t, name="sw.probed", scheme="switch", op=hvd.Sum)
        bad += [w for w in (bounded(out, ref, t), went_through_switch("sw.probed")) if w]
        return "; ".join(bad)
    finally:
        hvd_sparse.init(probe="off", timeout=20.0)


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start(probe="off", timeout=20.0)
    yield
    hvd_sparse.shutdown()


def test_schemes():
    assert schemes() == ""


def test_aggregate():
    assert aggregate() == ""


def test_in_flight_together():
    assert in_flight_together() == ""


def test_falls_back():
    assert falls_back() == ""


def test_refused():
    assert refused() == ""


def test_probe_times_the_switch(tmp_path):
    assert probed(str(tmp_path)) == ""


@pytest.fixture
def small_by_switch():
    """Tensors under 64 KiB (most of those drawn) through the switch too."""
    hvd_sparse.init(probe="off", timeout=20.0, small_bytes=0)
    yield
    hvd_sparse.init(probe="off", timeout=20.0)


@pytest.mark.usefixtures("small_by_switch")
@shapes.SETTINGS
@given(case=shapes.blocks(WORLD, st.sampled_from([64, 256]),
                          dtypes=("float32", "float16", "bfloat16")))
def test_any_shape_sums_in_the_switch(case: shapes.Blocks) -> None:
    def run():
        t = case.tensor(hvd.rank())
        name = f"shape.{next(_names)}"
        out = hvd_sparse.allreduce(t, name=name, scheme="switch", op=hvd.Sum,
                                   block_size=case.block)
        ref, _ = case.reference(WORLD, 1.0)
        flat = out.reshape(-1)
        return bounded(flat, ref.reshape(-1), t.reshape(-1)) or went_through_switch(name), out
    shapes.check(case, run, lambda o: hvd.allgather_object(o, name=f"verdict.{next(_names)}"))
