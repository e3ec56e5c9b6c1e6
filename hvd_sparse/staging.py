"""Gradients on an accelerator, reduced on the host: only their non-zero blocks cross the bus.

The reduction itself (Horovod's CPU operations, the aggregators, the switch) runs on host memory,
so a device tensor is staged: packed on its device (``device.pack``), its packed blocks copied
once to pinned host memory and scattered into fresh host zeros, which any scheme then reduces;
the result goes back the same way (packed on the host, one copy, scattered into zeros on the
device). A dense tensor crosses the bus whole, a 1% sparse one at about 1% of its bytes.

``HVD_SPARSE_STAGE_CPU=1`` stages CPU tensors too: how the tests run this path without a GPU.
"""
from __future__ import annotations

import os

import torch

from . import blocks, device

_STAGE_CPU = os.environ.get("HVD_SPARSE_STAGE_CPU") == "1"


def staged(t: torch.Tensor) -> bool:
    """Whether ``t`` (dense, of a dtype the codec handles) is reduced through host memory."""
    return t.dtype in blocks.DTYPE_CODES and (t.device.type != "cpu" or _STAGE_CPU)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return x
    pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_cuda)
    pinned.copy_(x, non_blocking=True)
    if x.is_cuda:  # this stream's copy, not the whole device
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    return pinned


def to_host(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """A flat host tensor equal to ``t`` (contiguous), built from its non-zero blocks."""
    idx, vals = device.pack(t, block_size)
    host = blocks.zeros(t.numel(), t.dtype)
    blocks.unpack(host, _to_host(idx), _to_host(vals), block_size)
    return host


def to_device(host: torch.Tensor, out: torch.Tensor, block_size: int) -> torch.Tensor:
    """Writes the flat host tensor ``host`` into ``out`` (contiguous, on its device), sending
    only its non-zero blocks; returns ``out``."""
    idx, vals = blocks.pack(host, block_size)
    if out.is_cuda:
        idx, vals = idx.pin_memory(), vals.pin_memory()
    out.zero_()
    device.unpack(out.view(-1), idx.to(out.device, non_blocking=True),
                  vals.to(out.device, non_blocking=True), block_size)
    return out
