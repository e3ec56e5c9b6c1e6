"""Shared by the parallel test modules on every rank: start Horovod and hvd_sparse, compare
with a float64 reference, agree across ranks."""
from __future__ import annotations

import hashlib
import os
import sys

import horovod.torch as hvd
import torch

import hvd_sparse
from hvd_sparse import device as codec

TOL = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-12),
       torch.float16: (1e-2, 2e-3), torch.bfloat16: (2e-2, 1e-2)}
DEVICE = os.environ.get("HVD_SPARSE_TEST_DEVICE", "cpu")


def start(**kwargs: object) -> None:
    torch.set_num_threads(1)
    hvd.init()
    hvd_sparse.init(**kwargs)


def barrier(name: str) -> None:
    """Every rank has reached ``name`` (a Horovod collective of that name)."""
    hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")


def close_to(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
             device: str | None = None) -> str:
    """'' when out (on ``device``'s type where given, else any) matches the float64 reference
    within dtype rounding, NaN where it has NaN, else why not."""
    if device is not None and out.device.type != device:
        return f"on {out.device}, not on {device}"
    out = out.cpu()
    if out.dtype != dtype:
        return f"dtype {out.dtype} != {dtype}"
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    if not torch.allclose(out.double(), ref, rtol=rtol, atol=atol * scale, equal_nan=True):
        err = (out.double() - ref).abs().nan_to_num(0).max().item()
        return f"max abs error {err:g} (scale {scale:g})"
    return ""


def codec_paths() -> str:
    """'' when every tensor this process packed and unpacked on a device took the path of this
    launch (the CUDA kernels for CUDA tensors; torch operations for CPU tensors posing as a
    device's; none for plain CPU tensors, which the C++ codec takes), else the counts: device.py
    falls back to torch operations silently where the kernels are missing."""
    counts = {k: v for k, v in codec.path_counts().items() if k[0] in ("pack", "unpack")}
    if DEVICE == "cuda":
        want = "kernel"
        if not codec.KERNELS_BUILT:
            return "hvd_sparse._cuda is not built: the codec ran on torch operations"
    elif codec.CPU_AS_DEVICE:
        want = "torch"
    else:
        return "" if not counts else f"CPU tensors went through the device codec: {counts}"
    ran = {op for (op, path), n in counts.items() if path == want and n > 0}
    other = {k: v for k, v in counts.items() if k[1] != want}
    return "" if ran == {"pack", "unpack"} and not other else f"not only {want}: {counts}"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).cpu().numpy()
                        .tobytes()).hexdigest()


def differing_ranks(value: object, name: str) -> list[int]:
    """Ranks whose ``value`` differs from rank 0's (a collective: call it on every rank)."""
    every = hvd.allgather_object(value, name=f"same.{name}")
    return [r for r, v in enumerate(every) if v != every[0]]


def leave() -> None:
    """Ends this rank's process here (a test marked ``ends(rank=...)``): a dead peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
