"""Reduction schemes, one module each, one interface: ``run(job) -> Stage`` (see engine.py)."""
from __future__ import annotations

from ..engine import Job, Stage
from . import allgather, auto, dense, omnireduce, rows, switch, zen

# "rows" takes sparse COO tensors (chosen by allreduce_async, not by the user's scheme).
SCHEMES = {"dense": dense.run, "allgather": allgather.run, "zen": zen.run,
           "omnireduce": omnireduce.run, "switch": switch.run, "auto": auto.run,
           "rows": rows.run}


def run(job: Job) -> Stage:
    return SCHEMES[job.scheme](job)
