"""The DDP front end: hvd_sparse's schemes, aggregators and switch behind PyTorch DDP's
communication hook.

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(hvd_sparse.ddp.State(scheme="auto"), hvd_sparse.ddp.hook)

A dense bucket (DDP's flat buffer of several gradients) is reduced as one tensor by the
configured scheme ("auto": the cost model's choice among the schemes and dense); a sparse one
(``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``) from its rows. DDP gives every sparse
parameter a bucket of its own, and a table with few distinct rows costs an exchange more than
its bytes: so the sparse buckets whose results were small last time are held until the last of
the sparse buckets that come one after another, and reduced together (their rows one after
another, ``rows.fuse``) by one exchange; the others go at once. The result is the average over
the ranks of the state's process group, as DDP expects of a hook. With a ``sparsifier`` each
parameter's gradient in a dense bucket is sparsified first (error feedback per parameter, named
by ``named_parameters``). Reductions go to the state's streams in turn, each a thread and a Gloo
group of its own, one reduction after another on each: torch.distributed matches operations by
the order they are issued in on a group, and DDP hands buckets to the hook in the same order on
every rank, so every rank issues the same operations in the same order on each group, while
backward goes on. A dense bucket known to go dense before it is reduced (scheme "dense", a
small bucket, or one "auto" keeps sending dense) is reduced as DDP's default hook reduces it,
by the model's own process group, where that beats Gloo through host memory: the group is not
Gloo (NCCL), or the bucket is on a device. A device's sparse bucket is reduced by its rows
where they are, by the model's group's allgather and a sum on the device (with "omnireduce",
through host memory to the aggregators). Horovod is not needed.

A bucket is known by its parameters, not by ``GradBucket.index()``: in DDP's first
static-graph iteration every bucket says index 0 and none says it is the last.
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import copy
import dataclasses
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import blocks, costmodel, device, reduction, session
from . import config as _config
from .comm.distributed import TorchCollectives
from .errors import HvdSparseError
from .job import Context, RowsPlan, Stats
from .metrics import record as record_metrics
from .reduction import Part
from .schemes import SMALL_GO_DENSE, auto, rows
from .sparsifiers import Sparsifier

__all__ = ["State", "hook"]
Held = tuple[int, torch.Tensor, torch.futures.Future]  # a sparse bucket: index, gradient, result
# what a stream's thread runs: results for the futures, in their order, from the stream's group
Work = tuple[Callable[[TorchCollectives], list[torch.Tensor]], list[torch.futures.Future]]


class State:
    """What the hook needs across steps: the options, the process group it serves, its
    streams, the aggregators and switch joined, the network model, the sparsifier, and what it
    learnt of the buckets.

    Construction is collective over ``process_group``: every rank of it constructs the state,
    in the same order as its other collectives. ``close()`` (or the end of the process)
    releases it. A state pickles (``torch.save``) with its options, the sparsifier's memory and
    what ``auto`` learnt, not its groups, threads and sockets; a loaded one serves the default
    group (as PowerSGD's state does: set ``process_group`` before its first use to serve
    another) and joins its ranks at the first bucket it reduces, every rank at once.

    Args:
        process_group: the ranks the DDP model is replicated over, as given to
            ``DistributedDataParallel(process_group=...)``; None: the default group. The
            hook's streams are Gloo subgroups of it, made by its ranks alone, and its
            aggregators and switch job serve its ranks only.
        sparsifier: sparsifies each parameter's gradient in a dense bucket before the
            reduction (e.g. ``hvd_sparse.TopK(0.01)``), with error feedback per parameter.
        named_parameters: ``model.named_parameters()``: names the sparsifier's memory
            (needed with a sparsifier to resume from a checkpoint).
        streams: buckets reduced at once, each stream a thread and a Gloo group (one with
            ``fallback="dense"`` where the aggregators may be used: every rank must see
            aggregation go down at the same bucket).
        fuse_mb: sparse buckets whose last results together stay under this size are reduced
            by one exchange.
        **options: ``hvd_sparse.init``'s options (``scheme``, ``timeout``, ``aggregators``,
            ...: see the configuration reference), over ``HVD_SPARSE_*`` variables.

    Raises:
        HvdSparseError: torch.distributed is not initialized, or the aggregators or switch
            could not be joined (naming them).
        ValueError: ``streams`` < 1 or an option's value is invalid.
        TypeError: an unknown option.

    Example:
        >>> state = hvd_sparse.ddp.State(scheme="auto")
        >>> model.register_comm_hook(state, hvd_sparse.ddp.hook)
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *,
                 sparsifier: Sparsifier | None = None,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] = (), streams: int = 2,
                 fuse_mb: float = 1.0, **options: Any) -> None:
        if not dist.is_initialized():
            raise HvdSparseError("hvd_sparse.ddp.State(): call "
                                 "torch.distributed.init_process_group() first")
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self.config = _config.from_env_and_kwargs(**options)
        self.process_group = process_group
        self.sparsifier = sparsifier
        self.names = {p: n for n, p in named_parameters}
        self._needs_names = False
        self.stream_count = streams
        self.fuse_bytes = int(fuse_mb * 2**20)
        self._forget()
        # what "auto" learnt (union ratios, rows plans by bucket name): the context's own dicts
        self._learnt: tuple[dict[tuple[str, tuple[int, ...]], float],
                            dict[str, RowsPlan]] = ({}, {})
        self._join()

    def _forget(self) -> None:
        """What a state holds only while it runs in this process (not pickled)."""
        self.streams: list[TorchCollectives] = []
        self.comm: TorchCollectives | None = None
        self._model_comm: TorchCollectives | None = None  # the model's own group
        self._model_gloo = True
        self.omni = self.switch = None
        self.context: Context | None = None
        self._work: list[queue.Queue[Work | None]] = []
        self._threads: list[threading.Thread | None] = []
        self._next = -1  # the stream of the last reduction
        self._held: list[Held] = []  # sparse buckets
        self._seen: dict[int, int] = {}  # a sparse bucket's last result, bytes
        self._buckets: dict[tuple[int, ...], int] = {}  # a bucket's parameters -> its number
        self._numbered = 0  # buckets numbered so far
        self._watched: set[int] = set()  # parameters whose end forgets their buckets
        self._pass: list[tuple[int, bool]] = []  # this backward pass: (bucket, sparse)
        self._sparse_after: dict[int, bool] = {}  # last pass: whether a sparse bucket followed
        self._dense_streak: dict[tuple[str, tuple[int, ...]], int] = {}  # "auto"'s, relearnt
        self._routes: dict[str, costmodel.DeviceRoute] = {}  # a device's, probed at its first

    def _join(self) -> None:
        """Collective over the process group: the streams' groups, the aggregators and switch
        joined, the network model."""
        cfg = self.config
        pg = self.process_group
        if pg is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gave a rank outside
            raise HvdSparseError(f"hvd_sparse.ddp.State: rank {dist.get_rank()} is not in its "
                                 "process group")
        ranks = dist.get_process_group_ranks(pg) if pg is not None else \
            list(range(dist.get_world_size()))
        # Groups of our own, one per stream: operations on DDP's group (and the user's) must
        # not interleave with the hook's, which run on other threads. Made by the group's ranks
        # alone (local synchronization), so other jobs in the world need not take part.
        # Reductions go to the streams in turn, in the order DDP hands out buckets (alike on
        # every rank), each stream's one after another, so every group sees the same
        # operations in the same order on every rank.
        # With fallback "dense", one stream where aggregators may be used: aggregation that
        # goes down (or regroups) must do so between the same two buckets on every rank, and
        # two streams' threads would see it at different buckets on different ranks.
        count = self.stream_count
        if (cfg.fallback == "dense" and cfg.scheme in ("auto", "omnireduce")
                and cfg.aggregates()):
            count = 1
        timeout = timedelta(seconds=cfg.timeout * 4)
        self.streams = [TorchCollectives(dist.new_group(ranks, timeout=timeout, backend="gloo",
                                                        use_local_synchronization=True),
                                         job_size=len(ranks), route="hook streams")
                        for _ in range(count)]
        # a dense bucket goes to the model's own group where that is faster than Gloo through
        # host memory: its backend is not Gloo (NCCL), or the bucket is on a device
        self._model_gloo = dist.get_backend(pg) == "gloo"
        self._model_comm = TorchCollectives(pg, job_size=len(ranks), route="model group")
        self.comm = self.streams[0]
        self.omni, self.switch, self.net = session.join_all(cfg, self.comm)
        self.context = Context(cfg, self.net, self.omni, self.switch, *self._learnt,
                               self._dense_streak, routes=self._routes)
        if self.sparsifier is not None:
            self.sparsifier.join(self.comm.rank, self.comm.size)
        self._work = [queue.Queue() for _ in self.streams]
        self._threads = [None] * len(self.streams)

    def __getstate__(self) -> dict[str, Any]:
        if self._held:
            raise HvdSparseError("hvd_sparse.ddp.State: cannot be saved in the middle of a "
                                 "backward pass (sparse buckets are held)")
        return {"config": self.config, "sparsifier": self.sparsifier,
                "named": bool(self.names), "stream_count": self.stream_count,
                "fuse_bytes": self.fuse_bytes, "learnt": copy.deepcopy(self._learnt)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = state["config"]
        self.sparsifier = state["sparsifier"]
        self.stream_count = state["stream_count"]
        self.fuse_bytes = state["fuse_bytes"]
        self._learnt = state["learnt"]
        self.names = {}
        self._needs_names = state["named"] and self.sparsifier is not None
        self.process_group = None  # the default group, unless set before the first use
        self._forget()

    def set_names(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Names the parameters again (a state loaded with ``torch.load``, whose sparsifier
        keeps its memory per parameter name).

        Args:
            named_parameters: ``model.named_parameters()`` of the resumed model.
        """
        self.names = {p: n for n, p in named_parameters}
        self._needs_names = False

    def _ready(self) -> None:
        """Joins the ranks when a loaded state reduces its first bucket (collective: DDP hands
        the first bucket to every rank's hook)."""
        if self.context is not None:
            return
        if self._needs_names:
            raise HvdSparseError(
                "hvd_sparse.ddp.State was loaded from a checkpoint with a sparsifier, whose "
                "memory is kept per parameter name: call state.set_names("
                "model.named_parameters()) before the first backward pass")
        self._join()

    def _bucket(self, bucket: dist.GradBucket, sparse: bool) -> int:
        """The bucket's number: its parameters' first appearance in DDP's order, alike on every
        rank. A bucket seen already in this pass starts the next one (DDP's first
        static-graph iteration flags no bucket as the last)."""
        self._ready()
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        number = self._buckets.get(key)
        if number is None:
            number = self._buckets[key] = self._numbered
            self._numbered += 1
            # An id is reused once its object is freed, at a moment that differs between
            # ranks: a dead model's buckets are forgotten when its parameters go, never matched
            # by a new model's.
            for p in params:
                if id(p) not in self._watched:
                    self._watched.add(id(p))
                    weakref.finalize(p, self._forget_parameter, id(p))
        if any(n == number for n, _ in self._pass):  # the last pass was not flagged, or failed
            self._fail_held(HvdSparseError(
                "hvd_sparse: held since a backward pass that did not reach its last bucket"))
            self._end_pass()
        self._pass.append((number, sparse))
        return number

    def _forget_parameter(self, pid: int) -> None:
        self._watched.discard(pid)
        self._buckets = {k: n for k, n in self._buckets.items() if pid not in k}

    def _submit(self, name: str, t: torch.Tensor, parts: Sequence[Part] = ()
               ) -> torch.futures.Future:
        """The average of ``t`` over the ranks, reduced on the next stream's thread (its
        ``parts`` sparsified first, with a sparsifier)."""
        fut: torch.futures.Future = torch.futures.Future()
        parts = list(parts)
        self._put(lambda comm: [self.reduce(name, t, parts, comm)], [fut])
        return fut

    def _goes_dense(self, name: str, t: torch.Tensor, parts: Sequence[Part]) -> bool:
        """Whether dense bucket ``name`` goes dense this step, known before it is reduced
        (alike on every rank): the scheme is "dense", the bucket is small (schemes.run sends
        it dense), or "auto" keeps sending it dense (``auto.steady_dense``). Not with a
        sparsifier at work: sparsified, it is no longer dense."""
        if self.sparsifier is not None and parts:
            return False
        scheme = self.config.scheme
        if scheme == "dense":
            return True
        if scheme in SMALL_GO_DENSE and t.numel() * t.element_size() < self.config.small_bytes:
            return True
        assert self.context is not None and self.comm is not None
        return scheme == "auto" and auto.steady_dense(self.context,
                                                      auto.key(name, self.comm.ranks))

    def _route(self, t: torch.Tensor) -> None:
        """What "auto" weighs for a device's dense buckets (``costmodel.DeviceRoute``): the
        model's group's allreduce where they are, and the bus that staging crosses; probed at
        the device's first dense bucket (from the hook, in bucket order: collective over the
        group, alike on every rank), unless the probe is off (the host model's allreduce and
        ``costmodel.BUS_BPS`` then)."""
        key = str(t.device)
        if key in self._routes or self.config.scheme != "auto":
            return
        if self.config.probe == "off":
            self._routes[key] = costmodel.DeviceRoute(self.net.allreduce, costmodel.BUS_BPS)
            return
        pg = self.process_group
        xs = {k: torch.zeros(k, device=t.device) for k in (256, 1 << 20)}

        def done() -> None:
            if t.is_cuda:
                torch.cuda.synchronize(t.device)

        def allreduce(k: int) -> None:
            dist.all_reduce(xs[k], group=pg)
            done()

        def to_host(k: int) -> None:
            xs[k].to("cpu", copy=True)
            done()

        def agree(times: list[float]) -> list[float]:
            slowest = torch.tensor(times, dtype=torch.float64, device=t.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=pg)
            return slowest.tolist()

        self._routes[key] = costmodel.probe_route(allreduce, to_host, agree)

    def _on_model_group(self, name: str, t: torch.Tensor) -> torch.futures.Future:
        """DDP's own allreduce of the bucket (its default hook's: divided first, then summed on
        the model's process group), issued here, in bucket order as DDP hands them out."""
        started = time.monotonic()
        pg = self.process_group
        n = dist.get_world_size(pg)
        fut = dist.all_reduce(t.div_(n), group=pg, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            ring = int(2 * (n - 1) / n * t.nbytes)  # a ring, modelled
            record_metrics(name, time.monotonic() - started,
                           Stats(scheme="dense", route="model group", bytes_sent=ring,
                                 bytes_received=ring))
            return f.value()[0]
        return fut.then(done)

    def _rows_on_model_group(self, name: str, t: torch.Tensor) -> torch.futures.Future:
        """A device's sparse bucket by its rows, where they are: the model's group's allgather
        (the row counts, then every rank's rows: two calls, issued from the hook in bucket
        order) and their average summed on the device (``rows.device_sum``)."""
        started = time.monotonic()
        wire = reduction.wire_type(t, self.config.wire)  # bfloat16 rows, summed into t's dtype
        send = t.to(wire) if wire is not None else t
        meta = blocks.meta_hash(t.shape, send.dtype)
        ids, vals = rows.device_parts(send, meta)
        n = dist.get_world_size(self.process_group)
        assert self._model_comm is not None
        fut = self._model_comm.allgather_many_here([ids, vals])

        def done(f: torch.futures.Future) -> torch.Tensor:
            ids_parts, vals_parts = f.value()
            out = rows.device_sum(t, meta, ids_parts, vals_parts, 1 / n)
            gathered = sum(p.nbytes for p in ids_parts) + sum(v.nbytes for v in vals_parts)
            record_metrics(name, time.monotonic() - started, Stats(
                scheme="rows", route="model group", union=int(out._nnz()),
                wire=None if wire is None else str(wire).removeprefix("torch."),
                rows_local=ids.numel() - 1, bytes_sent=int(gathered * (n - 1) / n),
                bytes_received=gathered - ids.nbytes - vals.nbytes))
            return out
        return fut.then(done)

    def _hold(self, index: int, t: torch.Tensor) -> torch.futures.Future:
        """Sparse bucket ``index``'s average: reduced now when its last result was large (or
        it has none yet), else with the buckets held beside it at the next ``_release``. The
        last result is the union, alike on every rank, so every rank holds the same ones."""
        fut: torch.futures.Future = torch.futures.Future()
        item = (index, t, fut)
        if self._seen.get(index, self.fuse_bytes + 1) > self.fuse_bytes:
            # a large table pays for its bytes, not for an exchange of its own: it goes while
            # backward computes the next one
            self._put(lambda comm: self._reduce_held([item], comm), [fut])
        else:
            self._held.append(item)
        return fut

    def _last_sparse(self, index: int) -> bool:
        """Whether no sparse bucket followed ``index`` in the last backward pass: the held
        buckets then go now, not when the next one is ready (alike on every rank: DDP's
        buckets are)."""
        return not self._sparse_after.get(index, False)

    def _backward_done(self) -> None:
        """After the last bucket of a backward pass."""
        self._release()
        self._end_pass()

    def _end_pass(self) -> None:
        now, self._pass = self._pass, []
        self._sparse_after = {n: i + 1 < len(now) and now[i + 1][1]
                              for i, (n, _) in enumerate(now)}

    def _release(self) -> None:
        """Reduces the held sparse buckets, those of one row shape and dtype as one tensor
        (several, if their last results together exceed ``fuse_bytes``)."""
        held, self._held = self._held, []
        groups: dict[tuple[Any, ...], list[Held]] = {}
        for item in held:
            t = item[1]
            groups.setdefault((t.dtype, t.shape[t.sparse_dim():]), []).append(item)
        for group in groups.values():
            for chunk in self._chunks(group):
                self._put(lambda comm, chunk=chunk: self._reduce_held(chunk, comm),
                          [f for _, _, f in chunk])

    def _chunks(self, group: list[Held]) -> Iterator[list[Held]]:
        # Small tables pay for the exchange (a few ms each, on any link), so they share one.
        chunk: list[Held] = []
        size = 0
        for item in group:
            nbytes = self._seen[item[0]]  # held: seen, and small
            if chunk and size + nbytes > self.fuse_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(item)
            size += nbytes
        if chunk:
            yield chunk

    def _reduce_held(self, chunk: list[Held], comm: TorchCollectives) -> list[torch.Tensor]:
        index = [i for i, _, _ in chunk]
        tensors = [t for _, t, _ in chunk]
        name = "ddp.bucket" + "+".join(map(str, index))
        if len(tensors) == 1:
            out = [self.reduce(name, tensors[0], (), comm)]
        else:  # one exchange: their rows one after another
            fused, offsets = rows.fuse([t.cpu() for t in tensors])
            reduced = self.reduce(name, fused, (), comm)
            out = [o.to(t.device) for o, t in
                   zip(rows.split(reduced, [t.shape for t in tensors], offsets), tensors,
                       strict=True)]
        for i, o in zip(index, out, strict=True):
            self._seen[i] = o._values().nbytes
        return out

    def _fail_held(self, e: Exception) -> None:
        held, self._held = self._held, []
        for _, _, fut in held:
            fut.set_exception(e)

    def _put(self, fn: Callable[[TorchCollectives], list[torch.Tensor]],
             futs: list[torch.futures.Future]) -> None:
        k = self._next = (self._next + 1) % len(self.streams)
        thread = self._threads[k]
        if thread is None:
            thread = self._threads[k] = threading.Thread(
                target=self._serve, args=(k,), name=f"hvd_sparse.ddp.{k}", daemon=True)
            thread.start()
        self._work[k].put((fn, futs))

    def _serve(self, k: int) -> None:
        while (item := self._work[k].get()) is not None:
            fn, futs = item
            try:
                for fut, out in zip(futs, fn(self.streams[k]), strict=True):
                    fut.set_result(out)
            except Exception as e:  # noqa: BLE001 - DDP raises it from backward
                for fut in futs:
                    if not fut.done():
                        fut.set_exception(e)

    def reduce(self, name: str, t: torch.Tensor, parts: Sequence[Part] = (),
               comm: TorchCollectives | None = None) -> torch.Tensor:
        """The average of ``t`` over the state's ranks, on the calling thread (what the hook
        does with a bucket; every rank must call it in the same order).

        Args:
            name: names the reduction (metrics, run file).
            t: a dense tensor (written in place with the result) or a sparse COO one.
            parts: the parameters' gradients in ``t`` (name, offset, elements), sparsified
                one by one first when the state has a sparsifier.
            comm: the stream's collectives to use; None: the first stream's.

        Returns:
            The average, ``t`` itself for a dense ``t``, a coalesced sparse tensor for a
            sparse one.

        Raises:
            HvdSparseError: the reduction failed or timed out (naming the tensor and peer).
        """
        comm = comm or self.comm
        if t.is_sparse:  # DDP wants a sparse result: rows, by allgather where "dense" is asked
            if t.device.type != "cpu":  # rows work in host memory: such a bucket crosses whole
                return self.reduce(name, t.cpu(), (), comm).to(t.device)
            scheme = self.config.scheme
            return self._run(name, t, "allgather" if scheme == "dense" else scheme, comm)
        # a dense bucket: sparsified (by parameter) on its device, staged by its non-zero blocks
        sparsifier = self.sparsifier if parts else None
        return self._run(name, t.contiguous().view(-1), self.config.scheme, comm, sparsifier, parts
                         ).view(t.shape)

    def _run(self, name: str, t: torch.Tensor, scheme: str, comm: TorchCollectives,
             sparsifier: Sparsifier | None = None, parts: Sequence[Part] = ()) -> torch.Tensor:
        """The average of ``t`` (dense: in place) by ``scheme``, on this thread."""
        assert self.context is not None
        h = reduction.start(t, name, comm=comm, ctx=self.context, scheme=scheme, average=True,
                            block_size=self.config.block_size, inplace=not t.is_sparse,
                            sparsifier=sparsifier, parts=parts)
        return reduction.finish(h)

    def state_dict(self) -> dict[str, Any]:
        """What the hook learnt in training, to save with a checkpoint.

        Returns:
            The sparsifier's memory and what ``auto`` learnt of each bucket (its choices'
            streaks included), in tensors and plain Python types only (``torch.load`` reads it
            with its default ``weights_only=True``); pass it to
            ``load_state_dict`` of the resumed job's state (or pickle the state itself).
        """
        union_ratio, plans = self._learnt
        return {"sparsifier": self.sparsifier.state_dict() if self.sparsifier else None,
                "union_ratio": dict(union_ratio),
                "rows_plans": {n: dataclasses.asdict(p) for n, p in plans.items()},
                "dense_streak": dict(self._dense_streak)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what ``state_dict`` returned.

        Args:
            state: a ``state_dict()`` of a state with a sparsifier of the same kind (or none).

        Raises:
            ValueError: one of the two has a sparsifier and the other has none.
        """
        if (state["sparsifier"] is None) != (self.sparsifier is None):
            raise ValueError("hvd_sparse.ddp.State.load_state_dict: the checkpoint was saved "
                             "with" + ("out" if state["sparsifier"] is None else "") +
                             " a sparsifier, this state has" +
                             (" none" if self.sparsifier is None else " one"))
        if self.sparsifier is not None:
            self.sparsifier.load_state_dict(state["sparsifier"])
        union_ratio, plans = self._learnt
        union_ratio.clear()
        # by (name, ranks); an older checkpoint's, by name alone, is relearnt
        union_ratio.update((k, v) for k, v in state["union_ratio"].items() if isinstance(k, tuple))
        plans.clear()
        plans.update((n, p if isinstance(p, RowsPlan) else RowsPlan(**p))  # (older: objects)
                     for n, p in copy.deepcopy(state.get("rows_plans", {})).items())
        # the streaks too: a resumed job asks the ranks when the saved one would have, so
        # it makes the same choices (and the same sums) as a run never interrupted
        self._dense_streak.clear()
        self._dense_streak.update(state.get("dense_streak", {}))

    def close(self) -> None:
        """Fails the buckets still held, stops the streams' threads and leaves the aggregators
        and the switch (the job's own aggregators stop). Idempotent."""
        self._fail_held(HvdSparseError("hvd_sparse.ddp: the state was closed"))
        for k, thread in enumerate(self._threads):
            if thread is not None:
                self._work[k].put(None)
                thread.join(timeout=self.config.timeout)
        self._threads = [None] * len(self.streams)
        for joined in (self.omni, self.switch):
            if joined is not None:
                joined.close()
        self.omni = self.switch = None


def hook(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over the state's process group.

    Register it with ``ddp_model.register_comm_hook(state, hook)``.

    Args:
        state: the ``State`` (its process group must be the DDP model's).
        bucket: DDP's bucket of gradients.

    Returns:
        A future of the averaged bucket (sparse for a sparse bucket); a failure in it raises
        from ``backward()`` with the hook's own message (naming bucket, tensor and peer).
    """
    buffer = bucket.buffer()
    sparse = buffer.is_sparse and buffer.dtype in rows.FLOATS
    number = state._bucket(bucket, sparse)
    name = f"ddp.bucket{number}"
    if sparse and device.on_device(buffer) and state.config.scheme != "omnireduce":
        fut = state._rows_on_model_group(name, buffer)
    elif sparse:
        fut = state._hold(number, buffer)
        if state._last_sparse(number):
            state._release()
    else:
        state._release()  # the sparse buckets before this one go first, in bucket order
        parts = _parts(state, bucket, name)
        if device.on_device(buffer):
            state._route(buffer)
        if (not state._model_gloo or device.on_device(buffer)) and \
                state._goes_dense(name, buffer, parts):
            fut = state._on_model_group(name, buffer)
        else:
            fut = state._submit(name, buffer, parts)
    if bucket.is_last():
        state._backward_done()
    # DDP reads a future's value as the bucket, an exception set on it included ("Unable to
    # cast"): a future chained by ``then`` fails as itself, with the exception's message
    return fut.then(_value)


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.wait()


def _parts(state: State, bucket: dist.GradBucket, name: str) -> list[Part]:
    """The parameters' gradients in a dense bucket, to sparsify one by one."""
    buffer = bucket.buffer()
    if state.sparsifier is None or buffer.is_sparse:
        return []
    parts: list[Part] = []
    start = 0  # they lie one after another in the bucket's flat buffer
    for i, p in enumerate(bucket.parameters()):
        parts.append((state.names.get(p, f"{name}.{i}"), start, p.numel()))
        start += p.numel()
    if start != buffer.numel():
        raise HvdSparseError(f"hvd_sparse: {name}: its parameters hold {start} elements, "
                             f"its buffer {buffer.numel()}: cannot sparsify per parameter")
    return parts


