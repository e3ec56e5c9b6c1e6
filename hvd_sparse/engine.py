"""The progress engine: asynchronous reductions built from collectives between ranks
(hvd_sparse.comm) and the aggregators' worker engine.

A scheme is a generator that yields (stage name, pending) pairs and returns the reduced tensor;
pending is a ``comm.Pending`` (a collective in flight, or a submission to aggregators). The
engine drives every in-flight generator: whenever a caller waits on any handle, all handles
whose current operation has finished move to their next stage. That is what lets ranks submit
and wait on tensors in different orders without deadlock (over Horovod, which matches
operations by name): a rank blocked on tensor A still submits the next stage of tensor B that
its peers are waiting for. Every wait is bounded by the configured timeout.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import torch

from .comm import Pending
from .errors import HvdSparseError
from .job import Job

Stage = Generator[tuple[str, Pending], Any, torch.Tensor]


class Handle:
    """What ``allreduce_async`` returns; pass it to ``synchronize`` or ``poll``."""

    __slots__ = ("job", "_gen", "pending", "stage", "result", "error", "started", "stage_started",
                 "_on_done")

    def __init__(self, job: Job, gen: Stage, on_done: Callable[[Handle], None]) -> None:
        self.job = job
        self._gen = gen
        self.pending: Pending | None = None
        self.stage = "start"
        self.result: torch.Tensor | None = None
        self.error: HvdSparseError | None = None
        self.started = self.stage_started = time.monotonic()
        self._on_done = on_done

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def _step(self, value: Any) -> None:
        now = time.monotonic()
        times = self.job.stats.stages_ms  # where the time goes, by stage (Stats.stages_ms)
        if self.pending is not None:
            times[self.stage] = times.get(self.stage, 0.0) + (now - self.stage_started) * 1e3
        host = "host end"
        try:
            self.stage, self.pending = self._gen.send(value)
            host = "host " + self.stage
        except StopIteration as stop:
            self.pending, self.result = None, stop.value
        except HvdSparseError as e:
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - any failure must surface as the tensor's error
            self._fail(HvdSparseError(f"hvd_sparse: tensor {self.job.name!r}: {e}"))
            _lost(self, e)
        self.stage_started = time.monotonic()
        times[host] = times.get(host, 0.0) + (self.stage_started - now) * 1e3
        if self.result is not None:
            self._on_done(self)

    def _fail(self, e: HvdSparseError) -> None:
        self.pending, self.error = None, e
        self._gen.close()


_lock = threading.RLock()
_inflight: dict[str, Handle] = {}


def submit(job: Job, gen: Stage, on_done: Callable[[Handle], None]) -> Handle:
    with _lock:
        if job.name in _inflight:
            raise HvdSparseError(
                f"hvd_sparse: tensor {job.name!r} is already being reduced; "
                "synchronize it before submitting it again")
        h = Handle(job, gen, on_done)
        _inflight[job.name] = h
        h._step(None)
        # Every submission (each gradient's hook) also moves the others on: a stage that
        # finished during the backward pass (a staged tensor reaching the host, a collective)
        # starts the next one now rather than at synchronize.
        progress()
        return h


def _reap(h: Handle) -> None:
    if h.done and _inflight.get(h.job.name) is h:
        del _inflight[h.job.name]


def progress() -> None:
    """Moves every in-flight reduction whose current operation has finished to its next stage."""
    with _lock:
        for h in list(_inflight.values()):
            while h.pending is not None:
                try:
                    if not h.pending.poll():
                        break
                    value = h.pending.value()
                except Exception as e:  # noqa: BLE001 - collectives report peer errors this way
                    h._fail(HvdSparseError(f"hvd_sparse: tensor {h.job.name!r}: {e}"))
                    _lost(h, e)
                    break
                h._step(value)
            _reap(h)


def _lost(h: Handle, e: BaseException) -> None:
    """``h``'s collectives failed with ``e``; where that says none of them can complete any
    more (``Collectives.lost``: Horovod shut down), every other reduction in flight fails with
    it now, rather than one waiting out its timeout at the aggregators for a peer that left."""
    lost = getattr(h.job.comm, "lost", None)
    if lost is not None and lost(e):
        abandon(str(e))


def poll(h: Handle) -> bool:
    progress()
    return h.done


def synchronize(h: Handle, timeout: float) -> torch.Tensor:
    """Waits for ``h``, driving all in-flight reductions; raises HvdSparseError when one stage
    (one collective, or one aggregation) takes longer than ``timeout``."""
    pause = 2e-5
    while True:
        progress()
        if h.done:
            break
        if time.monotonic() > h.stage_started + timeout:
            with _lock:
                if _inflight.get(h.job.name) is h:
                    del _inflight[h.job.name]
            h._fail(HvdSparseError(
                f"hvd_sparse: tensor {h.job.name!r}: timed out after {timeout:g} s in stage "
                f"'{h.stage}' ({h.job.scheme}); a peer rank did not submit this tensor or is dead"))
            break
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    if h.error is not None:
        raise h.error
    assert h.result is not None
    return h.result


def inflight() -> int:
    with _lock:
        return len(_inflight)


def abandon(why: str) -> int:
    """Fails every reduction in flight with ``why`` (at shutdown); returns how many. A scheme's
    clean-up (its ``finally``) runs now, before what it used goes away."""
    with _lock:
        handles = [h for h in _inflight.values() if not h.done]  # (the done: their outcome)
        _inflight.clear()
        for h in handles:
            h._fail(HvdSparseError(f"hvd_sparse: tensor {h.job.name!r}: {why}"))
    return len(handles)
