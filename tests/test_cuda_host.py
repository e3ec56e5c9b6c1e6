"""The CUDA kernels' per-block logic (csrc/cuda/block_ops.h), compiled for the host, against the
CPU codec and numpy. No GPU is lent to this project: this is how that logic is tested."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sparse import _C, blocks


@st.composite
def tensors(draw, dtypes=(torch.float32, torch.float64)):
    """(flat tensor, block size): random blocks of N(0, 1) with NaN, Inf, -0, denormals."""
    numel = draw(st.integers(0, 2000))
    bs = draw(st.sampled_from([1, 3, 16, 256]))
    dtype = draw(st.sampled_from(dtypes))
    density = draw(st.sampled_from([0.0, 0.01, 0.2, 1.0]))
    g = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    x = g.standard_normal(numel) * (g.random(numel) < density)
    for v in draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf, -0.0, 1e-45]), max_size=3)):
        if numel:
            x[g.integers(numel)] = v
    return torch.from_numpy(x).to(dtype), bs


ALL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@settings(max_examples=200, deadline=None)
@given(tensors(ALL_DTYPES))
def test_bitmap_pack_unpack_match_the_cpu_codec(case):
    """float16/bfloat16 as their bits; unpack adds them in float, rounded once (c10::Half's +=)."""
    t, bs = case
    assert torch.equal(_C.cuda_host_block_mask(t, bs), blocks.block_mask(t, bs))
    idx, vals = _C.cuda_host_pack(t, bs)
    ref_idx, ref_vals = blocks.pack(t, bs)
    assert torch.equal(idx, ref_idx)
    assert torch.allclose(vals, ref_vals, rtol=0, atol=0, equal_nan=True)
    out, ref = torch.ones_like(t), torch.ones_like(t)
    _C.cuda_host_unpack(out, idx, vals, bs)
    blocks.unpack(ref, ref_idx, ref_vals, bs)
    assert torch.allclose(out, ref, rtol=0, atol=0, equal_nan=True)


@settings(max_examples=100, deadline=None)
@given(tensors(), st.sampled_from([0.0, 1e-30, 0.5, 2.0]))
def test_threshold_selection_matches_numpy(case, thr):
    t, _ = case
    x = t.double().numpy()
    with np.errstate(invalid="ignore"):
        ref = np.flatnonzero(np.abs(x) >= np.float64(t.new_tensor(thr).item()))
    np.testing.assert_array_equal(_C.cuda_host_select_ge(t, thr).numpy(), ref)
    np.testing.assert_array_equal(_C.select_abs_ge(t, thr).numpy(), ref)  # the CPU kernel too
