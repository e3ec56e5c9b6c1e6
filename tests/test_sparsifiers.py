"""Sparsifiers and their kernels against numpy/float64 references (single process; the ranks of
ExDyna are simulated by giving each instance its rank and size)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hvd_sparse
from hvd_sparse import _C, DGC, ExDyna, Threshold, TopK
from hvd_sparse.sparsifiers.exdyna import _State

# selection itself, on small tensors too
ONE = {"rank": 0, "size": 1, "min_selected": 0, "min_numel": 0}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors: threads only add contention on the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    _C.set_threads(1)
    yield
    torch.set_num_threads(before)
    _C.set_threads(0)


def topk_set(x: np.ndarray, k: int) -> set[int]:
    return set(np.argpartition(-np.abs(x), k - 1)[:k].tolist()) if k < x.size else set(
        range(x.size))


# ---- TopK ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,density", [(1, 1.0), (10, 0.1), (1000, 0.01), (100_003, 0.001),
                                       (300_000, 0.1), (5000, 1.0)])
def test_topk_selects_exactly_the_k_largest(n, density, dtype):
    g = torch.from_numpy(np.random.default_rng(n).standard_normal(n)).to(dtype)
    out = TopK(density, error_feedback=False, **ONE)("t", g.clone())
    k = max(1, round(density * n))
    nz = np.flatnonzero(out.numpy())
    assert set(nz.tolist()) == topk_set(g.double().numpy(), k)
    np.testing.assert_array_equal(out.numpy()[nz], g.numpy()[nz])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=400), st.integers(0, 500),
       st.integers(0, 2**31))
def test_topk_kernel_with_ties_is_a_top_set(values, k, seed):
    x = torch.tensor(values, dtype=torch.float32)
    idx = _C.topk_abs(x, k, seed).numpy()
    a = np.abs(np.array(values, dtype=np.float64))
    assert len(idx) == min(k, len(values))
    assert np.all(np.diff(idx) > 0)
    rest = np.setdiff1d(np.arange(len(values)), idx)
    if len(idx) and len(rest):
        assert a[idx].min() >= a[rest].max()


# ---- Threshold -------------------------------------------------------------------------------

@pytest.mark.parametrize("thr", [0.0, 0.5, 1.5, 10.0])
def test_threshold_matches_numpy(thr):
    g = torch.randn(50_001, dtype=torch.float64)
    out = Threshold(thr, error_feedback=False, **ONE)("t", g.clone()).numpy()
    x = g.numpy()
    np.testing.assert_array_equal(out, np.where(np.abs(x) >= thr, x, 0.0))


# ---- error feedback ---------------------------------------------------------------------------

def test_residual_memory_math_is_exact():
    rng = np.random.default_rng(3)
    sp = TopK(0.05, **ONE)
    e = np.zeros(2000)
    for step in range(6):
        g = rng.standard_normal(2000)
        out = sp("w", torch.from_numpy(g.copy())).numpy()
        x = e + g
        sel = np.zeros(2000, bool)
        sel[list(topk_set(x, 100))] = True
        np.testing.assert_array_equal(out, np.where(sel, x, 0.0), err_msg=f"step {step}")
        e = np.where(sel, 0.0, x)
        np.testing.assert_array_equal(sp.memory.residuals["w"].numpy(), e)


@pytest.mark.parametrize("masking", [True, False])
def test_dgc_momentum_correction_and_masking(masking):
    """u = m u + g, v = v + u, the selection of v sent; with masking u is zeroed where sent,
    without it u is an exact momentum (what sparsify="frozen" uses for Adam's)."""
    rng = np.random.default_rng(4)
    m, n, density = 0.9, 20_000, 0.01
    sp = DGC(density, momentum=m, **ONE)
    sp.memory.masking = masking
    u, v = np.zeros(n), np.zeros(n)
    for _ in range(5):
        g = rng.standard_normal(n)
        out = sp("w", torch.from_numpy(g.copy())).numpy()
        u = m * u + g
        v = v + u
        sel = out != 0
        # DGC's selection is a top set of |v| with about k elements: a threshold from the
        # 10th of 1,000 samples lets through 0.35-1.3 k here (above 1.3 k: exact top-k)
        assert 0.25 * density * n <= sel.sum() <= 1.3 * density * n, sel.sum()
        assert np.abs(v[sel]).min() >= np.abs(v[~sel]).max()
        np.testing.assert_allclose(out[sel], v[sel], rtol=1e-12)
        if masking:
            u[sel] = 0.0
        v[sel] = 0.0
        np.testing.assert_allclose(sp.memory.residuals["w"].numpy(), v, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(sp.memory.velocities["w"].numpy(), u, rtol=1e-12, atol=1e-12)


def test_error_feedback_off_keeps_no_memory():
    sp = TopK(0.1, error_feedback=False, **ONE)
    g = torch.randn(1000)
    sp("w", g.clone())
    assert not hasattr(sp.memory, "residuals")
    out = sp("w", g.clone())  # same input, no memory: same selection
    assert set(np.flatnonzero(out.numpy()).tolist()) == topk_set(g.double().numpy(), 100)


def test_warmup_decays_density_exponentially_to_the_request():
    sp = TopK(0.01, warmup=4, error_feedback=False, **ONE)
    seen = []
    for _ in range(6):
        sp("w", torch.randn(10_000))
        seen.append(hvd_sparse.metrics()["w"]["achieved_density"])
    want = [0.25 * (0.01 / 0.25) ** (t / 4) for t in range(4)] + [0.01, 0.01]
    np.testing.assert_allclose(seen, want, atol=1e-4)  # k is rounded to whole elements


# ---- ExDyna ----------------------------------------------------------------------------------

def simulate(n: int, size: int, steps: int, density: float, bs: int, het: torch.Tensor,
             per_element: bool = True):
    sp = [ExDyna(density, rank=r, size=size, block_size=bs, per_element=per_element)
          for r in range(size)]
    gen = torch.Generator().manual_seed(0)
    dens, counts = [], []
    for step in range(steps):
        parts = [s.partition("w") if "w" in s.states else None for s in sp]
        outs = [s("w", torch.randn(n, generator=gen) * het) for s in sp]
        masks = [(o != 0).view(-1) for o in outs]
        assert int(torch.stack(masks).sum(0).max()) <= 1, f"step {step}: index chosen twice"
        for r, mask in enumerate(masks):
            if parts[r] is not None and mask.any():
                where = mask.nonzero().squeeze(1) // bs
                assert parts[r][0] <= int(where.min()) and int(where.max()) < parts[r][1]
        red = sum(outs)
        for s in sp:
            s.observe("w", red)
        dens.append(hvd_sparse.metrics()["w"]["union_density"])
        counts.append([int(m.view(-1, bs).any(1).sum()) for m in masks])
    return sp, dens, counts


@pytest.mark.parametrize("per_element", [True, False])
def test_exdyna_is_exclusive_rotating_and_tracks_density(per_element):
    n, bs = 40_000, 4
    het = torch.ones(n)
    het[: n // 8] = 5.0  # a hot region: its partitions must shrink
    het[3 * n // 4:] = 0.2
    sp, dens, counts = simulate(n, 4, 120, 0.0025, bs, het, per_element)  # a 1% union
    after = float(np.mean(dens[40:]))
    assert abs(after - 0.01) <= 0.001, after
    b = sp[0].states["w"].bounds.tolist()
    assert all(s.states["w"].bounds.tolist() == b for s in sp)  # every rank agrees
    assert b[1] - b[0] < (n // bs) // 8  # the partition over the hot region shrank
    first, last = np.array(counts[1:11]), np.array(counts[-10:])
    spread = lambda c: float(np.mean(c.max(1) / np.maximum(1, c.min(1))))  # noqa: E731
    assert spread(last) < spread(first)


def test_exdyna_rebalance_moves_towards_the_heavier_neighbour():
    sp = ExDyna(0.01, rank=0, size=4, block_size=1)
    st_ = _State(torch.tensor([0, 100, 200, 300, 400]), 1)
    sp._rebalance(st_, [40, 10, 10, 10])
    b = st_.bounds.tolist()
    assert b[1] < 100 and b[2:] == [200, 300, 400]  # only the uneven pair moved, towards 0
    st_ = _State(torch.tensor([0, 100, 200, 300, 400]), 1)
    sp._rebalance(st_, [10, 10, 10, 10])
    assert st_.bounds.tolist() == [0, 100, 200, 300, 400]
    sp._rebalance(st_, [100, 102, 104, 100])  # within 5%: stays
    assert st_.bounds.tolist() == [0, 100, 200, 300, 400]
    st_ = _State(torch.tensor([0, 100, 200, 300, 400]), 1)
    for _ in range(50):  # repeated pressure never crosses boundaries
        sp._rebalance(st_, [0, 1000, 0, 1000])
        b = st_.bounds.tolist()
        assert all(b[i] <= b[i + 1] for i in range(4)), b


@pytest.mark.parametrize("per_element", [True, False])
@pytest.mark.parametrize("n,bs", [(10, 256), (700, 256), (3, 1)])
def test_exdyna_with_fewer_blocks_than_ranks_is_exclusive_and_loses_nothing(n, bs, per_element):
    # A 10-element bias at the codec's 256: one block, four ranks; most partitions are empty.
    # (min_selected=0, min_numel=0: by default such tensors go out whole.)
    size, steps = 4, 40
    sp = [ExDyna(0.01, rank=r, size=size, block_size=bs, per_element=per_element,
                 min_selected=0, min_numel=0) for r in range(size)]
    gen = torch.Generator().manual_seed(1)
    sent, given = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for step in range(steps):
        grads = [torch.randn(n, generator=gen) for _ in range(size)]
        given += sum(g.double() for g in grads)
        outs = [s("b", g.clone(), bs) for s, g in zip(sp, grads, strict=True)]
        assert int(torch.stack([o != 0 for o in outs]).sum(0).max()) <= 1, f"step {step}"
        red = sum(o.double() for o in outs)
        sent += red
        for s in sp:
            s.observe("b", red.float(), bs)
        assert all(s.states["b"].bounds.tolist() == sp[0].states["b"].bounds.tolist()
                   for s in sp)
    # Error feedback: what was not sent is exactly what the memories still hold.
    held = sum(s.memory.residuals["b"].double() for s in sp)
    torch.testing.assert_close(sent + held, given, rtol=0, atol=1e-4)
    if per_element:  # 1% of the elements a step need not reach each one: every block does
        assert bool((torch.nn.functional.pad(sent, (0, -n % bs)).view(-1, bs) != 0).any(1).all())
    else:
        assert bool((sent != 0).all()), "every element must go out at some step"


def test_exdyna_per_element_false_selects_whole_blocks_of_the_codec_size():
    sp = ExDyna(0.05, rank=1, size=2, error_feedback=False, per_element=False, min_numel=0)
    g = torch.randn(10_000)
    out = sp("w", g.clone(), 16)  # block size from the call (the codec's)
    b0, b1 = sp.states["w"].bounds.tolist()[1:3]
    mask = (out != 0).view(-1)
    blocks = mask[: (len(mask) // 16) * 16].view(-1, 16)
    assert bool((blocks.all(1) | ~blocks.any(1)).all())  # blocks go whole or not at all
    sel = blocks.any(1).nonzero().squeeze(1)
    assert len(sel) and b0 <= int(sel.min()) and int(sel.max()) < b1


def test_exdyna_selects_elements_in_its_partition_and_takes_the_largest():
    # The default, as the paper: blocks (of the codec's size) draw the partitions only.
    n, bs, size = 20_000, 256, 4
    sp = ExDyna(0.0025, rank=2, size=size, error_feedback=False)  # a 1% union
    g = torch.randn(n)
    out = sp("w", g.clone(), bs)
    b0, b1 = sp.states["w"].bounds.tolist()[2:4]
    lo, hi = b0 * bs, min(b1 * bs, n)
    sel = (out != 0).nonzero().squeeze(1)
    assert len(sel) and lo <= int(sel.min()) and int(sel.max()) < hi
    assert torch.equal(out[sel], g[sel])
    # single elements, not blocks: a quarter of the 1% union lies in this partition (+-50%:
    # the first step's factor is not steered yet)
    assert 0.5 * 0.01 * n / size <= len(sel) <= 2.5 * 0.01 * n / size, len(sel)
    # whatever passed the bar beats whatever did not, in this partition
    rest = torch.ones(n, dtype=torch.bool)
    rest[sel] = False
    rest[:lo] = False
    rest[hi:] = False
    assert float(g[sel].abs().min()) >= float(g[rest].abs().max())


def test_the_ranks_are_each_reductions_and_the_ones_given_stay():
    """The seam tells the sparsifier the ranks of each reduction (``join``): under Horovod
    elastic they change; a rank and size given to the constructor are kept."""
    sp = TopK(0.1)
    sp.join(1, 4)
    assert (sp.rank, sp.size) == (1, 4)
    sp.join(0, 2, epoch=1)  # the job shrank
    assert (sp.rank, sp.size) == (0, 2)
    fixed = ExDyna(0.1, rank=3, size=8)
    fixed.join(0, 2)
    assert (fixed.rank, fixed.size) == (3, 8)


def test_exdyna_cuts_its_partitions_anew_when_the_ranks_change():
    g = torch.from_numpy(np.random.default_rng(7).standard_normal(8192)).float()
    sp = ExDyna(0.01, min_numel=0)
    sp.join(1, 4, epoch=1)
    for _ in range(3):
        sp("w", g.clone(), 16)
    assert sp.states["w"].bounds.numel() == 5 and sp.states["w"].step == 3
    memory = sp.memory.state_dict()
    saved = sp.state_dict()  # a commit at 4 ranks

    sp.join(0, 2, epoch=2)  # joined again after a reset: 2 ranks left
    assert sp.states == {}, "partitions of the old ranks must go, alike on every rank"
    for kind, bufs in memory.items():  # the memory is this rank's own: it stays
        for name, t in bufs.items():
            assert torch.equal(getattr(sp.memory, kind)[name], t)
    sp("w", g.clone(), 16)
    assert sp.states["w"].bounds.numel() == 3 and sp.states["w"].step == 1

    # a state restored from the commit (4 ranks), then used at 2 ranks in the same join: the
    # partitions are cut for 2; the memory comes back as it was committed
    sp.load_state_dict(saved)
    sp("w", g.clone(), 16)
    assert sp.states["w"].bounds.numel() == 3

    # the same size, another join (ranks replaced): forgotten too, since the ranks that
    # restored a commit and those just started must cut the same partitions
    sp.join(0, 2, epoch=3)
    assert sp.states == {}
    same = ExDyna(0.01, min_numel=0)  # a rank just started
    same.join(1, 2, epoch=1)
    sp("w", g.clone(), 16)
    same("w", g.clone(), 16)
    assert torch.equal(sp.states["w"].bounds, same.states["w"].bounds)
    assert sp.states["w"].step == same.states["w"].step == 1


# ---- bad input and special values ----------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: TopK(0), lambda: TopK(1.5), lambda: TopK(-0.1), lambda: TopK(float("nan")),
    lambda: DGC(2.0), lambda: DGC(0.01, sample=0), lambda: DGC(0.01, momentum=1.0),
    lambda: ExDyna(0.0), lambda: ExDyna(1.01), lambda: ExDyna(0.01, block_size=0),
    lambda: Threshold(-1.0), lambda: Threshold(float("nan")), lambda: TopK(0.1, warmup=-1),
    lambda: TopK(0.1, min_numel=-1), lambda: ExDyna(0.1, min_selected=1.5),
    lambda: hvd_sparse.Compression.sparse(sparsifier="topk"),
])
def test_bad_arguments_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("cls", [TopK, DGC, ExDyna])
def test_integer_tensor_raises_value_error(cls):
    with pytest.raises(ValueError, match="int64"):
        cls(0.1, **ONE)("w", torch.arange(100))


SPARSIFIERS = [lambda: TopK(0.1, **ONE), lambda: Threshold(0.5, **ONE),
               lambda: DGC(0.1, **ONE), lambda: ExDyna(0.1, block_size=4, **ONE)]


@pytest.mark.parametrize("make", SPARSIFIERS)
def test_all_zero_gradient_reduces_like_dense(make):
    sp = make()
    for _ in range(3):
        out = sp("w", torch.zeros(1000))
        assert torch.equal(out, torch.zeros(1000))
        sp.observe("w", out)
    g = torch.randn(1000)  # still works after zeros
    assert (sp("w", g.clone()) != 0).any()


@pytest.mark.parametrize("make", SPARSIFIERS)
def test_nan_gradient_goes_out_whole_and_clears_memory(make):
    sp = make()
    sp("w", torch.randn(1000))  # leaves a residual
    g = torch.randn(1000)
    g[17] = float("nan")
    out = sp("w", g.clone())
    assert torch.isnan(out[17]) and bool((out != 0).all()), "sent whole, NaN included"
    assert hvd_sparse.metrics()["w"]["nonfinite"] == 1
    assert torch.isnan(sp("w", torch.full((1000,), float("nan")))).all()
    h = torch.randn(1000)
    out = sp("w", h.clone())  # memory was cleared: only h's values can appear
    nz = out != 0
    assert torch.equal(out[nz], h[nz]) if not isinstance(sp, DGC) else torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gradients_select_in_float32(dtype):
    g = torch.randn(4000).to(dtype)
    out = TopK(0.01, error_feedback=False, **ONE)("w", g.clone())
    assert out.dtype == dtype
    nz = np.flatnonzero(out.float().numpy())
    assert len(nz) == 40
    a = np.abs(g.float().numpy())
    assert a[nz].min() >= np.delete(a, nz).max()


def test_non_contiguous_gradient_is_sparsified_in_place():
    base = torch.randn(200, 50)
    g = base.t()  # a transposed view
    ref = g.contiguous().view(-1).double().numpy()
    TopK(0.02, error_feedback=False, **ONE)("w", g)
    nz = np.flatnonzero(g.contiguous().view(-1).numpy())
    assert set(nz.tolist()) == topk_set(ref, 200)


def test_metrics_report_densities_union_and_time():
    hvd_sparse.reset_metrics()
    sp = TopK(0.01, **ONE)
    out = sp("m", torch.randn(10_000))
    sp.observe("m", out * 2)
    r = hvd_sparse.metrics()["m"]
    assert r["sparsifier"] == "TopK" and r["requested_density"] == 0.01
    assert r["achieved_density"] == 0.01 and r["selected"] == 100
    assert r["union"] == 100 and math.isclose(r["union_density"], 0.01)
    assert r["selection_ms"] >= 0.0


# ---- kernels ---------------------------------------------------------------------------------

def test_partition_counts_match_numpy():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1003) * (rng.random(1003) < 0.05)
    x[500] = np.inf
    bounds = np.array([0, 10, 10, 60, 126])
    counts, nnz, bad = _C.partition_counts(torch.from_numpy(x), 8, torch.from_numpy(bounds))
    pad = np.zeros(126 * 8)
    pad[:1003] = x
    nzb = (pad.reshape(-1, 8) != 0).any(1)
    ref = [int(nzb[bounds[i]:bounds[i + 1]].sum()) for i in range(4)]
    assert counts.tolist() == ref and nnz == int((x != 0).sum()) and bad == 1


def test_extract_moves_selected_units_with_ragged_tail():
    src = torch.randn(1003, dtype=torch.float64)
    ref = src.numpy().copy()
    dst = torch.full((1003,), 7.0, dtype=torch.float64)
    idx = torch.tensor([0, 5, 62], dtype=torch.int64)  # unit 62 is the 3-element tail
    _C.extract_(src, dst, idx, 16, True)
    want = np.zeros(1003)
    for u in (0, 5, 62):
        want[u * 16:(u + 1) * 16] = ref[u * 16:(u + 1) * 16]
    np.testing.assert_array_equal(dst.numpy(), want)
    np.testing.assert_array_equal(src.numpy(), np.where(want != 0, 0.0, ref))


@pytest.mark.parametrize("make", SPARSIFIERS)
def test_state_dict_resumes_exactly(make, tmp_path):
    """A checkpoint of the sparsifier after 3 steps (through torch.save/torch.load), loaded
    into a fresh one: the 4th step equals the uninterrupted run's; without it, it differs
    (the residuals not yet sent are lost)."""
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(2, 3000, generator=g) for _ in range(4)]
    run = make()
    for x in grads[:3]:
        run("w", x.clone(), 32)
        run.observe("w", x, 32)
    torch.save(run.state_dict(), tmp_path / "s.pt")
    resumed, fresh = make(), make()
    resumed.load_state_dict(torch.load(tmp_path / "s.pt"))
    want = run("w", grads[3].clone(), 32)
    assert torch.equal(resumed("w", grads[3].clone(), 32), want)
    assert not torch.equal(fresh("w", grads[3].clone(), 32), want)
    with pytest.raises(ValueError, match="state is of a"):
        (TopK(0.1) if not isinstance(run, TopK) else Threshold(0.5)).load_state_dict(
            run.state_dict())


@pytest.mark.parametrize("make", [lambda **kw: TopK(0.01, rank=0, size=4, **kw),
                                  lambda **kw: ExDyna(0.01, rank=1, size=4, **kw),
                                  lambda **kw: DGC(0.01, momentum=0.0, rank=0, size=4, **kw)])
def test_tensors_too_small_go_out_whole(make):
    # Under 16,384 elements (10,000: 100 selected a step), or 1% of 1,000 elements, 10 <
    # min_selected (16), with min_numel=0: every step sends the gradient as it is (the float64
    # reference), and a large tensor beside it is still sparsified.
    gen = torch.Generator().manual_seed(3)
    for sp, n in ((make(), 10_000), (make(min_numel=0), 1000)):
        for _ in range(5):
            g = torch.randn(n, generator=gen)
            torch.testing.assert_close(sp("small", g.clone()).double(), g.double(), rtol=0,
                                       atol=0)
            big = sp("big", torch.randn(20_000, generator=gen))
            assert 0 < int((big != 0).sum()) < 2000
    assert make().too_small(16_383) and not make().too_small(16_384)
    assert make(min_numel=0).too_small(1599) and not make(min_numel=0).too_small(1600)
    assert not make(min_selected=0, min_numel=0).too_small(10)


def test_dgc_on_a_tensor_sent_whole_is_momentum_sgd():
    # The optimizer's momentum moved into DGC; a small tensor sent whole every step must get
    # exactly the momentum buffer torch's SGD would (u = m u + g), not momentum masked away.
    sp, gen, m = DGC(0.01, momentum=0.9, rank=0, size=1), torch.Generator().manual_seed(4), 0.9
    u = torch.zeros(100, dtype=torch.float64)
    for _ in range(6):
        g = torch.randn(100, generator=gen)
        u = m * u + g.double()
        torch.testing.assert_close(sp("bias", g.clone()).double(), u, rtol=1e-6, atol=1e-6)
