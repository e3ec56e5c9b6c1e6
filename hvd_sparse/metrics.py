"""Per-tensor record of what each reduction did: scheme, bytes, density, time."""
from __future__ import annotations

import copy
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at run time: tools read metrics without torch
    from .job import Stats

_lock = threading.Lock()
_records: dict[str, dict[str, Any]] = {}


def record(name: str, seconds: float, stats: Stats) -> None:
    """A finished reduction: its stats replace the previous call's (a sparsifier's fields stay)."""
    reported = stats.reported()
    with _lock:
        r = _records.setdefault(name, {"calls": 0})
        for key in type(stats).__dataclass_fields__:
            r.pop(key, None)
        r["calls"] += 1
        r.update(reported, seconds=seconds)


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
    of a GPU tensor, reduced through host memory; ``reason`` says why a tensor went another way
    than its scheme ("small", "non-finite", "switch: ..."). The other fields of
    ``hvd_sparse.job.Stats`` appear where the scheme knows them: ``nnz_local``, ``nnz`` (every
    rank's non-zero blocks), ``union``, ``predicted_ms`` (auto), ``retransmits`` and
    ``rounds`` (aggregation), ``rows_local`` (sparse rows).

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
