"""Process-wide state: ``init`` and ``shutdown``."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import horovod.torch as hvd

from . import config as _config
from . import costmodel, engine, runfile, session
from .comm import Collectives
from .comm import horovod as collectives
from .errors import HvdSparseError
from .job import Context, RowsPlan

log = logging.getLogger("hvd_sparse")


@dataclass
class State:
    config: _config.Config
    net: costmodel.NetModel
    world: tuple[int, int]  # Horovod's (rank, size) at init: what the state was built for
    comm: Collectives  # all ranks of the job (init's collectives)
    omni: session.Session | None = None  # aggregators joined, when any
    switch: session.Session | None = None  # the switch joined, when any
    unnamed: Iterator[int] = field(default_factory=itertools.count)  # unnamed tensors' numbers
    # learnt by "auto", by (name, ranks)
    union_ratio: dict[tuple[str, tuple[int, ...]], float] = field(default_factory=dict)
    rows_plans: dict[str, RowsPlan] = field(default_factory=dict)  # learnt by "auto" (schemes/rows)
    dense_streak: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)  # "auto"

    @property
    def context(self) -> Context:
        """What a reduction's job carries: the state as it is when the reduction starts."""
        return Context(self.config, self.net, self.omni, self.switch, self.union_ratio,
                       self.rows_plans, self.dense_streak)


_state: State | None = None


def init(**kwargs: object) -> None:
    """Starts hvd_sparse after ``hvd.init()``; collective: every rank must call it.

    Called again, it shuts the previous state down first (``shutdown``).

    Args:
        **kwargs: the options, each a field of ``hvd_sparse.config.Config`` (keyword arguments
            win over ``HVD_SPARSE_<NAME>`` environment variables, which win over the defaults;
            None: not given): block_size, scheme, timeout, small_bytes, probe ("auto",
            "force", "off"), cache_dir, log_level, threads; for the omnireduce scheme:
            aggregators ("host:port,..."; when empty the job starts local_aggregators of its
            own, laid out by aggregator_layout: "auto", "colocated" on every host, "rank0"),
            aggregator_host, fallback ("error" or "dense"), payload_bytes, slots, rto,
            fixed_point; for the switch scheme: switch ("ip:port"); metrics_file,
            metrics_records, link_rate (the run file for ``hvd-sparse analyze``).

    Raises:
        HvdSparseError: Horovod is not initialized, or the aggregators or the switch could
            not be started or joined.
        TypeError: an unknown option.
        ValueError: an option's value is out of range.

    Example:
        >>> hvd.init()
        >>> hvd_sparse.init(scheme="auto", timeout=60)
    """
    global _state
    if not hvd.is_initialized():
        raise HvdSparseError("hvd_sparse.init(): call hvd.init() first")
    if _state is not None:
        shutdown()
    cfg = _config.from_env_and_kwargs(**kwargs)
    comm = collectives.of(hvd.global_process_set)
    omni, switch, net = session.join_all(cfg, comm)
    _state = State(cfg, net, (hvd.rank(), hvd.size()), comm, omni, switch)


def state() -> State:
    """The state, valid while Horovod runs with the ranks it was built for. It outlives
    ``hvd.shutdown(); hvd.init()`` on the same ranks (aggregators and the network model do not
    depend on Horovod's session); any other change asks for ``hvd_sparse.init()`` again, rather
    than re-initializing here: init is collective, and a reduction may start on some ranks only."""
    if _state is None:
        raise HvdSparseError(
            "hvd_sparse is not initialized: call hvd_sparse.init() after hvd.init()")
    if not hvd.is_initialized():
        raise HvdSparseError("hvd_sparse: Horovod is shut down: call hvd.init(), then "
                             "hvd_sparse.init() if the ranks changed")
    if (hvd.rank(), hvd.size()) != _state.world:
        raise HvdSparseError(
            f"hvd_sparse: Horovod was re-initialized as rank {hvd.rank()} of {hvd.size()}, "
            f"hvd_sparse for rank {_state.world[0]} of {_state.world[1]}: call "
            "hvd_sparse.init() again on every rank")
    return _state


def is_initialized() -> bool:
    """Whether ``init`` ran and ``shutdown`` has not run since.

    Returns:
        True between ``init`` and ``shutdown``; it does not check that Horovod still runs with
        the same ranks (the next reduction does, and raises if not).
    """
    return _state is not None


def shutdown() -> None:
    """Forgets the state (what ``init`` built and what it learnt since) and leaves the
    aggregators and the switch (the job's own aggregators stop).

    Reductions still in flight fail, with a warning, and their ``synchronize`` raises
    ``HvdSparseError``; this rank writes its run file, if it keeps one (``metrics_file``).
    Safe to call when not initialized.
    """
    global _state
    abandoned = engine.abandon("hvd_sparse was shut down while it was being reduced")
    if abandoned:
        log.warning("hvd_sparse.shutdown(): %d reduction(s) were still in flight", abandoned)
    for joined in (_state.omni, _state.switch) if _state is not None else ():
        if joined is not None:
            joined.close()
    _state = None
    runfile.flush()


@contextmanager
def joined(omni: session.Session | None) -> Iterator[None]:
    """Reductions started inside use the aggregation session ``omni`` instead of the one joined
    at init (benchmarks comparing aggregator sets); every rank must do the same."""
    global _state
    own = state()
    _state = replace(own, omni=omni)
    try:
        yield
    finally:
        _state = own
