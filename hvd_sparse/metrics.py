"""Per-tensor record of what each reduction did: scheme, bytes, density, time."""
from __future__ import annotations

import copy
import threading
from typing import Any

_lock = threading.Lock()
_records: dict[str, dict[str, Any]] = {}


def record(name: str, scheme: str, seconds: float, stats: dict[str, Any]) -> None:
    with _lock:
        r = _records.setdefault(name, {"calls": 0})
        r["calls"] += 1
        r.update(scheme=stats.get("scheme", scheme), seconds=seconds,
                 bytes_sent=stats.get("bytes_sent", 0))
        for key in ("bytes_received", "block_density", "union", "predicted_ms", "reason",
                    "staged"):
            if key in stats:
                r[key] = stats[key]
            elif key in ("reason", "staged"):  # this call went where its scheme meant, from host
                r.pop(key, None)


def record_sparsify(name: str, **fields: Any) -> None:
    """A sparsifier's view of the tensor's last step (see hvd_sparse.sparsifiers.base)."""
    with _lock:
        _records.setdefault(name, {"calls": 0}).update(fields)


def metrics() -> dict[str, dict[str, Any]]:
    """name -> {scheme, calls, bytes_sent, block_density, seconds, ...} of each tensor's last call.

    ``scheme`` is what ran (for "auto", what it chose); ``bytes_sent`` is what this rank put on
    the wire, modelling Horovod's ring collectives, ``bytes_received`` what it received (the
    other ranks' segments; dense: the ring model); ``block_density`` is the mean fraction of
    non-zero blocks over ranks (absent for dense, which never looks); ``staged`` is the device
    of a GPU tensor, reduced through host memory.

    With a sparsifier, also: ``sparsifier``, ``requested_density``, ``achieved_density`` (this
    rank's selected elements / numel), ``selected``, ``selection_ms``, ``nonfinite`` (elements
    that made the step go out dense), and after the reduction ``union`` (non-zero elements of
    the reduced gradient, i.e. the union of all ranks' selections) and ``union_density``.
    """
    with _lock:
        return copy.deepcopy(_records)


def reset_metrics() -> None:
    with _lock:
        _records.clear()
