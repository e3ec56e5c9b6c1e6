"""One tensor's reduction as the schemes see it: the ``Job``, the process ``Context`` it carries,
and the ``Stats`` it leaves for ``metrics()`` and the run file."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .config import Config
from .costmodel import DeviceRoute, NetModel

if TYPE_CHECKING:
    from .comm import Collectives
    from .session import Session
    from .sparsifiers import Sparsifier


@dataclass
class RowsPlan:
    """What "auto" knows of one sparse tensor (schemes/rows.py): its union (the same on every
    rank) and how long each way took here when last tried."""

    calls: int = 0
    union: int = 0  # rows in the last result
    seconds: dict[str, float] = field(default_factory=dict)  # this rank's, by way
    aggregate: bool = False  # the choice the ranks agreed on at the last trial
    decided: dict[str, float] = field(default_factory=dict)  # that trial's slowest-rank times
    trying: bool = False  # this call is one of a trial's
    gathered: int = 0  # bytes every rank sent, together, in the last allgathered call
    skipped: bool = False  # this trial's aggregated calls were skipped: they could not win


@dataclass(frozen=True)
class Context:
    """What a scheme may know of the process beyond its tensor, handed to it with the job (taken
    from ``basics.state()`` when the reduction starts), so schemes never reach up for it."""

    config: Config
    net: NetModel  # the cost model's view of the network ("auto")
    omni: Session | None  # the aggregators joined at init ("omnireduce"), when any
    switch: Session | None = None  # the switch joined at init ("switch"), when any
    # (name, ranks) -> observed union / sum of the ranks' non-zero blocks, learnt by "auto"
    # (the state's: a new init starts afresh)
    union_ratio: dict[tuple[str, tuple[int, ...]], float] = field(default_factory=dict)
    # name -> what "auto" learnt of a sparse tensor's rows (schemes/rows.py)
    rows_plans: dict[str, RowsPlan] = field(default_factory=dict)
    # (name, ranks) -> calls in a row that "auto" sent dense (schemes/auto.py: past a few, it stops
    # asking the ranks until its next look)
    dense_streak: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)
    # which join of the ranks this is (the Horovod front end joins again after an elastic
    # reset): the sparsifier is told it with the reduction's ranks (``Sparsifier.join``)
    joined: int = 0
    # a device's (str(device)) route of the DDP hook: its dense allreduce by the model's group,
    # against staging (costmodel.DeviceRoute), for "auto" to weigh; set at its first bucket
    routes: dict[str, DeviceRoute] = field(default_factory=dict)


@dataclass
class Stats:
    """What one reduction did. ``metrics()`` reports the fields that are set; the run file keeps
    its columns of them."""

    scheme: str | None = None  # what ran ("auto": what it chose)
    reason: str | None = None  # why not the scheme asked for ("small", "non-finite", ...)
    staged: str | None = None  # a GPU tensor's device: reduced through host memory
    wire: str | None = None  # the 16-bit type its values travelled as (option ``wire``)
    # what carried it: "horovod", "hook streams" (the DDP hook's Gloo groups), "model group"
    # (the DDP model's own process group), "aggregators", "switch"
    route: str | None = None
    bytes_sent: int = 0  # what this rank put on the wire (ring collectives modelled)
    bytes_received: int | None = None
    nnz_local: int | None = None  # this rank's non-zero blocks ("rows": sparse entries)
    nnz: list[int] | None = None  # every rank's non-zero blocks
    union: int | None = None  # blocks ("rows": rows) non-zero on some rank
    block_density: float | None = None  # mean non-zero block fraction over ranks
    rows_local: int | None = None  # "rows": this rank's distinct rows
    predicted_ms: dict[str, float] | None = None  # "auto": the cost model's prediction
    retransmits: int | None = None  # aggregation: datagrams sent again
    rounds: int | None = None  # aggregation: rounds of the busiest slot
    # where the time went, ms: "host <stage>" the scheme's own work before it yielded <stage>
    # ("host end": after the last), "<stage>" the wait for that stage's operation
    stages_ms: dict[str, float] = field(default_factory=dict)

    def reported(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}


STATS_FIELDS = tuple(Stats.__dataclass_fields__)


@dataclass
class Job:
    """One tensor's reduction: what every scheme needs to know about it."""

    name: str
    tensor: torch.Tensor  # contiguous, flat view of the input ("rows": the sparse input)
    shape: torch.Size
    average: bool  # divide the sum by the ranks (else the plain sum), besides the scales
    prescale: float
    postscale: float
    block_size: int
    meta: int
    scheme: str  # what the caller asked for ("rows" for a sparse tensor: see ``asked``)
    ctx: Context
    comm: Collectives  # the ranks taking part: every collective of the job runs over them
    inplace: bool = False  # the schemes may write the result into ``tensor``
    output: torch.Tensor | None = None  # the caller's tensor, for allreduce_
    home: torch.Tensor | None = None  # staged (a GPU tensor): its flat self on the device
    mask: torch.Tensor | None = None  # block mask, when already computed
    stats: Stats = field(default_factory=Stats)
    asked: str = "auto"  # "rows": the scheme the caller asked for, which picks how rows travel
    sparsifier: Sparsifier | None = None  # sparsified the tensor's parts (reduction.start)
    parts: tuple[tuple[str, int, int], ...] = ()  # its gradients: name, offset, elements
    whole: tuple[tuple[str, int, int], ...] = ()  # those sent whole, by the dense allreduce
    apart: torch.Tensor | None = None  # their values, one after another (reduced: the result)
    # option ``wire``: the input's own dtype, and the caller's tensor for an in-place result
    # (the job reduces a 16-bit copy)
    widen: torch.dtype | None = None
    caller: torch.Tensor | None = None

    def op_name(self, stage: str) -> str:
        return f"hvd_sparse.{self.name}.{stage}"

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def scale(self) -> float:
        """Factor applied to the plain sum: pre- and postscale, and 1/size for an average."""
        s = self.prescale * self.postscale
        return s / self.size if self.average else s

    @property
    def small(self) -> bool:
        """Below ``small_bytes``: a round of aggregation, or auto's decision, costs more than
        the dense allreduce of it."""
        return self.tensor.numel() * self.tensor.element_size() < self.ctx.config.small_bytes
