"""The block codec on a tensor's own device, so that a gradient on an accelerator reaches the host
as its packed non-zero blocks only (blocks.py is the same codec for CPU tensors, in C++).

The CUDA kernels of ``hvd_sparse._cuda`` (csrc/cuda/) where they are built;
torch operations elsewhere, for every dtype and device. Same layout and meaning as blocks.py:
int32 ascending indices of the blocks holding a non-zero element (NaN and Inf count, -0 does
not), their values as [k, block_size] with the tail block zero-padded.
"""
from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

import torch

try:  # built only where torch has CUDA and nvcc exists (setup.py)
    from ._cuda import (  # type: ignore[import-not-found]
        mask_scan as _mask_scan,
    )
    from ._cuda import (
        pack as _pack,
    )
    from ._cuda import (
        pack_counted as _pack_counted,
    )
    from ._cuda import (
        select_ge as _select_ge,
    )
    from ._cuda import (
        unpack as _unpack,
    )
    KERNELS_BUILT = True
except ImportError:
    KERNELS_BUILT = False

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# CPU tensors take the path of accelerator tensors (staged through host memory, sparsified with
# torch operations): how the tests run that path on a machine without a GPU.
CPU_AS_DEVICE = os.environ.get("HVD_SPARSE_CPU_AS_DEVICE") == "1"


# Which path each operation took, (op, "kernel" or "torch") -> calls, counted always (a locked
# dict increment per call): the CUDA path falls back to torch operations silently, so this is
# how a test (or a user) knows that the kernels ran.
_paths: Counter[tuple[str, str]] = Counter()
_paths_lock = threading.Lock()


def _took(op: str, kernel: bool) -> bool:
    with _paths_lock:
        _paths[op, "kernel" if kernel else "torch"] += 1
    return kernel


def path_counts() -> dict[tuple[str, str], int]:
    """Calls per (operation, path) since the last ``reset_path_counts``: operation "pack"
    (``pack`` or ``pack_begin``), "unpack" or "select_ge"; path "kernel" (``hvd_sparse._cuda``)
    or "torch"."""
    with _paths_lock:
        return dict(_paths)


def reset_path_counts() -> None:
    with _paths_lock:
        _paths.clear()


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the accelerator path (not the C++ CPU kernels)."""
    return t.device.type != "cpu" or CPU_AS_DEVICE


def kernels(t: torch.Tensor) -> bool:
    """Whether the CUDA kernels of ``hvd_sparse._cuda`` handle ``t``."""
    return KERNELS_BUILT and t.is_cuda and t.dtype in _KERNEL_DTYPES


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
    if _took("pack", kernels(t)):
        return _pack(t.contiguous(), block_size)
    return torch_pack(t, block_size)


def pack_begin(t: torch.Tensor, block_size: int) -> tuple[Any, torch.Tensor]:
    """pack()'s first half, reading nothing back: (state for ``pack_end``, the number of
    non-zero blocks as a one-element int64 tensor on t's device)."""
    if _took("pack", kernels(t)):
        flags, offsets = _mask_scan(t.contiguous(), block_size)
        return (flags, offsets), offsets[-1:]
    mask = _torch_mask(t, block_size)
    return mask, mask.sum().view(1)


def pack_end(t: torch.Tensor, block_size: int, state: Any,
             count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack()'s second half, once ``count`` (of ``pack_begin``) is known on the host."""
    if kernels(t):
        return _pack_counted(t.contiguous(), block_size, *state, count)
    return _torch_select(t, block_size, state)


def torch_pack(t: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack() in torch operations: a mask, ``nonzero`` and ``index_select``."""
    return _torch_select(t, block_size, _torch_mask(t, block_size))


def _torch_mask(t: torch.Tensor, block_size: int) -> torch.Tensor:
    return (torch_blocks(t, block_size) != 0).any(dim=1)


def _torch_select(t: torch.Tensor, block_size: int,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx = mask.nonzero().view(-1)
    return idx.to(torch.int32), torch_blocks(t, block_size).index_select(0, idx)


def unpack(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, block_size: int) -> None:
    """Adds ``vals`` into the blocks ``idx`` of ``out`` (contiguous, viewed flat), in place, on
    its device."""
    if not out.is_contiguous():
        raise ValueError("unpack: the output must be contiguous")
    if _took("unpack", kernels(out)):
        return _unpack(out, idx, vals, block_size)
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


def select_ge(x: torch.Tensor, thr: float) -> torch.Tensor:
    """Ascending int64 indices of the elements of flat ``x`` with |x| >= thr (thr rounded to
    x's dtype; NaN never passes), on its device."""
    if _took("select_ge", kernels(x) and x.dtype in (torch.float32, torch.float64)):
        return _select_ge(x.contiguous(), thr)
    bar = torch.tensor(thr, dtype=x.dtype, device=x.device)
    return (x.reshape(-1).abs() >= bar).nonzero().view(-1)
