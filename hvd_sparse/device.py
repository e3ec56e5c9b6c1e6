"""The block codec on a tensor's own device, so that a gradient on an accelerator reaches the host
as its packed non-zero blocks only (blocks.py is the same codec for CPU tensors, in C++).

The CUDA kernels of ``hvd_sparse._cuda`` (csrc/cuda/, float32 and float64) where they are built;
torch operations elsewhere, for every dtype and device. Same layout and meaning as blocks.py:
int32 ascending indices of the blocks holding a non-zero element (NaN and Inf count, -0 does
not), their values as [k, block_size] with the tail block zero-padded.
"""
from __future__ import annotations

import torch

try:
    from . import _cuda  # type: ignore[attr-defined]
except ImportError:  # built only where torch has CUDA and nvcc exists (setup.py)
    _cuda = None

_KERNEL_DTYPES = (torch.float32, torch.float64)


def _kernels(t: torch.Tensor) -> bool:
    return _cuda is not None and t.is_cuda and t.dtype in _KERNEL_DTYPES


def torch_blocks(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """``t`` as [nblocks, block_size]; the tail block zero-padded (a copy only then)."""
    flat = t.reshape(-1)
    pad = -flat.numel() % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def pack(t: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-zero blocks of ``t``, on its device: (int32 ascending block indices [k], values
    [k, block_size])."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if _kernels(t):
        return _cuda.pack(t.contiguous(), block_size)
    return torch_pack(t, block_size)


def torch_pack(t: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack() in torch operations: a mask, ``nonzero`` and ``index_select``."""
    blocks = torch_blocks(t, block_size)
    idx = (blocks != 0).any(dim=1).nonzero().reshape(-1)
    return idx.to(torch.int32), blocks.index_select(0, idx)


def unpack(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, block_size: int) -> None:
    """Adds ``vals`` into the blocks ``idx`` of ``out`` (contiguous, viewed flat), in place, on
    its device."""
    if not out.is_contiguous():
        raise ValueError("unpack: the output must be contiguous")
    if _kernels(out):
        return _cuda.unpack(out, idx, vals, block_size)
    torch_unpack(out, idx, vals, block_size)


def torch_unpack(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor,
                 block_size: int) -> None:
    """unpack() in torch operations: ``index_add_`` on the whole blocks, then the tail."""
    flat, idx = out.view(-1), idx.long()
    whole = flat.numel() // block_size  # blocks without the short tail block
    full = idx < whole
    if whole:
        flat[: whole * block_size].view(whole, block_size).index_add_(0, idx[full], vals[full])
    tail = flat.numel() - whole * block_size
    if tail and not bool(full.all()):
        flat[whole * block_size:] += vals[~full][0, :tail]
