"""Reduction schemes, one module each, one interface: ``run(job) -> Stage`` (see engine.py).

``run`` is the one dispatcher: it sends small tensors dense (decided here, once), lets "auto"
choose among the table's schemes, and runs the one chosen.
"""
from __future__ import annotations

from collections.abc import Callable

from ..config import SCHEMES
from ..engine import Stage
from ..job import Job
from . import allgather, auto, dense, omnireduce, rows, switch, zen

# What runs each scheme; "auto" chooses among them; "rows" takes sparse COO tensors (chosen by
# allreduce_async, never by the user).
RUN: dict[str, Callable[[Job], Stage]] = {
    "dense": dense.run, "allgather": allgather.run, "zen": zen.run,
    "omnireduce": omnireduce.run, "switch": switch.run, "rows": rows.run}
assert set(RUN) - {"rows"} == set(SCHEMES) - {"auto"}
# A round of aggregation, or auto's own decision, costs more than a small tensor's dense
# allreduce (config.small_bytes).
SMALL_GO_DENSE = ("auto", "omnireduce", "switch")


def check(scheme: str | None) -> None:
    """ValueError for a scheme the user may not ask for. (A scheme that cannot serve a tensor,
    omnireduce or the switch on a process set, say, falls back alike on every rank of its set,
    with the reason in metrics(): an error there would stop only the set's ranks.)"""
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def run(job: Job) -> Stage:
    if job.scheme in SMALL_GO_DENSE and job.small:
        job.stats.reason = "small"
        return (yield from dense.run(job))
    if job.scheme != "auto":
        return (yield from RUN[job.scheme](job))
    choice = yield from auto.choose(job)
    nnz = job.stats.nnz or []
    out = yield from RUN[choice](job)
    auto.learn(job, choice, nnz)
    return out
