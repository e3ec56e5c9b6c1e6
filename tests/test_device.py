"""hvd_sparse.device, the block codec on a tensor's own device, against the CPU codec
(blocks.py), and staging through host memory built on it. Here the torch operations run on the
CPU: no GPU is lent to this project, and the CUDA kernels' per-block logic has its own host
test (test_cuda_host.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from test_cuda_host import ALL_DTYPES, tensors

from hvd_sparse import _C, blocks, device, staging


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


def same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, NaN where NaN, Inf where Inf (nan_to_num would turn both into numbers)."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@settings(max_examples=200, deadline=None)
@given(tensors(ALL_DTYPES))
def test_pack_and_unpack_match_the_cpu_codec(case):
    t, bs = case
    idx, vals = device.pack(t, bs)
    ref_idx, ref_vals = blocks.pack(t, bs)
    assert idx.dtype == torch.int32 and torch.equal(idx, ref_idx)
    assert vals.dtype == t.dtype and torch.equal(bits(vals), bits(ref_vals))  # -0, NaN too
    state, count = device.pack_begin(t, bs)  # the asynchronous form staging uses
    idx2, vals2 = device.pack_end(t, bs, state, int(count))
    assert torch.equal(idx2, ref_idx) and torch.equal(bits(vals2), bits(ref_vals))
    out, ref = torch.ones_like(t), torch.ones_like(t)
    device.unpack(out, idx, vals, bs)
    blocks.unpack(ref, ref_idx, ref_vals, bs)
    same_values(out, ref)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        device.pack(torch.ones(4), 0)
    with pytest.raises(ValueError, match="contiguous"):
        device.unpack(torch.ones(4, 4).t(), torch.zeros(1, dtype=torch.int32),
                      torch.ones(1, 4), 4)


@settings(max_examples=100, deadline=None)
@given(tensors(ALL_DTYPES))
def test_staging_round_trip_keeps_every_value(case):
    """to_host, then to_device: the same values (a -0 comes back +0), written into the given
    output; a staged tensor's host copy holds only what its non-zero blocks held."""
    t, bs = case
    pending = staging.ToHost(t, bs)
    host = pending.wait()
    assert torch.equal(pending.mask(), blocks.block_mask(host, bs))  # what the schemes are given
    cleared = host.clone()  # all-zero blocks are +0 already: the in-place mask pass changes nothing
    _C.block_mask(cleared, bs, True)
    assert torch.equal(bits(cleared), bits(host))
    assert host.dtype == t.dtype and host.shape == (t.numel(),)
    same_values(host, t)  # a -0 in an all-zero block comes back +0: values, not bits
    out = torch.full_like(t, 7.0)
    assert staging.to_device(host, out, bs) is out
    same_values(out, t)


def test_path_counts_say_which_path_ran(monkeypatch):
    """Every pack/unpack/select_ge call counts the path it took: here (no GPU) torch operations
    on a CPU tensor; with the kernels' condition forced and stand-ins for them, the kernel path
    and it alone (what tests/test_gpu.py asserts on a GPU)."""
    t = torch.zeros(1000)
    t[3], t[700] = 1.0, float("nan")
    device.reset_path_counts()
    assert device.path_counts() == {}
    idx, vals = device.pack(t, 256)
    state, count = device.pack_begin(t, 256)
    device.pack_end(t, 256, state, int(count))
    device.unpack(torch.zeros(1000), idx, vals, 256)
    device.select_ge(t, 0.5)
    assert device.path_counts() == {("pack", "torch"): 2, ("unpack", "torch"): 1,
                                    ("select_ge", "torch"): 1}

    calls = []
    fake = {name: (lambda *a, name=name: calls.append(name) or (idx, vals))
            for name in ("_pack", "_mask_scan", "_pack_counted", "_unpack", "_select_ge")}
    fake["_mask_scan"] = lambda *a: calls.append("_mask_scan") or (idx, count)
    for name, f in fake.items():
        monkeypatch.setattr(device, name, f, raising=False)
    monkeypatch.setattr(device, "kernels", lambda x: True)
    device.reset_path_counts()
    device.pack(t, 256)
    state, _ = device.pack_begin(t, 256)
    device.pack_end(t, 256, state, 2)
    device.unpack(torch.zeros(1000), idx, vals, 256)
    device.select_ge(t, 0.5)
    device.select_ge(t.half(), 0.5)  # the kernel takes float32/float64 only: torch for half
    assert calls == ["_pack", "_mask_scan", "_pack_counted", "_unpack", "_select_ge"]
    assert device.path_counts() == {("pack", "kernel"): 2, ("unpack", "kernel"): 1,
                                    ("select_ge", "kernel"): 1, ("select_ge", "torch"): 1}
    device.reset_path_counts()
    assert device.path_counts() == {}
