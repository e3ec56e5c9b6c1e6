"""Block codec: which blocks of a tensor are non-zero, packing them, scattering them back.

A thin face over the C++ kernels in ``csrc/codec.cpp``; tensors are viewed flat, cut into blocks
of ``block_size`` elements (the tail block is zero-padded). NaN and Inf count as non-zero.
"""
from __future__ import annotations

import hashlib

import torch

from ._C import block_mask as _block_mask
from ._C import fresh_zeros
from ._C import pack as _pack
from ._C import unpack as _unpack
from .protocol import DTYPES

# torch dtype -> the codec's and the wire's dtype code (csrc/blocks.h names them as torch does)
DTYPE_CODES: dict[torch.dtype, int] = {getattr(torch, name): code
                                       for name, (code, _) in DTYPES.items()}


def supported(t: torch.Tensor) -> bool:
    return t.dtype in DTYPE_CODES and t.device.type == "cpu"


def num_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


def block_mask(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """uint8 tensor with one entry per block: 1 where the block has a non-zero element."""
    return _block_mask(t.contiguous(), block_size)


def pack(
    t: torch.Tensor, block_size: int, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-zero blocks of ``t``: (int32 ascending block indices [k], values [k, block_size])."""
    return _pack(t.contiguous(), block_size, mask)


def unpack(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, block_size: int) -> None:
    """Adds ``vals`` into the blocks ``idx`` of ``out`` (viewed flat), in place."""
    _unpack(out, idx, vals, block_size)


def meta_hash(shape: torch.Size, dtype: torch.dtype) -> int:
    """63-bit fingerprint of a tensor's shape and dtype, compared across ranks."""
    digest = hashlib.blake2b(f"{tuple(shape)}|{dtype}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Flat zeros. Large ones are fresh mappings, whose pages are faulted in only where written,
    or freed ones of the same size, re-zeroed (csrc/fresh_zeros.cpp)."""
    return fresh_zeros(numel, dtype)
