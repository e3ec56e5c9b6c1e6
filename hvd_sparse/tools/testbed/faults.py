"""Timed faults on a running testbed, injected from a thread while a job trains on it.

    inj = Injector("hvdsp", [Fault("link_down", at=10, duration=3, host="w1"),
                             Fault("agg_stop", at=30, duration=10, host="a0")])
    inj.start(); ...; inj.stop(); inj.join()

Link faults go through ``lifecycle.update`` (the same as ``hvd-sparse testbed set``): a cut
link, loss, duplication, reordering on one host's link for ``duration`` seconds, then cleared.
Aggregator faults act on an aggregator host's process: killed and started again (same address,
same secret) after ``duration``, or stopped (SIGSTOP) for ``duration`` and continued. A worker
lost (a Horovod elastic job, ``launch.run_elastic``): every process of a worker host other
than w0 killed (SIGKILL: the worker and the shell that ran it) and the host taken off the job's
discovery list for ``duration``, then listed again (the job goes on with the ranks left, then
grows back). Every
fault is reverted when it ends, when the injector is stopped, and when applying it failed
half-way; what was done, and when (``time.time()``, comparable with the ranks' clocks on one
machine), is in ``done``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from . import launch, lifecycle, links
from .topology import Testbed

LINK = ("link_down", "loss", "dup", "reorder")
AGGREGATOR = ("agg_kill", "agg_stop")
ELASTIC = ("worker_lost",)  # a Horovod elastic job's worker (launch.run_elastic)
KINDS = LINK + AGGREGATOR + ELASTIC


@dataclass
class Fault:
    """One fault: ``kind`` (``KINDS``) on ``host`` from ``at`` seconds after the injector's
    start for ``duration`` seconds; ``rate``: the share for loss, dup and reorder. ``start``
    and ``end`` (``time.time()``) are filled in when it is applied and reverted, ``error``
    when either failed."""

    kind: str
    at: float
    duration: float
    host: str
    rate: float = 0.0
    start: float = math.nan
    end: float = math.nan
    error: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in AGGREGATOR and not self.host.startswith("a"):
            raise ValueError(f"{self.kind}: an aggregator host (a0, ...), got {self.host!r}")
        if self.kind in ELASTIC and (not self.host.startswith("w") or self.host == "w0"):
            raise ValueError(f"{self.kind}: a worker host other than w0 (which runs "
                             f"horovodrun), got {self.host!r}")
        if self.kind in ("loss", "dup", "reorder") and not 0 < self.rate < 1:
            raise ValueError(f"{self.kind}: rate must be in (0, 1), got {self.rate}")

    def label(self) -> str:
        """"loss 20% w1 5 s", "agg_stop a0 10 s"."""
        share = f" {self.rate:.0%}" if self.kind in ("loss", "dup", "reorder") else ""
        return f"{self.kind}{share} {self.host} {self.duration:g} s"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def apply(tb: Testbed, f: Fault) -> None:
    """Puts fault ``f`` in force on ``tb`` (saved in its state)."""
    if f.kind == "link_down":
        lifecycle.update(tb, host=f.host, link_up=False)
    elif f.kind == "loss":
        lifecycle.update(tb, host=f.host, loss_rate=f.rate)
    elif f.kind == "dup":
        lifecycle.update(tb, host=f.host, dup=f.rate)
    elif f.kind == "reorder":
        lifecycle.update(tb, host=f.host, reorder=f.rate)
    elif f.kind == "agg_kill":
        os.kill(tb.pids[f.host], signal.SIGKILL)
    elif f.kind == "agg_stop":
        os.kill(tb.pids[f.host], signal.SIGSTOP)
    elif f.kind == "worker_lost":
        # off the list first: Horovod's driver must not start its worker there again
        launch.list_hosts(tb, [h for h in launch.listed_hosts(tb) if h != f.host])
        lost = links.pids_in(tb.host(f.host).ns)
        if not lost:
            raise RuntimeError(f"no process runs on {f.host}")
        for pid in lost:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def revert(tb: Testbed, f: Fault) -> None:
    """Ends fault ``f``: the link as it was before (up, no loss, duplication or reordering),
    the aggregator running again."""
    if f.kind == "link_down":
        lifecycle.update(tb, host=f.host, link_up=True)
    elif f.kind == "loss":
        lifecycle.update(tb, host=f.host, loss_rate=0.0)
    elif f.kind == "dup":
        lifecycle.update(tb, host=f.host, dup=0.0)
    elif f.kind == "reorder":
        lifecycle.update(tb, host=f.host, reorder=0.0)
    elif f.kind == "agg_kill":
        try:  # reaped by its launcher's Popen, or gone
            os.waitpid(tb.pids[f.host], os.WNOHANG)
        except ChildProcessError:
            pass
        launch.start_aggregator(tb, f.host)
        tb.save()
    elif f.kind == "agg_stop":
        os.kill(tb.pids[f.host], signal.SIGCONT)
    elif f.kind == "worker_lost":
        listed = launch.listed_hosts(tb)
        if f.host not in listed:
            launch.list_hosts(tb, [h.name for h in tb.worker_hosts
                                   if h.name in listed or h.name == f.host])


class Injector(threading.Thread):
    """Applies ``schedule`` to testbed ``name``, one fault after another at their ``at``
    offsets from ``start()`` (a fault due while another is in force waits for it to end).

    Attributes:
        done: the faults applied, with their start and end times.
        errors: what failed ("" none), each naming the fault.
        current: the kind of the fault in force ("" none).
    """

    def __init__(self, name: str, schedule: Sequence[Fault]) -> None:
        super().__init__(name=f"faults.{name}", daemon=True)
        self.tb = Testbed.load(name)
        self.schedule = sorted(schedule, key=lambda f: f.at)
        self.done: list[Fault] = []
        self.errors: list[str] = []
        self.current = ""
        self._halt = threading.Event()

    def stop(self) -> None:
        """Ends the schedule early; the fault in force is reverted at once."""
        self._halt.set()

    def run(self) -> None:
        t0 = time.monotonic()
        for f in self.schedule:
            if self._halt.wait(max(0.0, t0 + f.at - time.monotonic())):
                return
            self.current = f.kind
            try:
                f.start = time.time()
                apply(self.tb, f)
                self._halt.wait(f.duration)
            except Exception as e:  # noqa: BLE001 - said in the report, reverted below
                f.error = f"apply: {e}"
            finally:
                try:
                    revert(self.tb, f)
                except Exception as e:  # noqa: BLE001 - said in the report
                    f.error += f" revert: {e}"
                f.end = time.time()
                self.current = ""
                self.done.append(f)
                if f.error:
                    self.errors.append(f"{f.label()}: {f.error.strip()}")
