"""Per-tensor record of what each reduction did: scheme, bytes, density, time."""
from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any, Protocol


class Reported(Protocol):
    """What ``record`` takes: a dataclass of one reduction's stats (``hvd_sparse.job.Stats``;
    named by this protocol, not imported: job imports the sparsifiers, which record here)."""

    def reported(self) -> dict[str, Any]:
        """The fields to show, by name."""
        ...


_lock = threading.Lock()
_records: dict[str, dict[str, Any]] = {}


def record(name: str, seconds: float, stats: Reported) -> None:
    """A finished reduction: its stats replace the previous call's (a sparsifier's fields stay)."""
    reported = stats.reported()
    with _lock:
        r = _records.setdefault(name, {"calls": 0})
        for field in dataclasses.fields(stats):
            r.pop(field.name, None)
        r["calls"] += 1
        r.update(reported, seconds=seconds)


def record_sparsify(name: str, **fields: Any) -> None:
    """A sparsifier's view of the tensor's last step (see hvd_sparse.sparsifiers.base)."""
    with _lock:
        _records.setdefault(name, {"calls": 0}).update(fields)


def metrics() -> dict[str, dict[str, Any]]:
    """What each tensor's last reduction on this rank did, by tensor name.

    Each record holds ``calls`` (all of them) and, of the last call:

    - ``scheme``: what ran (for "auto", what it chose); ``seconds``: its wall time;
    - ``bytes_sent``: what this rank put on the wire, modelling Horovod's ring collectives;
      ``bytes_received``: what it received (the other ranks' segments; dense: the ring model);
    - ``block_density``: the mean fraction of non-zero blocks over ranks (absent for dense,
      which never looks);
    - ``staged``: the device of a GPU tensor, reduced through host memory;
    - ``reason``: why a tensor went another way than its scheme ("small", "non-finite",
      "switch: ...");
    - where the scheme knows them, the other fields of ``hvd_sparse.job.Stats``: ``nnz_local``,
      ``nnz`` (every rank's non-zero blocks), ``union``, ``predicted_ms`` (auto),
      ``retransmits`` and ``rounds`` (aggregation), ``rows_local`` (sparse rows);
    - ``stages_ms``: where the time went, by stage: ``"host <stage>"`` the scheme's own work
      before it started ``<stage>`` (``"host end"``: after the last), ``"<stage>"`` the wait
      for that stage's collective or aggregation;
    - with a sparsifier: ``sparsifier``, ``requested_density``, ``achieved_density`` (this
      rank's selected elements / numel), ``selected``, ``selection_ms``, ``nonfinite``
      (elements that made the step go out dense), and after the reduction ``union`` (non-zero
      elements of the reduced gradient, i.e. the union of all ranks' selections) and
      ``union_density``.

    Returns:
        A copy of the records, tensor name -> field -> value.

    Example:
        >>> out = hvd_sparse.allreduce(grad, name="emb.weight")
        >>> m = hvd_sparse.metrics()["emb.weight"]
        >>> m["scheme"], m["bytes_sent"], m["seconds"]
    """
    with _lock:
        return copy.deepcopy(_records)


def reset_metrics() -> None:
    """Forgets every tensor's record (``metrics()`` is then empty), e.g. after warm-up steps."""
    with _lock:
        _records.clear()
