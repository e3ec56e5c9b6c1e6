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
the ranks, as DDP expects of a hook. With a ``sparsifier`` each parameter's gradient in a dense
bucket is sparsified first (error feedback per parameter, named by ``named_parameters``).
Reductions go to the state's streams in turn, each a thread and a Gloo group of its own, one
reduction after another on each: torch.distributed matches operations by the order they are
issued in on a group, and DDP hands buckets to the hook in the same order on every rank, so
every rank issues the same operations in the same order on each group, while backward goes on.
Horovod is not needed.
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import blocks, engine, schemes, session
from . import config as _config
from .comm.distributed import TorchCollectives
from .engine import Handle
from .errors import HvdSparseError
from .job import Context, Job
from .metrics import record as record_metrics
from .schemes import rows
from .sparsifiers import Sparsifier

log = logging.getLogger("hvd_sparse")
__all__ = ["State", "hook"]
Part = tuple[str, int, int]  # a parameter's gradient in a bucket: name, offset, elements
Held = tuple[int, torch.Tensor, torch.futures.Future]  # a sparse bucket: index, gradient, result
# what a stream's thread runs: results for the futures, in their order, from the stream's group
Work = tuple[Callable[[TorchCollectives], list[torch.Tensor]], list[torch.futures.Future]]


class State:
    """What the hook needs across steps: the options (as ``hvd_sparse.init`` takes them, or
    ``HVD_SPARSE_*``), the aggregators and switch joined, the network model, the reducing
    thread, the sparsifier. Collective: every rank of the default process group constructs
    it, in the same order as its other collectives. ``close()`` (or the end of the process)
    releases it. ``streams``: buckets reduced at once (each stream a thread and a Gloo group);
    ``fuse_mb``: sparse buckets whose last results together stay under this size are reduced
    by one exchange."""

    def __init__(self, *, sparsifier: Sparsifier | None = None,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] = (), streams: int = 2,
                 fuse_mb: float = 1.0, **options: Any) -> None:
        if not dist.is_initialized():
            raise HvdSparseError("hvd_sparse.ddp.State(): call "
                                 "torch.distributed.init_process_group() first")
        cfg = _config.from_env_and_kwargs(**options)
        self.config = cfg
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        # Groups of our own, one per stream: operations on the default one (DDP's, the
        # user's) must not interleave with the hook's, which run on other threads. Reductions
        # go to the streams in turn, in the order DDP hands out buckets (alike on every rank),
        # each stream's one after another, so every group sees the same operations in the same
        # order on every rank.
        timeout = timedelta(seconds=cfg.timeout * 4)
        self.streams = [TorchCollectives(dist.new_group(backend="gloo", timeout=timeout))
                        for _ in range(streams)]
        self.comm = self.streams[0]
        self.omni, self.switch, self.net = session.join_all(cfg, self.comm)
        self.context = Context(cfg, self.net, self.omni, self.switch)
        self.sparsifier = sparsifier
        if sparsifier is not None:
            sparsifier.join(self.comm.rank, self.comm.size)
        self.names = {p: n for n, p in named_parameters}
        self._work: list[queue.Queue[Work | None]] = [queue.Queue() for _ in self.streams]
        self._threads: list[threading.Thread | None] = [None] * streams
        self._next = -1  # the stream of the last reduction
        self.fuse_bytes = int(fuse_mb * 2**20)
        self._held: list[Held] = []  # sparse buckets
        self._seen: dict[int, int] = {}  # a sparse bucket's last result, bytes
        self._sparse_last: set[int] = set()  # the sparse buckets of the last backward pass
        self._sparse_now: set[int] = set()  # and of this one

    def submit(self, name: str, t: torch.Tensor, parts: Sequence[Part] = ()
               ) -> torch.futures.Future:
        """The average of ``t`` over the ranks, reduced on the next stream's thread (its
        ``parts`` sparsified first, with a sparsifier)."""
        fut: torch.futures.Future = torch.futures.Future()
        parts = list(parts)
        self._put(lambda comm: [self.reduce(name, t, parts, comm)], [fut])
        return fut

    def hold(self, index: int, t: torch.Tensor) -> torch.futures.Future:
        """Sparse bucket ``index``'s average: reduced now when its last result was large (or
        it has none yet), else with the buckets held beside it at the next ``release``. The
        last result is the union, alike on every rank, so every rank holds the same ones."""
        if any(i == index for i, _, _ in self._held):  # a backward pass that never finished
            self._fail_held(HvdSparseError(
                f"hvd_sparse: ddp.bucket{index}: held since a backward pass that did not reach "
                "its last bucket"))
        fut: torch.futures.Future = torch.futures.Future()
        item = (index, t, fut)
        self._sparse_now.add(index)
        if self._seen.get(index, self.fuse_bytes + 1) > self.fuse_bytes:
            # a large table pays for its bytes, not for an exchange of its own: it goes while
            # backward computes the next one
            self._put(lambda comm: self._reduce_held([item], comm), [fut])
        else:
            self._held.append(item)
        return fut

    def last_sparse(self, index: int) -> bool:
        """Whether the bucket after ``index`` was dense in the last backward pass: the held
        buckets then go now, not when that one is ready (alike on every rank: DDP's buckets
        are)."""
        return index + 1 not in self._sparse_last

    def backward_done(self) -> None:
        """After the last bucket of a backward pass."""
        self.release()
        self._sparse_last, self._sparse_now = self._sparse_now, set()

    def release(self) -> None:
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
        """The average of ``t`` (dense or sparse COO) over the ranks, over ``comm`` (the first
        stream's by default), on this thread."""
        comm = comm or self.comm
        if t.device.type != "cpu":  # reduced through host memory
            return self.reduce(name, t.cpu(), parts, comm).to(t.device)
        bs = self.config.block_size
        scheme = self.config.scheme
        if t.is_sparse:
            if rows.supported(t):
                return self._run(name, t, t.shape, "rows", comm)
            return self._run(name, t.to_dense().view(-1), t.shape, "dense", comm).view(t.shape)
        flat = t.contiguous().view(-1)
        if not blocks.supported(flat) or flat.numel() == 0:
            scheme = "dense"
        sparsify = self.sparsifier is not None and bool(parts)
        whole: list[Part] = []
        if sparsify:
            for part, start, numel in parts:
                self.sparsifier(part, flat[start:start + numel], bs)
            # Parameters too small to sparsify went out whole: a ring allreduce ships them
            # cheapest (an allgather of whole blocks costs ~2x), so they are reduced apart, and
            # zeroed in the bucket, whose scheme then sends no blocks for them.
            whole = [p for p in parts if self.sparsifier.too_small(p[2])]
            if len(whole) == len(parts):
                scheme = "dense"
            if scheme == "dense":
                whole = []
        if whole:
            small = torch.cat([flat[s:s + n] for _, s, n in whole])
            for _, s, n in whole:
                flat[s:s + n].zero_()
            small = self._run(f"{name}.whole", small, small.shape, "dense", comm)
        out = self._run(name, flat, t.shape, scheme, comm)
        at = 0
        for _, s, n in whole:
            out[s:s + n] = small[at:at + n]
            at += n
        if sparsify:
            for part, start, numel in parts:
                self.sparsifier.observe(part, out[start:start + numel], bs)
        return out.view(t.shape)

    def _run(self, name: str, flat: torch.Tensor, shape: torch.Size, scheme: str,
             comm: TorchCollectives) -> torch.Tensor:
        """The average of ``flat`` (in place unless by rows) by ``scheme``, on this thread."""
        job = Job(name=name, tensor=flat, shape=shape, average=True, prescale=1.0,
                  postscale=1.0, block_size=self.config.block_size,
                  meta=blocks.meta_hash(shape, flat.dtype), scheme=scheme, ctx=self.context,
                  comm=comm, inplace=scheme != "rows" and flat.numel() > 0,
                  asked=self.config.scheme)
        h = engine.submit(job, schemes.run(job), _record)
        return engine.synchronize(h, self.config.timeout)

    def state_dict(self) -> dict[str, Any]:
        """What the hook learnt in training (the sparsifier's memory, auto's union ratios):
        save it with the checkpoint and ``load_state_dict`` it into the resumed job's state."""
        return {"sparsifier": self.sparsifier.state_dict() if self.sparsifier else None,
                "union_ratio": dict(self.context.union_ratio)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["sparsifier"] is None) != (self.sparsifier is None):
            raise ValueError("hvd_sparse.ddp.State.load_state_dict: the checkpoint was saved "
                             "with" + ("out" if state["sparsifier"] is None else "") +
                             " a sparsifier, this state has" +
                             (" none" if self.sparsifier is None else " one"))
        if self.sparsifier is not None:
            self.sparsifier.load_state_dict(state["sparsifier"])
        self.context.union_ratio.clear()
        self.context.union_ratio.update(state["union_ratio"])

    def close(self) -> None:
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
    """DDP communication hook: the bucket's gradients averaged over the ranks by hvd_sparse."""
    name, buffer = f"ddp.bucket{bucket.index()}", bucket.buffer()
    if buffer.is_sparse and buffer.dtype in rows.FLOATS:
        fut = state.hold(bucket.index(), buffer)
        if state.last_sparse(bucket.index()):
            state.release()
    else:
        state.release()  # the sparse buckets before this one go first, in bucket order
        fut = state.submit(name, buffer, _parts(state, bucket, name))
    if bucket.is_last():
        state.backward_done()
    return fut


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


def _record(h: Handle) -> None:
    record_metrics(h.job.name, time.monotonic() - h.started, h.job.stats)
