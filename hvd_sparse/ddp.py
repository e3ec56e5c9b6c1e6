"""The DDP front end: hvd_sparse's schemes, aggregators and switch behind PyTorch DDP's
communication hook.

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(hvd_sparse.ddp.State(scheme="auto"), hvd_sparse.ddp.hook)

A dense bucket (DDP's flat buffer of several gradients) is reduced as one tensor by the
configured scheme ("auto": the cost model's choice among the schemes and dense); a sparse one
(``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``) from its rows. The result is the average
over the ranks, as DDP expects of a hook. With a ``sparsifier`` each parameter's gradient in a
dense bucket is sparsified first (error feedback per parameter, named by ``named_parameters``).
Buckets are reduced on the state's streams, each a thread and a Gloo group of its own (bucket
i on stream i % streams, one after another there): torch.distributed matches operations by the
order they are issued in on a group, and DDP hands buckets to the hook in the same order on
every rank, so every rank issues the same operations in the same order on each group, while
backward goes on. Horovod is not needed.
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
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
Work = tuple[str, torch.Tensor, list[Part], torch.futures.Future]


class State:
    """What the hook needs across steps: the options (as ``hvd_sparse.init`` takes them, or
    ``HVD_SPARSE_*``), the aggregators and switch joined, the network model, the reducing
    thread, the sparsifier. Collective: every rank of the default process group constructs
    it, in the same order as its other collectives. ``close()`` (or the end of the process)
    releases it."""

    def __init__(self, *, sparsifier: Sparsifier | None = None,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] = (), streams: int = 2,
                 **options: Any) -> None:
        if not dist.is_initialized():
            raise HvdSparseError("hvd_sparse.ddp.State(): call "
                                 "torch.distributed.init_process_group() first")
        cfg = _config.from_env_and_kwargs(**options)
        self.config = cfg
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        # Groups of our own, one per stream: operations on the default one (DDP's, the
        # user's) must not interleave with the hook's, which run on other threads; bucket i
        # is reduced on stream i % streams, each stream's buckets one after another, so every
        # group sees the same operations in the same order on every rank.
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

    def submit(self, name: str, t: torch.Tensor, parts: Sequence[Part] = (),
               stream: int = 0) -> torch.futures.Future:
        """The average of ``t`` over the ranks, reduced on the thread of ``stream`` (its
        ``parts`` sparsified first, with a sparsifier)."""
        fut: torch.futures.Future = torch.futures.Future()
        k = stream % len(self.streams)
        thread = self._threads[k]
        if thread is None:
            thread = self._threads[k] = threading.Thread(
                target=self._serve, args=(k,), name=f"hvd_sparse.ddp.{k}", daemon=True)
            thread.start()
        self._work[k].put((name, t, list(parts), fut))
        return fut

    def _serve(self, k: int) -> None:
        while (item := self._work[k].get()) is not None:
            name, t, parts, fut = item
            try:
                fut.set_result(self.reduce(name, t, parts, self.streams[k]))
            except Exception as e:  # noqa: BLE001 - DDP raises it from backward
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
            # Parameters too small for the density went out whole: a ring allreduce ships them
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
    parts: list[Part] = []
    if state.sparsifier is not None and not buffer.is_sparse:
        # the parameters' gradients lie one after another in the bucket's flat buffer
        start = 0
        for i, p in enumerate(bucket.parameters()):
            parts.append((state.names.get(p, f"{name}.{i}"), start, p.numel()))
            start += p.numel()
        if start != buffer.numel():
            raise HvdSparseError(f"hvd_sparse: {name}: its parameters hold {start} elements, "
                                 f"its buffer {buffer.numel()}: cannot sparsify per parameter")
    return state.submit(name, buffer, parts, bucket.index())


def _record(h: Handle) -> None:
    record_metrics(h.job.name, time.monotonic() - h.started, h.job.stats)
