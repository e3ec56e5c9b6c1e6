"""Shared by the multi-process workers: start Horovod and hvd_sparse, write a JSON report."""
from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_sparse

TOL = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-12),
       torch.float16: (1e-2, 2e-3), torch.bfloat16: (2e-2, 1e-2)}


def start(**kwargs: object) -> None:
    torch.set_num_threads(1)
    hvd.init()
    hvd_sparse.init(**kwargs)


def barrier(name: str) -> None:
    """Every rank has reached ``name`` (a Horovod collective of that name)."""
    hvd.allreduce(torch.zeros(1), name=f"barrier.{name}")


def close_to(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> str:
    """'' when out (on any device) matches the float64 reference within dtype rounding, else
    why not."""
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


def report(results: dict[str, object]) -> None:
    path = Path(os.environ["HVD_SPARSE_TEST_OUT"]) / f"rank{hvd.rank()}.json"
    path.write_text(json.dumps(results, default=str))


def case(results: dict[str, object], name: str, fn: Callable[[], str]) -> None:
    """Runs one check; records '' for success or the failure text."""
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - the report carries the failure to pytest
        results[name] = traceback.format_exc(limit=4)
