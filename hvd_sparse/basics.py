"""Process-wide state: ``init`` and ``shutdown``; under Horovod elastic, the join again after
each reset (``state``) and the error ``hvd.elastic.run`` recovers from
(``HvdSparseInternalError``)."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

from . import config as _config
from . import costmodel, engine, runfile, session
from .comm import Collectives
from .comm import horovod as collectives
from .comm.horovod import elastic
from .errors import HvdSparseError
from .job import Context, RowsPlan

log = logging.getLogger("hvd_sparse")


class HvdSparseInternalError(HvdSparseError, HorovodInternalError):
    """A reduction failed under the Horovod front end: both ``HvdSparseError`` and Horovod's
    ``HorovodInternalError``, the one exception ``hvd.elastic.run`` recovers from (it restores
    the last commit, resets Horovod and runs the training function again; hvd_sparse joins the
    new ranks at the next reduction).

    Raised, with the message naming the tensor and what failed, for a peer that left or timed
    out, an aggregator or the switch that timed out, Horovod shut down under a reduction, or
    any other failure of a reduction in flight; ``except hvd_sparse.HvdSparseError`` catches
    it as before.

    Example:
        >>> try:
        ...     opt.step()
        ... except HorovodInternalError:  # hvd.elastic.run does this for you
        ...     state.restore()
    """


@dataclass
class State:
    config: _config.Config
    net: costmodel.NetModel
    world: tuple[int, int]  # Horovod's (rank, size) at the join: what the state was built for
    comm: Collectives  # all ranks of the job (the join's collectives)
    omni: session.Session | None = None  # aggregators joined, when any
    switch: session.Session | None = None  # the switch joined, when any
    joined: int = 0  # which join of this process it is (sparsifiers see the ranks change)
    unnamed: Iterator[int] = field(default_factory=itertools.count)  # unnamed tensors' numbers
    # learnt by "auto", by (name, ranks)
    union_ratio: dict[tuple[str, tuple[int, ...]], float] = field(default_factory=dict)
    rows_plans: dict[str, RowsPlan] = field(default_factory=dict)  # learnt by "auto" (schemes/rows)
    dense_streak: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)  # "auto"

    @property
    def context(self) -> Context:
        """What a reduction's job carries: the state as it is when the reduction starts."""
        return Context(self.config, self.net, self.omni, self.switch, self.union_ratio,
                       self.rows_plans, self.dense_streak, self.joined)


_options: _config.Config | None = None  # init's options; None: not initialized
_state: State | None = None  # what was joined with them; None under elastic until a reduction
_stale = ""  # under elastic: why the state must be joined again at the next reduction
_joins = itertools.count(1)
# This process's latest memberships of the job ("omni", "switch": session.Membership), kept
# across elastic resets: the next join keeps the job's token at a later epoch, whose packets
# the aggregators and the switch tell from a straggler's of this one. A new init starts afresh.
_memberships: dict[str, session.Membership] = {}


def init(**kwargs: object) -> None:
    """Starts hvd_sparse after ``hvd.init()``; collective: every rank must call it.

    Called again, it shuts the previous state down first (``shutdown``).

    Under Horovod elastic (``horovodrun`` with ``--min-np``/``--host-discovery-script``: a
    worker with HOROVOD_ELASTIC=1), it only checks and records the options: the join (the
    aggregators, the switch, the network model) happens at the first reduction, which every
    rank reaches at the same point, survivors of a reset and workers just started alike; after
    each reset of ``hvd.elastic.run`` hvd_sparse joins the new ranks again there by itself.

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
            not be started or joined (under elastic: at the first reduction instead).
        HvdSparseInternalError: Horovod failed during the join.
        TypeError: an unknown option.
        ValueError: an option's value is out of range.

    Example:
        >>> hvd.init()
        >>> hvd_sparse.init(scheme="auto", timeout=60)
    """
    global _state, _options
    if not hvd.is_initialized():
        raise HvdSparseError("hvd_sparse.init(): call hvd.init() first")
    if _options is not None:
        shutdown()
    cfg = _config.from_env_and_kwargs(**kwargs)
    if elastic():
        _watch_resets()
    else:
        _state = _join(cfg)
    _options = cfg


def _join(cfg: _config.Config) -> State:
    """Joins Horovod's ranks as they are now (collective over all of them)."""
    comm = collectives.of(hvd.global_process_set)
    try:
        omni, switch, net = session.join_all(cfg, comm, _memberships)
    except HorovodInternalError as e:
        raise HvdSparseInternalError(f"hvd_sparse: joining rank {hvd.rank()} of {hvd.size()} "
                                     f"failed: {e}") from e
    return State(cfg, net, (hvd.rank(), hvd.size()), comm, omni, switch, joined=next(_joins))


def state() -> State:
    """The state, valid while Horovod runs with the ranks it was built for.

    Outside elastic it outlives ``hvd.shutdown(); hvd.init()`` on the same ranks (aggregators
    and the network model do not depend on Horovod's session); any other change asks for
    ``hvd_sparse.init()`` again, rather than re-initializing here: the join is collective, and
    a reduction may start on some ranks only. Under Horovod elastic, where every rank resets
    together, it joins here (collective: the first reduction after ``init`` or a reset, on every
    rank) when there is no state yet, when Horovod runs with other ranks than the state was
    built for, after one of its reductions failed (``failure``), or after Horovod was reset
    (``hvd.elastic.run``); the reductions still in flight from before are abandoned."""
    global _state
    if _options is None:
        raise HvdSparseError(
            "hvd_sparse is not initialized: call hvd_sparse.init() after hvd.init()")
    if not hvd.is_initialized():
        raise failure("hvd_sparse: Horovod is shut down: call hvd.init(), then "
                      "hvd_sparse.init() if the ranks changed")
    world = (hvd.rank(), hvd.size())
    if elastic():
        why = _stale or (_state is not None and world != _state.world and
                         f"Horovod runs as rank {world[0]} of {world[1]}, hvd_sparse was "
                         f"joined as rank {_state.world[0]} of {_state.world[1]}")
        if why:
            log.info("hvd_sparse: joining the ranks again: %s", why)
            if abandoned := _leave(f"hvd_sparse joins the ranks again ({why})"):
                log.info("hvd_sparse: %d reduction(s) in flight abandoned", abandoned)
        if _state is None:
            _state = _join(_options)
            log.info("hvd_sparse: joined as rank %d of %d (join %d of this process)", *world,
                     _state.joined)
        return _state
    assert _state is not None
    if world != _state.world:
        raise HvdSparseError(
            f"hvd_sparse: Horovod was re-initialized as rank {hvd.rank()} of {hvd.size()}, "
            f"hvd_sparse for rank {_state.world[0]} of {_state.world[1]}: call "
            "hvd_sparse.init() again on every rank")
    return _state


def failure(error: BaseException | str, joined: int | None = None) -> HvdSparseInternalError:
    """The exception to raise for a reduction that failed under the Horovod front end, with
    ``error``'s message; under elastic the state is marked stale (when the reduction was of
    this state: ``joined``, its ``State.joined``; None: it was), so the next reduction (after
    ``hvd.elastic.run``'s reset) joins the ranks again."""
    global _stale
    if (elastic() and _state is not None and not _stale
            and joined in (None, _state.joined)):
        _stale = f"a reduction failed: {error}"
    if isinstance(error, HvdSparseInternalError):
        return error
    return HvdSparseInternalError(str(error))


def _leave(why: str) -> int:
    """Abandons the reductions in flight with ``why`` and leaves what the state joined (the
    job's own aggregators stop); the options stay, for the next join. Returns how many
    reductions were abandoned."""
    global _state, _stale
    abandoned = engine.abandon(why)
    for joined in (_state.omni, _state.switch) if _state is not None else ():
        if joined is not None:
            joined.close()
    _state, _stale = None, ""
    return abandoned


def _watch_resets() -> None:
    """Marks the state stale at each reset of ``hvd.elastic.run`` (Horovod shut down and
    started again, perhaps on the same number of ranks but with others among them): Horovod
    calls ``on_reset`` of the elastic state after every reset, before the training function
    runs again. Horovod has no other sign of it (a session number, a callback for all states),
    so the base class's ``on_reset`` is wrapped, once."""
    from horovod.common import elastic as hvd_elastic

    base = hvd_elastic.State.on_reset
    if getattr(base, "_hvd_sparse", False):
        return

    def on_reset(self: hvd_elastic.State) -> None:
        global _stale
        if _state is not None and not _stale:
            _stale = "Horovod was reset"
        base(self)

    on_reset._hvd_sparse = True  # type: ignore[attr-defined]
    on_reset.__doc__ = base.__doc__
    hvd_elastic.State.on_reset = on_reset  # type: ignore[method-assign]


def is_initialized() -> bool:
    """Whether ``init`` ran and ``shutdown`` has not run since.

    Returns:
        True between ``init`` and ``shutdown``; it does not check that Horovod still runs with
        the same ranks (the next reduction does, and raises if not, or, under Horovod elastic,
        joins them).
    """
    return _options is not None


def shutdown() -> None:
    """Forgets the state (what ``init`` built and what it learnt since) and leaves the
    aggregators and the switch (the job's own aggregators stop).

    Reductions still in flight fail, with a warning, and their ``synchronize`` raises
    ``HvdSparseError``; this rank writes its run file, if it keeps one (``metrics_file``).
    Safe to call when not initialized.
    """
    global _options
    if abandoned := _leave("hvd_sparse was shut down while it was being reduced"):
        log.warning("hvd_sparse.shutdown(): %d reduction(s) were still in flight", abandoned)
    _options = None
    _memberships.clear()
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
