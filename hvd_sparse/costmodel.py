"""Alpha-beta cost model that lets "auto" pick a scheme per tensor.

Each collective is modelled as alpha + beta * bytes, fitted from a short probe of the real
collectives at ``init`` (cached on disk per cluster shape) and shared from rank 0 so every rank
predicts the same numbers and so picks the same scheme. Sparse schemes are chosen only when
predicted clearly faster than dense: a wrong guess must cost little.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import blocks, protocol
from ._C import SEGMENT_HEADER_BYTES, block_mask, decode_sum, encode
from .config import Config

if TYPE_CHECKING:
    from .comm import Collectives

log = logging.getLogger("hvd_sparse")

# A software aggregator's layout by default: (payload bytes per packet, slots per aggregator)
OMNI_LAYOUT = (Config.payload_bytes, Config.slots)
# ... and a switch's: what one slot holds (int32), with as many more slots as its packets are
# smaller (the worker engine's rule), at most the groups a job gets (a quarter of the pool)
_SWITCH_SLOT = protocol.SWITCH_CELLS_PER_SLOT * protocol.SWITCH_VALUES_PER_PASS * 4
SWITCH_LAYOUT = (_SWITCH_SLOT, min(protocol.SWITCH_CELLS // protocol.SWITCH_CELLS_PER_SLOT // 4,
                                   Config.slots * max(1, Config.payload_bytes // _SWITCH_SLOT)))
SEGMENT = SEGMENT_HEADER_BYTES + 8  # a segment's header, and its index list's alignment
MARGIN = 0.8  # a sparse scheme must be predicted this much faster than dense
# ... and receive at most this share of dense's bytes. The probe's small collectives miss the
# host work that grows with volume (fresh receive buffers, copies, decode): in bench_sync at
# 40% block density (zen receiving 0.64x dense's bytes) zen took 2.7x in-place dense while the
# model predicted 0.45x; at 10% (0.2x the bytes) allgather was within 12% of it.
MAX_BYTES_RATIO = 0.5
CACHE_MAX_AGE = 24 * 3600
# The share of a link's rate that bulk transfers reach where the links bind (for_link): Open
# MPI's ring collectives over TCP (0.83-0.92 measured), our UDP aggregation (0.95-0.995). A fit
# on 4 emulated hosts gives 0.89 and 0.99; 8 hosts, held out, are then within 4.4%
# (docs/SCALE.md, "The model at scale").
COLLECTIVE_EFFICIENCY = 0.9
AGGREGATION_EFFICIENCY = 0.95


def switch_block(bs: int, layout: tuple[int, int]) -> int:
    """Elements per block the switch sums a tensor of ``bs``-blocks at: halved until a block's
    int32 values fit one packet (``layout``'s payload, what one slot holds; one pass of 64 by
    default): Session.switch_block's rule for a slot of one pass, all the model knows of it."""
    while bs > 1 and bs * 4 > layout[0]:
        bs //= 2
    return bs


@dataclass
class NetModel:
    allreduce: tuple[float, float]  # alpha (s), beta (s per byte of the tensor)
    allgather: tuple[float, float]  # alpha, beta per byte gathered (all ranks together)
    alltoall: tuple[float, float]  # alpha, beta per byte one rank sends
    decode_bps: float  # bytes per second of segment decoding on this host
    local_bps: float  # bytes per second of a tensor's mask scan plus zeroing its output
    source: str = "default"
    # Aggregation: seconds per round of the busiest slot (latency), per packet a rank sends
    # (one per round of every slot: host and aggregator work), per byte through the
    # aggregators (all ranks' blocks in, the sum out to each); and the layout (payload bytes
    # per packet, slots over all aggregators) that sets the rounds. None: no aggregators.
    omnireduce: tuple[float, float, float] | None = None
    omni_layout: tuple[int, int] = OMNI_LAYOUT
    # The same terms for aggregation in the switch (scheme "switch"), whose per-byte term is
    # per byte on the busiest worker link (no aggregator link carries n copies), and its
    # layout. Values are FIXED32 on the wire. None: no switch.
    switch: tuple[float, float, float] | None = None
    switch_layout: tuple[int, int] = SWITCH_LAYOUT
    # Set by for_link: the link rate the betas stand for, and the aggregators' own hosts (0: a
    # shard on every worker host, colocated), so that aggregation is costed by its busiest link
    # (the probe's fit sees only the links it ran on).
    link_bps: float | None = None
    aggregator_hosts: int = 0

    @staticmethod
    def default(layout: tuple[int, int] | None = None,
                switch_layout: tuple[int, int] | None = None) -> NetModel:
        # Conservative guess (about 1 GB/s links) used when probing is off.
        return NetModel((2e-4, 2e-9), (2e-4, 1e-9), (3e-4, 1e-9), 2e9, 4e9,
                        omnireduce=(5e-4, 2e-5, 1e-9) if layout else None,
                        omni_layout=layout or OMNI_LAYOUT,
                        switch=(5e-4, 2e-5, 1e-9) if switch_layout else None,
                        switch_layout=switch_layout or SWITCH_LAYOUT)

    @staticmethod
    def for_link(rate_bps: float, n: int, base: NetModel, aggregators: int = 0,
                 slots: int = Config.slots,
                 efficiency: tuple[float, float] = (COLLECTIVE_EFFICIENCY,
                                                    AGGREGATION_EFFICIENCY),
                 base_n: int | None = None) -> NetModel:
        """``base`` (a measured model) moved onto links of ``rate_bps`` bit/s with ``n``
        workers: each beta becomes the wire time of the bytes a rank must receive per byte of
        the term (ring allreduce 2 (n-1)/n, allgather (n-1)/n, alltoall's bytes already leave
        the rank) at the share of the link bulk transfers reach (``efficiency``: the
        collectives', aggregation's); latencies and CPU-side rates stay as measured.
        Aggregation is costed by its busiest link (``aggregation_link_blocks``) on
        ``aggregators`` hosts of their own, or 0: a shard on every worker host, ``slots``
        each. ``base_n``: the workers ``base`` was measured with; the collectives' latencies
        then grow as log2 n, as trees' and recursive doubling's do (what MPI and NCCL use where
        latency binds; 4 to 8 emulated hosts: allgather's 1.6x, allreduce's 2.2x), aggregation's
        do not (every worker streams to the aggregators at once)."""
        s = 8 / rate_bps  # seconds per byte on one link
        c, a = s / efficiency[0], s / efficiency[1]
        f = (n - 1) / n
        steps = math.log2(max(n, 2)) / math.log2(base_n) if base_n and base_n > 1 else 1.0
        latency, packet = base.omnireduce[:2] if base.omnireduce else (5e-4, 2e-5)  # default()
        return NetModel(
            (base.allreduce[0] * steps, 2 * f * c), (base.allgather[0] * steps, f * c),
            (base.alltoall[0] * steps, c),
            base.decode_bps, base.local_bps, source=f"link {rate_bps:g} bit/s, {n} workers",
            omnireduce=(latency, packet, a),
            omni_layout=(base.omni_layout[0] or OMNI_LAYOUT[0], slots * (aggregators or n)),
            switch=(*base.switch[:2], a) if base.switch else None,
            switch_layout=base.switch_layout, link_bps=rate_bps, aggregator_hosts=aggregators)


def aggregation_link_blocks(nnz: Sequence[float], union: float, hosts: int,
                            alone: Sequence[float] | None = None) -> float:
    """Blocks through the busiest link, one direction, of an aggregation of ``nnz`` blocks
    per rank whose ``union`` comes back to every rank, but for the ``alone[r]`` blocks rank r
    alone holds (its RESULTs leave them out: flag OWN; None: counted as none): each of
    ``hosts`` aggregator hosts takes 1/hosts of every rank's blocks and sends every rank
    1/hosts of what comes back to it; with 0 (colocated) host r's shard serves 1/n of the
    slots and its own rank's share stays local."""
    n = len(nnz)
    back = [union - a for a in alone] if alone is not None else [union] * n
    into, out = sum(nnz), sum(back)
    if hosts:
        return max(max(back, default=0), max(nnz, default=0), out / hosts, into / hosts)
    f = (n - 1) / n
    return max(max(c * f + (out - b) / n, (into - c) / n + b * f)
               for c, b in zip(nnz, back, strict=True))


def alone_blocks(nnz: Sequence[float], union: float) -> list[float]:
    """Expected blocks each rank alone holds (flag OWN: they do not come back to it), for ranks
    holding ``nnz`` blocks of a ``union``: as if each rank had placed its blocks independently
    at random among as many blocks as make the expected union ``union`` (exact in expectation
    for blocks so placed; the whole union shared: none alone; disjoint blocks: all alone).
    Where the ranks' blocks cluster (hot blocks most ranks hold, the rest scattered) it counts
    fewer alone than there are: more bytes back, the side that keeps aggregation from being
    picked where it loses. One rank alone gets its sums back: nothing counts as alone.

    Args:
        nnz: non-zero blocks of each rank.
        union: distinct non-zero blocks over all ranks.

    Returns:
        The expected blocks each rank alone holds, in the order of ``nnz``.
    """
    n, most = len(nnz), max(nnz, default=0.0)
    if n < 2 or most <= 0:
        return [0.0] * n
    if union >= sum(nnz):
        return [float(c) for c in nnz]
    if union <= most:
        return [0.0] * n

    def logs(s: float) -> list[float]:  # each rank's chance to miss a block, in logs
        return [math.log1p(-c * s) for c in nnz]

    # s: 1 / the blocks they are placed among. The expected union -expm1(sum(logs)) / s falls
    # from sum(nnz) (s -> 0) to `most` (s = 1 / most). Found first as if every rank held the
    # mean (bisection, a closed form per step), then by Newton's steps on the ranks' own
    # counts kept inside the bracket: O(n) a step, a few steps.
    mean = sum(nnz) / n
    a, b = 0.0, 1.0 / mean
    for _ in range(60):
        mid = (a + b) / 2
        a, b = (mid, b) if -math.expm1(n * math.log1p(-mean * mid)) / mid > union else (a, mid)
    lo, hi = 0.0, 1.0 / most
    s = min((a + b) / 2, hi * (1 - 1e-12))
    for _ in range(30):
        total = sum(logs(s))
        slope = -sum(c / (1 - c * s) for c in nnz)  # of the logs' sum
        e = -math.expm1(total)
        f = e / s - union
        lo, hi = (s, hi) if f > 0 else (lo, s)
        step = s - f * s * s / (-math.exp(total) * slope * s - e)
        s_next = step if lo < step < hi else (lo + hi) / 2
        done = abs(s_next - s) <= 1e-13 * s
        s = s_next
        if done:
            break
    each = logs(s)
    total = sum(each)
    return [c * math.exp(total - own) for c, own in zip(nnz, each, strict=True)]


def _median_time(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit(small: tuple[float, float], big: tuple[float, float]) -> tuple[float, float]:
    (b1, t1), (b2, t2) = small, big
    beta = max((t2 - t1) / (b2 - b1), 1e-12)
    return max(t1 - beta * b1, 1e-6), beta


def probe(comm: Collectives, omni: Callable[[int], float] | None = None,
          layout: tuple[int, int] = OMNI_LAYOUT, switch: Callable[[int], float] | None = None,
          switch_layout: tuple[int, int] = SWITCH_LAYOUT) -> NetModel:
    """Times the real collectives at two sizes (collective: every rank must call it);
    ``omni(numel, density)`` times one aggregation of a float32 tensor with that fraction of
    blocks non-zero (the same on every rank), when there are aggregators laid out as ``layout``;
    ``switch`` the same in the switch.
    """
    n = comm.size
    small, big = 256, 1 << 20  # float32 elements per rank

    def allreduce(k: int) -> float:
        x = torch.ones(k)
        return _median_time(lambda: comm.allreduce(x, f"hvd_sparse.probe.ar{k}").value())

    def allgather(k: int) -> float:
        x = torch.ones(k)
        return _median_time(lambda: comm.allgather(x, f"hvd_sparse.probe.ag{k}").value())

    def alltoall(k: int) -> float:
        x = torch.ones(k * n)
        return _median_time(
            lambda: comm.alltoall(x, [k] * n, f"hvd_sparse.probe.a2a{k}").value())

    model = NetModel(
        allreduce=_fit((small * 4, allreduce(small)), (big * 4, allreduce(big))),
        allgather=_fit((small * 4 * n, allgather(small)), (big * 4 * n, allgather(big))),
        alltoall=_fit((small * 4 * n, alltoall(small)), (big * 4 * n, alltoall(big))),
        decode_bps=_decode_speed(),
        local_bps=_local_speed(),
        source="probe",
    )
    if omni is not None:
        model.omnireduce = _fit_aggregation(omni, layout, (small, big), 2 * n)
        model.omni_layout = layout
    if switch is not None:
        model.switch = _fit_aggregation(switch, switch_layout, (small, big), 2,
                                        switch_block(256, switch_layout))
        model.switch_layout = switch_layout
    return model


def _fit_aggregation(timed: Callable[[int, float], float], layout: tuple[int, int],
                     sizes: tuple[int, int], copies: int, bs: int = 256) -> tuple[float, ...]:
    """t = latency * rounds + packet * slots * rounds + byte * bytes, from aggregations timed
    at two sizes dense and one sparse (dense probes alone cannot tell packets from bytes, both
    grow together), in float32 blocks of ``bs``. ``copies``: how many times a block crosses the
    link the bytes are on."""
    points = []
    for k, density in ((sizes[0], 1.0), (sizes[1], 1.0), (sizes[1], 1 / 32)):
        nblocks = k // bs
        nnz = max(1, round(density * nblocks))
        rounds = omni_rounds(nblocks, nnz, layout, 4, bs)
        points.append(((rounds, omni_slots(nblocks, layout, 4, bs) * rounds,
                        copies * nnz * bs * 4), timed(k, density)))
    return _fit_nonnegative(points)


def _fit_nonnegative(points: list[tuple[tuple[float, ...], float]]) -> tuple[float, ...]:
    """Least-squares coefficients >= 0 of t = sum(c_i * x_i): the best fit over the subsets of
    terms whose unconstrained solution is non-negative (a noisy probe must not give a term a
    negative cost); terms left out get a negligible 1e-12."""
    import itertools

    import numpy as np
    x = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    best, best_err = None, math.inf
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            c, *_ = np.linalg.lstsq(x[:, cols], t, rcond=None)
            if (c < 0).any():
                continue
            err = float(((x[:, cols] @ c - t) ** 2).sum())
            if err < best_err:
                coef = np.full(x.shape[1], 1e-12)
                coef[list(cols)] = c
                best, best_err = coef, err
    return tuple(max(float(v), 1e-12) for v in best)  # type: ignore[union-attr]


def omni_slots(nblocks: int, layout: tuple[int, int], esize: int = 4, bs: int = 256) -> int:
    """Slots a tensor of ``nblocks`` blocks uses (docs/PROTOCOL.md)."""
    payload, slots = layout
    return protocol.layout(nblocks, bs, esize, payload, slots)[1]


def packet_overhead(layout: tuple[int, int], nblocks: int, esize: int = 4,
                    bs: int = 256) -> float:
    """Aggregation packet bytes per block besides its values: its lane entry, and its share of
    the header and bitmap (docs/PROTOCOL.md)."""
    lanes = protocol.layout(nblocks, bs, esize, *layout)[0]
    return protocol.LANE_BYTES + (protocol.HEADER_BYTES + protocol.BITMAP_BYTES) / lanes


def omni_rounds(nblocks: int, union: float, layout: tuple[int, int], esize: int = 4,
                bs: int = 256) -> float:
    """Expected rounds of the busiest slot: a slot's lanes step together, so it takes as many
    rounds as its fullest lane has union blocks, plus the first (docs/PROTOCOL.md)."""
    payload, slots = layout
    lanes, nslots = protocol.layout(nblocks, bs, esize, payload, slots)
    positions = nblocks / (nslots * lanes)  # per lane
    u = min(1.0, union / max(1, nblocks))  # chance a position is in the union
    # the fullest lane (mean + 2 sd), plus round 0 unless it carries data anyway
    return max(1.0, positions * u + 2 * math.sqrt(positions * u * (1 - u)) + 1 - u)


def _decode_speed() -> float:
    t = torch.zeros(1 << 20)
    t[:: 2048] = 1.0  # every 8th block non-zero
    seg = encode(t, 256, 1)
    acc = torch.zeros(t.numel())
    secs = _median_time(lambda: decode_sum(seg, acc, 256, 1, 0, t.numel(), 1, False), reps=3)
    return seg.numel() / max(secs, 1e-9)


def _local_speed() -> float:
    """Per-call work every sparse scheme does on the whole tensor: scan it, zero the output."""
    t = torch.zeros(1 << 22)
    secs = _median_time(lambda: (block_mask(t, 256), torch.zeros(t.numel())), reps=3)
    return t.numel() * 4 / max(secs, 1e-9)


def _cache_path(comm: Collectives, cache_dir: str, aggregators: str) -> Path:
    hosts = sorted(comm.allgather_object(socket.gethostname(), "hvd_sparse.probe.hosts"))
    key = json.dumps([hosts, comm.size, comm.kind, torch.__version__, os.cpu_count(),
                      torch.get_num_threads(), aggregators, 4])  # 4: version of the fields
    return Path(cache_dir) / f"netmodel-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def load_or_probe(comm: Collectives, mode: str, cache_dir: str,
                  omni: Callable[[int], float] | None = None,
                  layout: tuple[int, int] = OMNI_LAYOUT, aggregators: str = "",
                  switch: Callable[[int], float] | None = None,
                  switch_layout: tuple[int, int] = SWITCH_LAYOUT,
                  switch_name: str = "") -> NetModel:
    """The job's network model, identical on every rank (rank 0's cache or a fresh probe).
    ``aggregators`` and ``switch_name`` describe what the cached ``omni`` and ``switch``
    timings belong to."""
    if mode == "off" or comm.size == 1:
        return NetModel.default(layout if omni is not None else None,
                                switch_layout if switch is not None else None)
    path = _cache_path(comm, cache_dir, f"{aggregators}|{switch_name}")
    cached = None
    if comm.rank == 0 and mode == "auto" and path.exists():
        try:
            if time.time() - path.stat().st_mtime < CACHE_MAX_AGE:
                d = json.loads(path.read_text())
                cached = NetModel(
                    **{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
        except (OSError, ValueError, TypeError):
            cached = None
    cached = comm.broadcast_object(cached, "hvd_sparse.probe.cached")
    if cached is not None:
        return cached
    model = comm.broadcast_object(probe(comm, omni, layout, switch, switch_layout),
                                  "hvd_sparse.probe.model")
    if comm.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(asdict(model)))
        except OSError as e:
            log.warning("hvd_sparse: cannot cache the network model at %s: %s", path, e)
    return model


# Device-host copies where none was probed: a PCIe 4.0 x16 link's pageable copies, about.
BUS_BPS = 10e9


@dataclass(frozen=True)
class DeviceRoute:
    """A device tensor's two ways under the DDP hook: dense by the model's own process group,
    where the tensor is (NCCL's allreduce on a GPU), or its non-zero blocks staged across the
    bus to the host's schemes and the result's back (staging.py)."""

    dense: tuple[float, float]  # the group's allreduce: alpha (s), beta (s per byte)
    bus_bps: float  # bytes per second of a device-host copy
    source: str = "default"


def probe_route(allreduce: Callable[[int], object], to_host: Callable[[int], object],
                agree: Callable[[list[float]], list[float]]) -> DeviceRoute:
    """Times a device group's allreduce at two sizes and a device-host copy (collective over
    that group, like ``probe``).

    Args:
        allreduce: runs the group's allreduce of that many float32 elements to completion.
        to_host: copies that many float32 elements from the device to the host.
        agree: the slowest rank's times, alike on every rank (an allreduce of the maximum).

    Returns:
        The route, alike on every rank.
    """
    small, big = 256, 1 << 20
    times = agree([_median_time(lambda: allreduce(small), 3),
                   _median_time(lambda: allreduce(big), 3),
                   _median_time(lambda: to_host(big), 3)])
    return DeviceRoute(_fit((small * 4, times[0]), (big * 4, times[1])),
                       big * 4 / max(times[2], 1e-9), "probe")


@dataclass(frozen=True)
class Prediction:
    """What the model expects of each scheme for one tensor."""

    seconds: dict[str, float]  # scheme -> predicted wall time
    received: dict[str, float]  # scheme -> bytes each rank receives


def predict(
    m: NetModel, numel: int, esize: int, bs: int, nnz: Sequence[int], union: float | None,
    route: DeviceRoute | None = None,
) -> Prediction:
    """Predicted cost of each scheme for a tensor whose ranks hold ``nnz`` non-zero blocks.

    ``union`` is the expected number of distinct non-zero blocks over all ranks; when unknown it
    is estimated as if blocks were placed independently at random. With a device ``route`` (a
    device tensor under the DDP hook), dense is its group's allreduce where the tensor is, and
    every other scheme pays for the busiest rank's blocks across the bus and the union's back.
    """
    n = len(nnz)
    nblocks = max(1, blocks.num_blocks(numel, bs))
    block = bs * esize
    if union is None:
        union = nblocks * (1 - math.prod(1 - c / nblocks for c in nnz))
    union = min(float(nblocks), max(union, float(max(nnz, default=0))))

    nbytes = numel * esize
    dense = m.allreduce[0] + m.allreduce[1] * nbytes
    if route is not None:
        dense = route.dense[0] + route.dense[1] * nbytes
    local = nbytes / m.local_bps  # scan and output zeroing: every sparse scheme pays it

    gathered = sum(SEGMENT + c * (4 + block) for c in nnz)
    allgather = local + m.allgather[0] + m.allgather[1] * gathered + gathered / m.decode_bps

    # Only (n-1)/n of a rank's blocks leave it in the alltoall.
    sent = max(n * SEGMENT + c * (4 + block) * (n - 1) / n for c in nnz)
    per_part = union / n
    part_bytes = SEGMENT + min(4 * per_part, nblocks / n / 8) + per_part * block
    zen = (local + m.alltoall[0] + m.alltoall[1] * sent + sent / m.decode_bps
           + m.allgather[0] + m.allgather[1] * n * part_bytes + n * part_bytes / m.decode_bps)
    p = Prediction(
        seconds={"dense": dense, "allgather": allgather, "zen": zen},
        received={"dense": 2 * (n - 1) / n * nbytes, "allgather": gathered * (n - 1) / n,
                  "zen": sent + n * part_bytes * (n - 1) / n})
    if m.omnireduce is not None or m.switch is not None:
        # what a RESULT leaves out for each rank: the blocks it alone holds (flag OWN)
        alone = alone_blocks(nnz, union)
        back = union - min(alone, default=0.0)  # the busiest rank's blocks back
    if m.omnireduce is not None:
        # Every rank's blocks into the aggregators, the union but its own alone back out to
        # every rank; on a link model, only what the busiest link carries.
        blocks_through = (aggregation_link_blocks(nnz, union, m.aggregator_hosts, alone)
                          if m.link_bps else sum(nnz) + n * union - sum(alone))
        through = blocks_through * (block + packet_overhead(m.omni_layout, nblocks, esize, bs))
        rounds = omni_rounds(nblocks, union, m.omni_layout, esize, bs)
        packets = omni_slots(nblocks, m.omni_layout, esize, bs) * rounds
        latency, packet, per_byte = m.omnireduce
        p.seconds["omnireduce"] = local + latency * rounds + packet * packets + per_byte * through
        p.received["omnireduce"] = back * block
    if m.switch is not None:
        # FIXED32 on the wire, in the switch's finer blocks (each non-zero block counted as
        # that many non-zero finer ones). Each worker link carries its own blocks in and the
        # union out, but for what it alone held where a packet is one block (the switch
        # flags a packet OWN, not a lane); the scale costs one tiny allreduce first.
        sb = switch_block(bs, m.switch_layout)
        finer, snblocks = bs // sb, max(1, blocks.num_blocks(numel, sb))
        sunion = min(float(snblocks), union * finer)
        lanes = protocol.layout(snblocks, sb, 4, *m.switch_layout)[0]
        sback = sunion - (min(alone, default=0.0) * finer if lanes == 1 else 0.0)
        wire = sb * 4 + packet_overhead(m.switch_layout, snblocks, 4, sb)
        busiest = max(max(nnz, default=0) * finer, sback) * wire
        rounds = omni_rounds(snblocks, sunion, m.switch_layout, 4, sb)
        packets = omni_slots(snblocks, m.switch_layout, 4, sb) * rounds
        latency, packet, per_byte = m.switch
        p.seconds["switch"] = (local + m.allreduce[0] + latency * rounds + packet * packets
                               + per_byte * busiest)
        p.received["switch"] = sback * sb * 4
    if route is not None:
        staged = (max(nnz, default=0) + union) * (4 + block) / route.bus_bps
        for k in p.seconds:
            if k != "dense":
                p.seconds[k] += staged
    return p


def choose(p: Prediction) -> str:
    """The fastest scheme, sparse only when clearly faster and moving far fewer bytes than dense."""
    t = p.seconds
    best = min((s for s in t if s != "dense"), key=t.__getitem__)
    if t[best] < MARGIN * t["dense"] and p.received[best] < MAX_BYTES_RATIO * p.received["dense"]:
        return best
    return "dense"
