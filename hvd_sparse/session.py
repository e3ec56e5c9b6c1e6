"""The aggregation session: this rank's worker engine joined to the job's aggregators.

``start`` (called by ``hvd_sparse.init``, collective) joins the configured aggregators or starts
the job's own (aggregator.LocalAggregators: on rank 0's host when the job runs on one host, a
shard on every host when it spans several), agrees with every rank on the job token and the
path MTU, and registers. The omnireduce scheme submits tensors to the resulting
``Session``. ``join_switch`` does the same with the switch that aggregates in the network
(scheme "switch"): fixed point, packets a switch slot can hold, one tensor at a time. Tensors
are named on the wire by a hash of their name and how often that name was reduced, so every
rank derives the same id whatever order it submits in.
"""
from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import os
import random
import socket
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import auth, costmodel, logs, protocol, runfile, switch_control
from ._C import AggregatorTimeout, OmniWorker, set_threads
from .aggregator import LocalAggregators
from .comm import Collectives
from .config import Config, format_address
from .errors import HvdSparseError
from .fixedpoint import exponent

log = logging.getLogger("hvd_sparse")


RETRY_EVERY = 16  # calls of a tensor name between looks at aggregators that went down
PROBE_AGAIN = 1.0  # seconds: a lost aggregator's name is resolved and asked again at most so often


@dataclass(frozen=True)
class Membership:
    """Which membership of a job a session is (docs/PROTOCOL.md "Memberships"): the job's
    token, the same for all its memberships, and its epoch, alike on every rank of one
    membership and larger for each later one, which every packet carries so that aggregators
    and the switch drop an earlier membership's."""

    token: int
    epoch: int


def agree_membership(comm: Collectives, previous: Membership | None, what: str) -> Membership:
    """The membership the ranks of ``comm`` form now (collective, one allgather).

    The token and epoch come from the rank that has seen the latest membership: its token, and
    its epoch plus one, so that the epoch exceeds every earlier membership's that a rank of this
    one took part in, whichever ranks survived, fresh processes (``previous`` None) among them.
    When no rank was in one, rank 0 draws a new token and the epoch is 1.

    Args:
        comm: the job's collectives (all ranks).
        previous: this rank's latest membership of the job (None: a fresh process).
        what: "omni" or "switch": names the collective.

    Returns:
        The membership, the same on every rank.
    """
    fresh = random.SystemRandom().getrandbits(63) | 1 if comm.rank == 0 else 0
    seen = (previous.epoch, previous.token) if previous is not None else (0, 0)
    votes = comm.allgather_object((*seen, fresh), f"hvd_sparse.{what}.membership")
    epoch, token = max((e, t) for e, t, _ in votes)  # ties (no rank was in one): alike anyway
    return Membership(token if epoch else votes[0][2], epoch + 1)


def _agree(comm: Collectives, memberships: dict[str, Membership] | None,
           what: str) -> Membership:
    """``agree_membership`` from ``memberships[what]``, recorded there."""
    member = agree_membership(comm, (memberships or {}).get(what), what)
    if memberships is not None:
        memberships[what] = member
    return member


class Session:
    """This rank's worker engine, joined to the job's aggregators."""

    def __init__(self, cfg: Config, comm: Collectives, addrs: list[tuple[str, int]],
                 token: int, local: LocalAggregators | None, max_datagram: int | None = None,
                 switch: bool = False, key: bytes = b"", placement: str = "remote",
                 control: switch_control.Client | None = None, epoch: int = 1,
                 memberships: dict[str, Membership] | None = None) -> None:
        self.cfg, self.addrs, self.local, self.switch = cfg, addrs, local, switch
        self.token, self.control = token, control  # control: the switch's, where rank 0 installed
        self.membership = Membership(token, epoch)
        self._memberships = memberships  # the caller's record, moved on at each regroup
        # every aggregator of the job as named; ``addrs``: those in use, ``lost``: the others,
        # which stopped answering and are asked again (``votes``) until they answer
        self.names, self.lost = list(addrs), []
        # a probe per aggregator asked (``probe``): its worker, the address it reaches, when
        self._probes: dict[tuple[str, int], tuple[OmniWorker | None, str, float]] = {}
        # where the aggregators run, alike on every rank: "remote" (configured), "rank0" (the
        # job's own, all on rank 0's host), "colocated" (the job's own, on every host), "switch"
        self.placement = "switch" if switch else placement
        # Block values per packet: the configured fusion, cut so that a whole packet (header,
        # bitmap, up to MAX_LANES lane entries) fits one frame of the path: an IP fragment
        # lost on a busy link loses the whole datagram. (A switch's REGACK cuts it further, to
        # what one of its slots holds: the worker engine does that at register.)
        max_datagram = max_datagram or protocol.MAX_DATAGRAM
        payload = max(1, min(cfg.payload_bytes, max_datagram - protocol.HEADER_BYTES
                             - protocol.BITMAP_BYTES - protocol.MAX_LANES * protocol.LANE_BYTES
                             - (protocol.AUTH_BYTES if key else 0)))
        # A switch sums one tensor at a time (see Turns)
        self.turns = Turns() if switch else None
        # The engine's own no-progress timeout fires a little before the caller's, so the error
        # names the aggregator rather than only the tensor.
        self.size = comm.size
        self._worker_options = dict(
            token=token, worker=comm.rank, nworkers=comm.size, payload_bytes=payload,
            slots_per_aggregator=cfg.slots, rto=cfg.rto, timeout=cfg.timeout * 0.9,
            seed=comm.rank, key=key, ports=cfg.port_range())
        self.worker = OmniWorker(addrs, epoch=epoch, **self._worker_options)
        self._calls: dict[str, int] = defaultdict(int)
        # Aggregation is down after an aggregator timed out (``down`` says how), until the
        # aggregators answer keep-alives again: see omnireduce.run.
        self.down, self.down_since = "", 0.0
        self._down_calls: dict[str, int] = defaultdict(int)

    def tensor_id(self, name: str) -> int:
        self._calls[name] += 1
        digest = hashlib.blake2b(f"{name}#{self._calls[name]}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") | 1  # never 0: ids name tensors, 0 names none

    def mark_down(self, why: str) -> None:
        self.down, self.down_since = why, time.monotonic()
        self._down_calls.clear()

    def retry_due(self, name: str) -> bool:
        """While down or with aggregators lost, every RETRY_EVERY-th call of each tensor name
        looks again: the same calls on every rank, whatever order the ranks submit tensors
        in."""
        self._down_calls[name] += 1
        return self._down_calls[name] % RETRY_EVERY == 0

    def answered_since_down(self) -> bool:
        """Whether every aggregator has answered a keep-alive (REGACK) since going down."""
        ago = time.monotonic() - self.down_since
        return all(a["heard_ago"] < ago for a in self.worker.stats()["aggregators"])

    def votes(self) -> list[int]:
        """This rank's view, at a look, of each aggregator of ``names``: 1 where it answers.

        One in use answers while aggregation is up. Any other (lost, or in use while down)
        answers when it answered this rank's probe (``probe``); probes go again to those that
        have not, at most every ``PROBE_AGAIN`` seconds."""
        now, votes = time.monotonic(), []
        for addr in self.names:
            if addr in self.addrs and not self.down:
                votes.append(1)
                continue
            probe, _, sent = self._probes.get(addr, (None, "", -math.inf))
            votes.append(int(probe is not None and
                             probe.stats()["aggregators"][0]["heard_ago"] < now - sent))
            if not votes[-1] and now - sent > PROBE_AGAIN:
                self._probe(addr)
        return votes

    def probe(self) -> None:
        """Asks every aggregator not in use, and those in use while down, whether it answers
        (``votes`` reads the answers at the next look). Only where the ranks regroup together
        (fallback="dense"): a probe moves the aggregator it reaches to the next epoch."""
        for addr in self.names:
            if addr not in self.addrs or self.down:
                self._probe(addr)

    def _probe(self, addr: tuple[str, int]) -> None:
        """A REGISTER to ``addr`` from a worker of its own, under the membership's next epoch
        (the regroup takes the one after); a new worker when the name resolves elsewhere now
        (an aggregator rescheduled under its name), else the same, so that the aggregator,
        which pins a worker's address per epoch, answers it."""
        probe, ip, _ = self._probes.pop(addr, (None, "", 0.0))
        sent = time.monotonic()  # before the REGISTER: on loopback its REGACK beats any later read
        try:
            now_ip = resolve(addr[0])
            if probe is not None and now_ip != ip:
                probe.close()
                probe = None
            if probe is None:
                ip = now_ip
                self._record(Membership(self.token, self.membership.epoch + 1))
                probe = OmniWorker([addr], epoch=self.membership.epoch + 1,
                                   **self._worker_options)
            probe.register(0.0)  # sends, waits for nothing: the answer counts at a look
        except AggregatorTimeout:
            pass
        except (OSError, RuntimeError) as e:  # a name that does not resolve (yet), a refusal
            log.debug("hvd_sparse: probing aggregator %s: %s", format_address(*addr), e)
        self._probes[addr] = (probe, ip, sent)

    def _record(self, member: Membership) -> None:
        """Tells the caller's record of memberships (``start``) that ``member``'s epoch was
        used, so that the job's next join takes a later one: an aggregator pins each worker's
        address per epoch, a probe's too."""
        key = "switch" if self.switch else "omni"
        if self._memberships is not None and (key not in self._memberships or
                                              self._memberships[key].epoch < member.epoch):
            self._memberships[key] = member

    def _close_probes(self) -> None:
        for probe, _, _ in self._probes.values():
            if probe is not None:
                probe.close()
        self._probes.clear()

    def regroup(self, addrs: list[tuple[str, int]]) -> str:
        """Aggregation over ``addrs`` (a subset of ``names``, alike on every rank) from now on:
        a new worker, its names resolved anew, registered under the next epoch of the job's
        membership (the aggregators then drop what the old one still had in flight; its
        tensors fail at once). Collective: every rank regroups at the same look.

        Returns:
            "" once registered, else why not (the caller agrees with the other ranks).
        """
        member = Membership(self.token, self.membership.epoch + 2)  # the probes took the next
        self.membership = member
        self._record(member)
        self.worker.close()
        self.addrs = list(addrs)
        self.lost = [a for a in self.names if a not in addrs]
        self._close_probes()
        self._down_calls.clear()
        try:
            self.worker = OmniWorker(self.addrs, epoch=member.epoch, **self._worker_options)
            # Half the timeout: the peers wait for this rank's verdict in a collective that
            # times out after the whole of it. Every rank's probe was just answered.
            self.worker.register(self.cfg.timeout / 2)
        except RuntimeError as e:
            return f"regrouping over {self.addrs}: {e}"
        return ""

    @property
    def payload(self) -> int:
        """Bytes of block values per packet, as the worker engine sends them."""
        return self.worker.payload_bytes()

    def layout(self) -> tuple[int, int]:
        """(payload bytes per packet, slots over all aggregators): what sets a tensor's rounds."""
        return self.payload, self.worker.slots_per_aggregator() * len(self.addrs)

    def switch_block(self, bs: int) -> int:
        """``bs`` halved until a packet's values (int32) fit one slot's cells, a pass per
        `values` of a lane: the switch's geometry, from its REGACK (unchanged without one)."""
        values, cells = self.worker.slot_geometry()
        while values and bs > 1 and (protocol.layout(1, bs, 4, self.payload, 1)[0]
                                     * math.ceil(bs / values) > cells):
            bs //= 2
        return bs

    def link_hosts(self) -> int:
        """The hosts whose links carry the aggregation (costmodel.aggregation_link_blocks):
        the configured aggregators' hosts, 1 for rank 0's, 0 for a shard on every worker host."""
        if self.placement == "colocated":
            return 0
        return len({host for host, _ in self.addrs})

    def describe(self) -> str:
        """What the probe's timings depend on: how many aggregators, where, fusion."""
        return f"{len(self.addrs)}x{self.placement}/{self.layout()}"

    def probe_time(self, numel: int, density: float = 1.0, reps: int = 3) -> float:
        """Median seconds of aggregating a float32 tensor with ``density`` of its 256-blocks
        (a switch: the blocks its scheme would send, `switch_block`) non-zero, the same blocks
        on every rank (collective)."""
        bs = self.switch_block(256)
        x, times = torch.zeros(numel // bs, bs), []
        g = torch.Generator().manual_seed(0)
        x[torch.randperm(x.shape[0], generator=g)[:max(1, round(density * x.shape[0]))]] = 1
        x = x.view(-1)
        for _ in range(reps + 1):
            out = torch.zeros_like(x)  # only the union's blocks are written
            t0 = time.perf_counter()
            ticket = self.worker.submit(
                self.tensor_id(f"hvd_sparse.probe.omni{numel}.{density}"), x, out, bs, 0, None,
                "probe", 1.0, exponent(1.0, self.size) if self.switch else None)
            self.worker.wait(ticket, self.cfg.timeout)
            self.worker.finish(ticket)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def close(self) -> None:
        self.worker.close()
        self._close_probes()
        if self.local is not None:
            self.local.stop()
        if self.control is not None:  # the job's groups back to the switch's pool
            try:  # unless a later membership installed the job again meanwhile
                self.control.remove(self.token, self.membership.epoch)
            except switch_control.ControlError as e:
                log.warning("hvd_sparse: removing the job from the switch: %s", e)


class Turns:
    """The order in which tensors go through a switch, one at a time, the same on every rank.

    A switch binds each (tensor, slot) to a register group and drops what finds the group
    taken until it is released; two tensors streaming at once could each hold a group the
    other's laggard worker needs, with that worker's window full of dropped packets. So rank 0
    numbers the tensors as they come (``issue``), every rank learns the number from the
    tensor's scale agreement, and a tensor streams only after all lower numbers are ``done``.
    """

    def __init__(self) -> None:
        self.issued = 0  # rank 0: numbers handed out
        self.next = 0  # the number whose turn it is
        self._done: set[int] = set()

    def issue(self) -> int:
        self.issued += 1
        return self.issued - 1

    def mine(self, number: int) -> bool:
        return self.next == number

    def done(self, number: int) -> None:
        self._done.add(number)
        while self.next in self._done:
            self._done.remove(self.next)
            self.next += 1


def join_switch(cfg: Config, comm: Collectives,
                memberships: dict[str, Membership] | None = None) -> Session | None:
    """Joins the switch named by ``switch`` (collective over ``comm``, all ranks). None when no
    switch is configured or it refuses the job on some rank (the reason is logged: the switch
    scheme then falls back). ``memberships``: as for ``start``, under "switch"."""
    addr = cfg.switch_address()
    if addr is None:
        return None
    member = _agree(comm, memberships, "switch")
    token = member.token
    mtu = comm.allreduce(torch.tensor([_max_datagram(*addr)]), "hvd_sparse.switch.mtu",
                         "min").value()
    control = _install_on_switch(cfg, comm, member, addr) if cfg.switch_control else None
    if isinstance(control, str):
        log.warning("hvd_sparse: the switch at %s cannot aggregate this job (%s); scheme "
                    "'switch' falls back", format_address(*addr), control)
        return None
    session = _open(cfg, comm, [addr], token, None, int(mtu), switch=True, control=control,
                    epoch=member.epoch)
    why = ""
    try:
        session.worker.register(cfg.timeout)
    except RuntimeError as e:
        why = str(e)
    refused = comm.allgather_object(why, "hvd_sparse.switch.registered")
    if any(refused):
        session.close()
        rank, why = next((r, w) for r, w in enumerate(refused) if w)
        log.warning("hvd_sparse: the switch at %s cannot aggregate this job (rank %d: %s); "
                    "scheme 'switch' falls back", format_address(*addr), rank, why)
        return None
    log.debug("hvd_sparse: switch %s joined", format_address(*addr))
    return session


def _install_on_switch(cfg: Config, comm: Collectives, member: Membership,
                       addr: tuple[str, int]) -> switch_control.Client | str | None:
    """Rank 0 installs the job on the switch's control plane with every worker's address (the
    one its REGISTER will come from), so that the switch takes the job's packets from those
    hosts only; at the membership's epoch, which replaces an earlier membership's install (its
    groups freed, its stragglers' packets dropped). Collective. Returns the client on rank 0
    (None elsewhere), or why the switch refused the job (on every rank)."""
    try:
        ip = _address_toward([[addr[0]]])
    except HvdSparseError:
        ip = ""  # told below, alike on every rank
    ips = comm.allgather_object(ip, "hvd_sparse.switch.ips")
    why, client = "", None
    if comm.rank == 0 and "" in ips:
        why = f"rank {ips.index('')} has no route to {addr[0]}"
    elif comm.rank == 0:
        client = switch_control.Client(cfg.switch_control)
        try:
            lim = client.limits()
            # an earlier membership's groups come back at the install
            free = lim["groups"] - sum(j["groups"] for j in client.jobs()) + sum(
                j["groups"] for j in client.jobs(member.token))
            client.install(member.token, comm.size, max(1, min(lim["groups"] // 4, free)), ips,
                           epoch=member.epoch)
        except switch_control.ControlError as e:
            why = str(e)
    why = comm.broadcast_object(why, "hvd_sparse.switch.installed")
    return why or client


def start(cfg: Config, comm: Collectives, memberships: dict[str, Membership] | None = None
          ) -> Session | None:
    """Joins the configured aggregators or, when none are, starts the job's own (``_local``).
    Collective over ``comm``, all ranks of the job. ``memberships``: this rank's latest
    memberships of the job, by what they joined ("omni" here), read and updated in place as
    soon as the ranks agree on the new one (even if the join fails after, a retry then takes a
    later epoch); None or empty: a fresh process. Returns None when aggregation is off."""
    if not cfg.aggregates():
        return None
    addrs = cfg.aggregator_list()
    member = _agree(comm, memberships, "omni")
    token = member.token
    local, placement = None, "remote"
    if not addrs:
        addrs, local, placement = _local(cfg, comm, token)
    try:
        key = _job_key(cfg, comm, local, token) if cfg.auth else b""
    except HvdSparseError:
        if local is not None:
            local.stop()
        raise
    # Every rank must lay tensors out alike: the smallest path MTU of any rank decides.
    mtu = comm.allreduce(torch.tensor([min(_max_datagram(h, p) for h, p in addrs)]),
                         "hvd_sparse.omni.mtu", "min").value()
    try:
        session = _open(cfg, comm, addrs, token, local, int(mtu), key=key, placement=placement,
                        epoch=member.epoch, memberships=memberships)
    except HvdSparseError:
        if local is not None:
            local.stop()
        raise
    try:
        _register(cfg, comm, session)
    except HvdSparseError as e:
        session.close()
        hint = ""
        if placement == "remote" and "did not answer" in str(e):
            hint = (" (authentication is " + (
                "on: the aggregators must run with --secret-file naming the secret of "
                "HVD_SPARSE_SECRET_FILE" if key else
                "off: the aggregators must run without --secret-file") + ")")
        raise HvdSparseError(f"{e}{hint}") from e
    log.debug("hvd_sparse: omnireduce aggregators (%s) %s", placement, session.addrs)
    return session


def _register(cfg: Config, comm: Collectives, session: Session) -> None:
    """Registers every rank with the session's aggregators (collective). Those that some rank
    did not hear from within the timeout are left out on every rank, with a warning: the job
    goes on with the others (``Session.regroup``).
    Raises HvdSparseError on every rank when an aggregator refused the job or none answered."""
    why = ""
    try:
        session.worker.register(cfg.timeout)
    except AggregatorTimeout as e:
        why = str(e)
    except RuntimeError as e:  # a refusal: the job cannot run there, whatever the others do
        why = f"refused: {e}"
    heard = [int(a["heard_ago"] < math.inf) for a in session.worker.stats()["aggregators"]]
    replies = comm.allgather_object((heard, why), "hvd_sparse.omni.registered")
    refused = [f"rank {r}: {w[len('refused: '):]}" for r, (_, w) in enumerate(replies)
               if w.startswith("refused: ")]
    if refused:
        raise HvdSparseError("hvd_sparse: " + "; ".join(refused))
    live = [a for k, a in enumerate(session.addrs) if all(h[k] for h, _ in replies)]
    if live == session.addrs:
        return
    rank, first = next((r, w) for r, (_, w) in enumerate(replies) if w)
    if not live:
        raise HvdSparseError(f"hvd_sparse: no aggregator answered every rank (rank {rank}: "
                             f"{first})")
    log.warning("hvd_sparse: aggregator(s) %s did not answer every rank (rank %d: %s); the "
                "job aggregates over the %d others, and takes them back once they answer (at "
                "a look with fallback='dense', else at the next join)",
                [format_address(h, p) for h, p in session.addrs if (h, p) not in live],
                rank, first, len(live))
    why = session.regroup(live)
    whys = [w for w in comm.allgather_object(why, "hvd_sparse.omni.regrouped") if w]
    if whys:
        raise HvdSparseError("hvd_sparse: " + "; ".join(whys))


def _open(cfg: Config, comm: Collectives, *args: Any, **kw: Any) -> Session:
    """``Session(cfg, comm, *args, **kw)`` on every rank, or HvdSparseError on every rank when
    a worker's socket did not open on some (collective: one rank's lone failure would leave the
    others waiting for it at the aggregators)."""
    session, why = None, ""
    try:
        session = Session(cfg, comm, *args, **kw)
    except RuntimeError as e:
        why = f"rank {comm.rank}: {e}"
    whys = [w for w in comm.allgather_object(why, "hvd_sparse.omni.opened") if w]
    if whys:
        if session is not None:
            session.worker.close()
        raise HvdSparseError("hvd_sparse: a worker's socket did not open: " + "; ".join(whys))
    assert session is not None
    return session


def _local(cfg: Config, comm: Collectives, token: int
           ) -> tuple[list[tuple[str, int]], LocalAggregators | None, str]:
    """The job's own aggregators (collective): (their addresses in the same order on every
    rank, those this rank started, "rank0" or "colocated").

    A host here is a network stack (kernel boot id and network namespace): ranks may share a
    hostname and still be apart (containers, the testbed's namespaces), so neither the
    hostname nor Horovod's local_rank tells them apart. On one host, rank 0 starts them all on
    loopback. Colocated (OmniReduce's layout), each host's lowest rank starts a shard and slots
    are spread over all shards (the worker engine puts slot g on aggregator g % K), so every
    host link carries about the same bytes, where one aggregator host would carry every
    worker's traffic. The shards must derive the job's key alike: rank 0 hands them one fresh
    secret, wrapped as the key is (auth.share_secret)."""
    where = comm.allgather_object(_whereabouts(), "hvd_sparse.omni.where")
    hosts: dict[tuple, list[int]] = defaultdict(list)
    for r, w in enumerate(where):
        hosts[tuple(w[:2])].append(r)  # in rank order: the first of each is its lowest
    together = len(hosts) == 1
    colocated = not together and cfg.aggregator_layout in ("auto", "colocated")
    mine = hosts[tuple(where[comm.rank][:2])]
    starters = [h[0] for h in hosts.values()] if colocated else [0]
    secret = None
    if cfg.auth and colocated:
        raw = auth.share_secret(comm, os.urandom(auth.SHARD_SECRET_BYTES)
                                if comm.rank == 0 else None, token, starters)
        secret = raw.hex().encode() if raw is not None else None
    local, reply = None, None
    if comm.rank in starters:
        count = cfg.local_aggregators
        if count < 0:
            count = max(1, (len(mine) if colocated else comm.size) // 4)
        try:
            others = [w[2] for r, w in enumerate(where) if r not in mine]
            host = cfg.aggregator_host or ("127.0.0.1" if together else _address_toward(others))
            local = LocalAggregators(count, comm.size, _bind_address(host),
                                     secret=secret or cfg.auth, ports=cfg.port_range())
            reply = [(host, p) for p in local.ports]
        except (HvdSparseError, OSError) as e:  # every rank must hear of it, not wait
            reply = f"rank {comm.rank}: {e}"
    replies = comm.allgather_object(reply, "hvd_sparse.omni.addrs")
    why = [r for r in replies if isinstance(r, str)]
    addrs = [tuple(a) for r in replies if isinstance(r, list) for a in r]
    if not why and colocated and len({h for h, _ in addrs}) < len(starters):
        why = [f"the hosts' aggregators share addresses ({addrs}): with aggregator_layout "
               "colocated each host advertises its own (HVD_SPARSE_AGGREGATOR_HOST per host, "
               "or empty)"]
    if why:
        if local is not None:
            local.stop()
        raise HvdSparseError("hvd_sparse: the job's aggregators did not start: "
                             + "; ".join(why))
    return addrs, local, "colocated" if colocated else "rank0"  # type: ignore[return-value]


def _job_key(cfg: Config, comm: Collectives, local: LocalAggregators | None,
             token: int) -> bytes:
    """The job's key on every rank (collective): rank 0 derives it from the local aggregators'
    fresh secret or the configured secret file, and hands it over (auth.agree)."""
    why, key = "", None
    if comm.rank == 0:
        try:
            if local is not None:
                secret = local.secret
            elif cfg.secret_file:
                secret = auth.read_secret_file(cfg.secret_file)
            else:
                raise HvdSparseError(
                    "hvd_sparse: authentication is on (HVD_SPARSE_AUTH) and the aggregators "
                    "are configured (HVD_SPARSE_AGGREGATORS): set HVD_SPARSE_SECRET_FILE to the "
                    "secret file they run with (--secret-file), or HVD_SPARSE_AUTH=0 where no "
                    "other host reaches the network (docs/PROTOCOL.md, Authentication)")
            key = auth.job_key(secret, token)
        except HvdSparseError as e:
            why = str(e)
    why = comm.broadcast_object(why, "hvd_sparse.auth.ready")
    if why:
        raise HvdSparseError(why)
    return auth.agree(comm, key, token)


def join_all(cfg: Config, comm: Collectives, memberships: dict[str, Membership] | None = None
             ) -> tuple[Session | None, Session | None, costmodel.NetModel]:
    """What either front end does at start, collective over ``comm`` (all ranks of the job):
    the codec's threads (ranks sharing a host share its cores; more threads than that make
    every loop crawl), the library logger's level and rank, the aggregators and the switch
    joined, the network model, and the run file (``metrics_file``). ``memberships``: this
    rank's latest memberships ("omni", "switch"), kept by the caller to join the job again
    (Horovod elastic) under its token at a later epoch; updated in place (``start``)."""
    logs.configure(cfg.log_level, comm.ranks[comm.rank])
    set_threads(cfg.threads or max(1, (os.cpu_count() or 1) // comm.local_size()))
    omni = switch = None
    try:
        omni = start(cfg, comm, memberships)
        switch = join_switch(cfg, comm, memberships)
        net = costmodel.load_or_probe(
            comm, cfg.probe, cfg.cache_dir, omni.probe_time if omni else None,
            layout=omni.layout() if omni else (0, 0),
            aggregators=omni.describe() if omni else "",
            switch=switch.probe_time if switch else None,
            switch_layout=switch.layout() if switch else (0, 0),
            switch_name=switch.describe() if switch else "")
    except BaseException:  # (a collective failed: the caller may join again, e.g. elastic)
        for joined in (omni, switch):
            if joined is not None:
                joined.close()
        raise
    log.debug("hvd_sparse: network model (%s): %s", net.source, net)
    _start_run_file(cfg, comm, net, omni)
    return omni, switch, net


def _start_run_file(cfg: Config, comm: Collectives, net: costmodel.NetModel,
                    omni: Session | None) -> None:
    if not cfg.metrics_file:
        runfile.stop()
        return
    runfile.start(cfg.metrics_file, comm.rank, cfg.metrics_records, {
        "world_size": comm.size,
        "hosts": comm.hosts(),
        "aggregators": len(omni.addrs) if omni else 0,
        "aggregators_local": bool(omni) and not cfg.aggregator_list(),  # the job's own
        "aggregator_hosts": omni.link_hosts() if omni else None,
        "aggregator_placement": omni.placement if omni else None,
        "link_rate_bps": runfile.parse_rate(cfg.link_rate) if cfg.link_rate else None,
        "net": asdict(net),
        "config": asdict(cfg),
    })


def _whereabouts() -> tuple[str, int, list[str]]:
    """(kernel boot id, network namespace, addresses): what tells ranks apart, and where
    they are reached: IPv4 addresses first, then IPv6 ones (neither loopback nor link-local,
    which a peer cannot use without an interface)."""
    import psutil
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    addrs: dict[int, list[str]] = {socket.AF_INET: [], socket.AF_INET6: []}
    for nic in psutil.net_if_addrs().values():
        for a in nic:
            if a.family in addrs:
                ip = ipaddress.ip_address(a.address.split("%")[0])
                if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                    addrs[a.family].append(str(ip))
    return boot, netns, addrs[socket.AF_INET] + addrs[socket.AF_INET6]


def resolve(host: str) -> str:
    """The address ``host`` is reached at, as the worker engine resolves it
    (csrc/omni/worker/worker.cpp): its first IPv4 address, else its first IPv6 one.

    Args:
        host: a name or an IP literal.

    Returns:
        The address, as text.

    Raises:
        OSError: it does not resolve (socket.gaierror) or has neither kind of address.
    """
    infos = socket.getaddrinfo(host.strip("[]"), None, socket.AF_UNSPEC, socket.SOCK_DGRAM)
    for family in (socket.AF_INET, socket.AF_INET6):
        for fam, _, _, _, sockaddr in infos:
            if fam == family:
                return str(sockaddr[0])
    raise OSError(f"{host} has no IPv4 or IPv6 address")


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def _bind_address(host: str) -> str:
    """Where the job's own aggregators bind, given the address workers reach them at: that
    address itself when it is a loopback one (reached from this host only anyway), else
    every address of its family (0.0.0.0, or :: for IPv6, which takes IPv4 too). A name this
    host cannot resolve (one only the workers' side knows): 0.0.0.0."""
    try:
        ip = ipaddress.ip_address(resolve(host))
    except (OSError, ValueError):
        return "0.0.0.0"
    if ip.is_loopback:
        return str(ip)
    return "::" if ip.version == 6 else "0.0.0.0"


def _address_toward(peers: list[list[str]]) -> str:
    """The address of this host that the routing table uses toward the other ranks: the
    one they can reach it at (no default route needed, unlike probing a far address), of
    the family of the first peer address that has a route."""
    for addrs in peers:
        for addr in addrs:
            with socket.socket(_family(addr), socket.SOCK_DGRAM) as s:
                try:
                    s.connect((addr, 9))  # no packet is sent: this only picks a route
                    return str(s.getsockname()[0])
                except OSError:
                    continue
    raise HvdSparseError("hvd_sparse: no route from rank 0 to any address of the other ranks "
                         f"({peers}): set HVD_SPARSE_AGGREGATOR_HOST to rank 0's address")


IP_MTU = getattr(socket, "IP_MTU", 14)  # Linux <linux/in.h>
IPV6_MTU = getattr(socket, "IPV6_MTU", 24)  # Linux <linux/in6.h>


def _max_datagram(host: str, port: int) -> int:
    """The largest UDP payload that reaches (host, port) in one frame: path MTU - 28 over
    IPv4, - 48 over IPv6 (its header is 40 bytes)."""
    cap = protocol.MAX_DATAGRAM
    try:
        ip = resolve(host)
    except OSError:
        return cap
    v6 = _family(ip) == socket.AF_INET6
    try:
        with socket.socket(_family(ip), socket.SOCK_DGRAM) as s:
            s.connect((ip, port))
            if v6:
                return min(cap, s.getsockopt(socket.IPPROTO_IPV6, IPV6_MTU) - 48)
            return min(cap, s.getsockopt(socket.IPPROTO_IP, IP_MTU) - 28)
    except OSError:
        return cap
