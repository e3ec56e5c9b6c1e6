"""Property-based cases for tests/parallel/test_shapes_*.py: hypothesis draws a case (shapes,
dtype, where the ranks' rows or blocks fall) alike on every rank; each rank makes its own tensor
from the case and its rank, and the float64 reference from every rank's (no collective).

Alike on every rank: hypothesis is derandomized (its seed comes from the test), keeps no
database, runs no health check and has no deadline (timing differs between ranks), and every
example's verdict is agreed across the ranks before it is raised (``agree``), so that shrinking,
which replays examples by their verdicts, takes the same path on every rank. Torch-only: the
DDP tests run without Horovod.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
# make test's budget; the extended tier's launches set a larger one
EXAMPLES = int(os.environ.get("HVD_SPARSE_PROPERTY_EXAMPLES", "12"))
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


def magnitudes(t: torch.Tensor) -> torch.Tensor:
    """Every term of ``t`` in float64, made non-negative (sparse: each duplicate's own; torch's
    ``abs`` sums duplicates first)."""
    t = t.double()
    if not t.is_sparse:
        return t.abs()
    return torch.sparse_coo_tensor(t._indices(), t._values().abs(), t.shape)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _ulp0(dtype: torch.dtype) -> float:
    """The spacing of the dtype's subnormals: a sum that lands there rounds by half of it."""
    return torch.finfo(dtype).tiny * _eps(dtype)


def _acc_eps(dtype: torch.dtype) -> float:
    """The rounding of the sums: float64 for float64, float32 for the rest."""
    return _eps(torch.float64 if dtype == torch.float64 else torch.float32)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A sparse row gradient on every rank, as embeddings make them: ``lookups[r]`` rows on
    rank r (0: a rank with no rows) of a table of ``dims`` rows (two sparse dimensions when
    two) of ``row`` elements each, ids drawn unsorted from ``pool`` rows the ranks share (few:
    duplicates), value rows repeated in runs of ``bag`` (an EmbeddingBag's gradient) and
    coalesced or as they came."""

    dims: tuple[int, ...]
    row: tuple[int, ...]
    dtype: str
    lookups: tuple[int, ...]
    pool: int
    bag: int
    coalesced: bool
    seed: int

    def grad(self, rank: int) -> torch.Tensor:
        table = math.prod(self.dims)
        shared = torch.randperm(table, generator=torch.Generator().manual_seed(self.seed))
        g = torch.Generator().manual_seed(self.seed * 1009 + rank + 1)
        n = self.lookups[rank]
        ids = shared[:max(1, min(self.pool, table))][
            torch.randint(0, max(1, min(self.pool, table)), (n,), generator=g)]
        runs = torch.randn(-(-n // self.bag), *self.row, generator=g, dtype=torch.float64)
        vals = runs.repeat_interleave(self.bag, 0)[:n].to(DTYPES[self.dtype])
        if len(self.dims) == 1:
            idx = ids.unsqueeze(0)
        else:
            idx = torch.stack([ids // self.dims[1], ids % self.dims[1]])
        t = torch.sparse_coo_tensor(idx, vals, (*self.dims, *self.row))
        return t.coalesce() if self.coalesced else t

    def reference(self, world: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the scaled sum in float64, the bound of the error rounding may make): each rank
        rounds its local sum of duplicates once, the sum over ranks is accumulated in float32
        (float64) and rounded once; Gloo and Horovod sum 16-bit values in 16 bits."""
        # (in float64 before to_dense, which sums the duplicates in the tensor's dtype)
        grads = [self.grad(r).double().to_dense() for r in range(world)]
        absolute = [magnitudes(self.grad(r)).to_dense() for r in range(world)]
        ref = sum(grads) * scale
        dtype = DTYPES[self.dtype]
        bound = (_eps(dtype) * (world + 1) * (sum(g.abs() for g in grads) * scale + ref.abs())
                 + _acc_eps(dtype) * max(self.lookups + (1,)) * sum(absolute) * scale
                 + _ulp0(dtype) * (world + 1))
        return ref, bound


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A dense tensor of ``shape`` on every rank whose non-zero ``block``s (of elements, the
    last one short when the size is not a multiple) are a fraction ``density[r]`` on rank r (0:
    all zero), drawn from a set the ranks share (``overlap``) or each its own."""

    shape: tuple[int, ...]
    dtype: str
    block: int
    density: tuple[float, ...]
    overlap: bool
    seed: int

    def tensor(self, rank: int) -> torch.Tensor:
        numel = math.prod(self.shape)
        nblocks = -(-numel // self.block)
        g = torch.Generator().manual_seed(self.seed * 1009 + rank + 1)
        shared = torch.Generator().manual_seed(self.seed)
        keep = torch.rand(nblocks, generator=shared if self.overlap else g) < self.density[rank]
        if self.overlap:  # each rank drops a few of the shared blocks
            keep &= torch.rand(nblocks, generator=g) < 0.9
        mask = keep.repeat_interleave(self.block)[:numel]
        vals = torch.randn(numel, generator=g, dtype=torch.float64) * mask
        return vals.to(DTYPES[self.dtype]).view(self.shape)

    def reference(self, world: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the scaled sum in float64, the bound of its rounding), as ``Rows.reference``."""
        xs = [self.tensor(r).double() for r in range(world)]
        ref = sum(xs) * scale
        total = sum(x.abs() for x in xs) * scale
        dtype = DTYPES[self.dtype]
        bound = (_eps(dtype) * (world + 1) * (total + ref.abs()) + _acc_eps(dtype) * world * total
                 + _ulp0(dtype) * (world + 1))
        return ref, bound


def rows(world: int) -> st.SearchStrategy[Rows]:
    """Widths 1-17 (and hybrid rows of two dimensions), 1 to 5,000 rows (one or two sparse
    dimensions), 0 to 3,000 lookups a rank, every float dtype."""
    return st.builds(
        Rows,
        dims=st.one_of(st.tuples(st.integers(1, 5000)),
                       st.tuples(st.integers(1, 70), st.integers(1, 70))),
        row=st.one_of(st.tuples(st.integers(1, 17)),
                      st.tuples(st.integers(1, 3), st.integers(1, 6))),
        dtype=st.sampled_from(list(DTYPES)),
        lookups=st.tuples(*[st.integers(0, 3000)] * world),
        pool=st.integers(1, 5000), bag=st.integers(1, 12), coalesced=st.booleans(),
        seed=st.integers(0, 2**16))


def blocks(world: int, block: st.SearchStrategy[int] | None = None,
           dtypes: tuple[str, ...] = tuple(DTYPES)) -> st.SearchStrategy[Blocks]:
    """1 to 30,000 elements in one to three dimensions (sizes not a multiple of the block),
    ``dtypes`` (every float dtype), densities 0 to 1 a rank."""
    dim = st.integers(1, 200)
    return st.builds(
        Blocks,
        shape=st.one_of(st.tuples(st.integers(1, 30000)), st.tuples(dim, dim),
                        st.tuples(st.integers(1, 30), dim, st.integers(1, 5))),
        dtype=st.sampled_from(dtypes),
        block=block if block is not None else st.just(256),
        density=st.tuples(*[st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0])] * world),
        overlap=st.booleans(), seed=st.integers(0, 2**16))


def mismatch(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor,
             dtype: torch.dtype) -> str:
    """'' when ``out`` has the reference's shape and dtype and is within ``bound`` of it
    everywhere, else where and by how much not."""
    if out.dtype != dtype:
        return f"dtype {out.dtype}, not {dtype}"
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)}, not {tuple(ref.shape)}"
    err = (out.double() - ref).abs()
    bad = ~(err <= bound)  # NaN included
    if bad.any():
        at = int(bad.view(-1).nonzero()[0])
        return (f"{int(bad.sum())} of {ref.numel()} elements off, first at {at}: "
                f"{out.reshape(-1)[at].item()} vs {ref.reshape(-1)[at].item()}")
    return ""


def went_by(m: dict, scheme: str) -> str:
    """'' when the metrics ``m`` of a reduction say it went by ``scheme`` (any, for "auto"),
    else what they say."""
    return "" if scheme == "auto" or m["scheme"] == scheme else f"went by {m}"


def digest(t: torch.Tensor) -> str:
    """The bits of a result (a sparse one's indices and values)."""
    h = hashlib.sha1()
    for part in ((t._indices(), t._values()) if t.is_sparse else (t,)):
        h.update(part.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check(case: object, run: Callable[[], tuple[str, torch.Tensor | None]],
          gather: Callable[[object], list[object]]) -> None:
    """Runs ``run`` (its complaint, '' when none, an exception counting as one, and its
    result) and raises on every rank if any rank complained, the ranks' results differ in a
    bit, or the ranks drew different cases: ``gather`` is a collective giving every rank's
    object."""
    try:
        verdict, out = run()
    except Exception as e:  # noqa: BLE001 - agreed across ranks, then raised
        verdict, out = f"{type(e).__name__}: {e}", None
    every = gather((repr(case), verdict, None if out is None else digest(out)))
    if len({c for c, _, _ in every}) != 1:
        raise AssertionError(f"the ranks drew different cases: {[c for c, _, _ in every]}")
    failed = [f"rank {r}: {v}" for r, (_, v, _) in enumerate(every) if v]
    assert not failed, "\n".join(failed)
    assert len({d for _, _, d in every}) == 1, "the ranks' results differ in their bits"
