"""Horovod's DistributedOptimizer behaviours hold with hvd_sparse, for every scheme (2 ranks).

The behaviours Horovod 0.28.1's own optimizer tests exercise (forced reductions, gradient
clipping, checkpoint resume with broadcast_optimizer_state, process sets, sparse embeddings,
grouped allreduce, naming errors...), each run through two paths for every sparse scheme
(optimizer_pairs.py): Horovod's optimizer with Compression.sparse, and
hvd_sparse.DistributedOptimizer; against Horovod's own optimizer on a float64 copy.
"""
from __future__ import annotations

import copy
import io
import warnings

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from optimizer_pairs import (
    BLOCK,
    SCHEMES,
    Make,
    Net,
    batch,
    differs,
    lockstep,
    maker,
    pair,
    reference,
    train,
)
from ranktools import close_to
from torch import nn

import hvd_sparse

LAUNCHES = [Launch(np=2, timeout=300)]
@pytest.fixture(scope="module")
def sets() -> tuple[hvd.ProcessSet, hvd.ProcessSet]:
    """(rank 0's set, this rank's own one-rank set)."""
    even, odd = hvd.ProcessSet([0]), hvd.ProcessSet([1])
    torch.set_num_threads(1)
    hvd.init(process_sets=[even, odd])
    # small_bytes=0: these tiny tensors take the sparse schemes, not the dense shortcut
    hvd_sparse.init(small_bytes=0, probe="off", timeout=10)
    return even, (even if hvd.rank() == 0 else odd)


def step_warning(make: Make) -> str:
    _, _, test, opt = pair(make)
    opt.zero_grad()
    test(batch(0))[1].sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        opt.step()
    texts = [str(w.message) for w in ws]
    want = "optimizer.step() called without optimizer.skip_synchronize()"
    return "" if len(texts) == 1 and want in texts[0] else f"warnings: {texts}"


def unnamed(make: Make) -> str:
    """named_parameters=None with two parameter groups: parity, and the same reductions (names)
    on both ranks."""
    torch.manual_seed(0)
    ref = Net().double()
    test = copy.deepcopy(ref)

    def groups(m: Net) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": m.fc1.parameters()},
                                {"params": [*m.fc2.parameters(), *m.fc3.parameters()]}], lr=0.1)

    ref_opt, test_opt = reference(groups(ref), None), make(groups(test), None)
    hvd_sparse.reset_metrics()
    for m, opt in ((ref, ref_opt), (test, test_opt)):
        opt.zero_grad()
        m(batch(0))[1].sum().backward()
        opt.step()
    names = hvd.allgather_object(sorted(hvd_sparse.metrics()), name="unnamed.names")
    if len(names[0]) != 6 or names[0] != names[1]:
        return f"reductions differ across ranks or are not 6: {names}"
    return differs(ref, test, "step 0")


def bad_names(make: Make) -> str:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    cases = {"duplicate": [*a.named_parameters(), *b.named_parameters()],
             "missing": list(a.named_parameters())[:1] + list(b.named_parameters())}
    for what, named in cases.items():
        opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
        try:
            make(opt, named)
        except ValueError as e:
            if what == "duplicate" and "weight" not in str(e):
                return f"duplicate names: error does not name them: {e}"
            continue
        return f"{what} names accepted"
    return ""


def requires_grad(make: Make) -> str:
    """A generator and a discriminator stepped in turn, gradients switched off and on."""
    torch.manual_seed(0)
    ref = nn.ModuleDict({"gen": nn.Linear(6, 5), "disc": nn.Linear(5, 1)}).double()
    test = copy.deepcopy(ref)
    opts = {}
    for m, wrap in ((ref, reference), (test, make)):
        opts[id(m)] = {k: wrap(torch.optim.SGD(m[k].parameters(), lr=0.1),
                               m[k].named_parameters()) for k in ("gen", "disc")}
    for step in range(4):
        trained = ("gen", "disc")[step % 2]
        for m in (ref, test):
            for k in ("gen", "disc"):
                m[k].requires_grad_(k == trained)
                opts[id(m)][k].zero_grad()
            m["disc"](m["gen"](batch(step))).sum().backward()
            opts[id(m)][trained].step()
        if (err := differs(ref, test, f"step {step}")) != "":
            return err
    return ""


def resume(make: Make) -> str:
    """Checkpoint resume the Horovod way: rank 0 loads model and optimizer state, then
    broadcast_parameters and broadcast_optimizer_state; training goes on as if never stopped."""
    ref, ref_opt, test, test_opt = pair(make, opt_fn=lambda m: torch.optim.Adam(m.parameters(),
                                                                                lr=0.01))
    if (err := lockstep(ref, ref_opt, test, test_opt, range(2))) != "":
        return err
    # Stop and resume the tested run from rank 0's checkpoint.
    buf = io.BytesIO()
    torch.save({"model": test.state_dict(), "opt": test_opt.state_dict()}, buf)
    torch.manual_seed(1 + hvd.rank())  # a fresh model, different on every rank
    test = Net().double()
    test_opt = make(torch.optim.Adam(test.parameters(), lr=0.01), test.named_parameters())
    if hvd.rank() == 0:
        buf.seek(0)
        ckpt = torch.load(buf)
        test.load_state_dict(ckpt["model"])
        test_opt.load_state_dict(ckpt["opt"])
    hvd.broadcast_parameters(test.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(test_opt, root_rank=0)
    for pr, pt in zip(ref.parameters(), test.parameters(), strict=True):
        sr, st = ref_opt.state[pr], test_opt.state[pt]
        for k in ("exp_avg", "exp_avg_sq"):
            if (why := close_to(st[k], sr[k], torch.float64)) != "":
                return f"optimizer state {k} after resume: {why}"
        if float(st["step"]) != float(sr["step"]):
            return f"step count {float(st['step'])} != {float(sr['step'])} after resume"
    return lockstep(ref, ref_opt, test, test_opt, range(2, 4))


def state_options(make: Make) -> str:
    """broadcast_optimizer_state of a fresh optimizer takes rank 0's options, then trains."""
    m = Net().double()
    lr, momentum = (0.1, 0.8) if hvd.rank() == 0 else (0.2, 0.9)
    opt = make(torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum), m.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    got = (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"])
    if got != (0.1, 0.8):
        return f"options after broadcast: {got}, want rank 0's (0.1, 0.8)"
    return train(make, steps=2)


class NoGrad(nn.Module):
    """A frozen integer parameter beside a trained one (Horovod's no-grad state test)."""

    def __init__(self) -> None:
        super().__init__()
        self.idx = nn.Parameter(torch.tensor([1, 3, 6]), requires_grad=False)
        self.w = nn.Parameter(torch.rand(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x[:, :3] * self.w.index_select(0, self.idx)
        return y, y


def no_grad_param(make: Make) -> str:
    ref, ref_opt, test, test_opt = pair(make, module=NoGrad)
    hvd.broadcast_optimizer_state(test_opt, root_rank=0)
    hvd.broadcast_optimizer_state(ref_opt, root_rank=0)
    if test.idx.grad is not None:
        return "frozen parameter got a gradient"
    return lockstep(ref, ref_opt, test, test_opt, range(2), head=0)


class Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 3, sparse=True)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.emb(ids), self.emb(ids)


def sparse_embedding(make: Make, **kw) -> str:
    """nn.Embedding(sparse=True) under SparseAdam, different rows on each rank."""
    ref, ref_opt, test, test_opt = pair(
        make, opt_fn=lambda m: torch.optim.SparseAdam(list(m.parameters()), lr=0.1),
        module=Emb, **kw)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * hvd.rank() + step)
        ids = torch.randint(0, 40, (4, 3), generator=g)
        for m, opt in ((ref, ref_opt), (test, test_opt)):
            opt.zero_grad()
            m(ids)[0].pow(2).sum().backward()
            opt.step()
        if (err := differs(ref, test, f"step {step}")) != "":
            return err
    return ""


def groups_sparse(make: Make) -> str:
    """Horovod's grouped path hands sparse gradients to compress (it ignores sparse_as_dense and
    fails on them itself): a clear error naming the gradient."""
    m = Emb()
    opt = make(torch.optim.SparseAdam(list(m.parameters()), lr=0.1), m.named_parameters(),
               groups=1, sparse_as_dense=True)
    try:
        m(torch.tensor([1, 2]))[0].sum().backward()
        opt.step()
    except hvd_sparse.HvdSparseError as e:
        return "" if "'grad.emb.weight' is sparse" in str(e) else f"unclear error: {e}"
    return "sparse gradient accepted in a group"


def process_set(make: Make, scheme: str, even: hvd.ProcessSet) -> str:
    """Gradients reduced over {rank 0} only; rank 1 steps on its own gradients. (omnireduce,
    whose aggregators sum over every rank, goes dense there: tests/parallel/test_process_sets.py)"""
    return train(make, process_set=even)


def compress_direct(scheme: str) -> str:
    """The compression object driven by hand as Horovod's optimizer drives it (compress, Horovod
    allreduce of what it returns, decompress), for float and integer tensors (Horovod's fp16
    compression test): the dtype is kept and the result is Horovod's average."""
    comp = hvd_sparse.Compression.sparse(scheme=scheme, block_size=BLOCK)
    for dtype in (torch.float32, torch.float64, torch.int32):
        t = torch.zeros(5, 5, 5, dtype=dtype)
        t[hvd.rank()] = 2 * hvd.rank() + 1  # rank 0's first slab, rank 1's second
        name = f"direct.{scheme}.{dtype}"
        want = hvd.allreduce(t, op=hvd.Average, name=name)
        sent, ctx = comp.compress(t.clone())
        out = comp.decompress(hvd.allreduce(sent, op=hvd.Average, name=f"{name}.sent"), ctx)
        if out.dtype != dtype:
            return f"{dtype}: decompressed to {out.dtype}"
        if dtype.is_floating_point:
            why = close_to(out, want.double(), dtype)
        else:  # integers are Horovod's own reduction: exactly its result
            why = "" if torch.equal(out, want) else f"{out.flatten()} != {want.flatten()}"
        if why != "":
            return f"{dtype}: {why}"
    return ""


def allreduce_process_sets(scheme: str, mine: hvd.ProcessSet) -> str:
    """Each rank reduces in its own one-rank set, concurrently, under the same names."""
    t = torch.zeros(64, dtype=torch.float64)
    t[8 * hvd.rank():8 * hvd.rank() + 8] = torch.arange(8.0) + hvd.rank()
    want = hvd.allreduce(t, op=hvd.Average, process_set=mine, name=f"ps.ref.{scheme}")
    out = hvd_sparse.allreduce(t, name=f"ps.{scheme}", scheme=scheme, block_size=BLOCK,
                               process_set=mine)
    reason = hvd_sparse.metrics()[f"ps.{scheme}"].get("reason")
    if reason != ("process set" if scheme == "omnireduce" else None):
        return f"went another way than expected: reason {reason!r}"
    return close_to(out, want, torch.float64)


def rows_process_sets(mine: hvd.ProcessSet) -> str:
    """A sparse COO tensor (reduced by rows) in each rank's own one-rank set."""
    idx = torch.tensor([[1, 5, 5, 9 + hvd.rank()]])
    t = torch.sparse_coo_tensor(idx, torch.rand(4, 3, dtype=torch.float64), (40, 3))
    want = hvd.allreduce(t.to_dense(), op=hvd.Average, process_set=mine, name="ps.rows.ref")
    out = hvd_sparse.allreduce(t, name="ps.rows", process_set=mine)
    return close_to(out.to_dense(), want, torch.float64)


def auto_avoids_omnireduce(mine: hvd.ProcessSet) -> str:
    """With a network model where aggregation is free, auto picks omnireduce on the global set
    (else this check proves nothing) and something else on a process set."""
    st = hvd_sparse.basics.state()
    saved = st.net
    st.net = hvd_sparse.costmodel.NetModel((1.0, 0.0), (1.0, 0.0), (1.0, 0.0), 1e12, 1e12,
                                           omnireduce=(0.0, 0.0, 0.0),
                                           omni_layout=saved.omni_layout)
    try:
        t = torch.zeros(4096, dtype=torch.float64)
        t[:16] = 1.0 + hvd.rank()
        chosen = {}
        for where, ps in (("global", hvd.global_process_set), ("set", mine)):
            name = f"auto.{where}"
            out = hvd_sparse.allreduce(t, name=name, scheme="auto", process_set=ps)
            ref = hvd.allreduce(t, name=f"ref.{name}", process_set=ps)
            if (why := close_to(out, ref, torch.float64)) != "":
                return f"{where}: {why}"
            chosen[where] = hvd_sparse.metrics()[name]["scheme"]
    finally:
        st.net = saved
    ok = chosen["global"] == "omnireduce" and chosen["set"] != "omnireduce"
    return "" if ok else f"auto chose {chosen}"


def reinit() -> str:
    """hvd.shutdown(): a clear error; hvd.init() on the same ranks: hvd_sparse goes on."""
    hvd.barrier()  # a peer's shutdown would fail collectives still running here
    hvd.shutdown()
    try:
        hvd_sparse.allreduce(torch.ones(8), name="reinit.down")
        return "reduction accepted with Horovod shut down"
    except hvd_sparse.HvdSparseError as e:
        if "hvd.init()" not in str(e):
            return f"unclear error: {e}"
    hvd.init()
    err = compress_direct("allgather")
    return err if err != "" else train(maker("optimizer", "zen"), steps=1)



# Each behaviour: (make, scheme, (rank 0's set, this rank's own set)) -> '' or why not.
BOTH = {
    "train": lambda make, scheme, sets: train(make),
    # each rank's loss on another head: a gradient missing on some ranks is still reduced
    "force": lambda make, scheme, sets: train(make, head=lambda rank: rank % 2),
    "clip": lambda make, scheme, sets: train(make, clip=True),
    "step-warning": lambda make, scheme, sets: step_warning(make),
    "unnamed": lambda make, scheme, sets: unnamed(make),
    "bad-names": lambda make, scheme, sets: bad_names(make),
    "requires-grad": lambda make, scheme, sets: requires_grad(make),
    "resume": lambda make, scheme, sets: resume(make),
    "state-options": lambda make, scheme, sets: state_options(make),
    "no-grad-param": lambda make, scheme, sets: no_grad_param(make),
    "sparse-embedding": lambda make, scheme, sets: sparse_embedding(make),
    "sparse-as-dense": lambda make, scheme, sets: sparse_embedding(make, sparse_as_dense=True),
    "process-set": lambda make, scheme, sets: process_set(make, scheme, sets[0]),
}
# What only Horovod's optimizer takes, or only a compressor does
COMPRESSION_ONLY = {
    "groups-2": lambda make, scheme, sets: train(make, groups=2),
    "groups-sparse-error": lambda make, scheme, sets: groups_sparse(make),
    "groups-list": lambda make, scheme, sets: train(
        make, groups=lambda m: [[m.fc1.weight, m.fc3.bias], [m.fc2.weight]]),
    "compress-direct": lambda make, scheme, sets: compress_direct(scheme),
}
# The order matters and is kept: scheme by scheme, both paths, then hvd_sparse.allreduce in
# each rank's own one-rank set, concurrently, under the same names. (Run behaviour by
# behaviour instead, compression-auto/process-set failed on rank 0 right after
# optimizer-omnireduce/process-set, whose process set omnireduce then refused: Horovod said "a
# tensor with the same name as another tensor that is currently being processed".)
CASES = [case for scheme in SCHEMES for case in (
    *((f"{path}-{scheme}/{b}", path, scheme, b) for path in ("compression", "optimizer")
      for b in [*BOTH, *(COMPRESSION_ONLY if path == "compression" else ())]),
    (f"allreduce-{scheme}/process-set", "allreduce", scheme, "process-set"))]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_horovod_behaviour(case, sets):
    _, path, scheme, behaviour = case
    if path == "allreduce":
        assert allreduce_process_sets(scheme, sets[1]) == ""
    else:
        check = {**BOTH, **COMPRESSION_ONLY}[behaviour]
        assert check(maker(path, scheme), scheme, sets) == ""


def test_allreduce_rows_process_set(sets):
    assert rows_process_sets(sets[1]) == ""


def test_auto_avoids_omnireduce_on_a_process_set(sets):
    assert auto_avoids_omnireduce(sets[1]) == ""


def test_compression_sparse_uncalled(sets):
    """``compression=hvd_sparse.Compression.sparse`` passed uncalled, as Horovod's own
    compressors are: its defaults, and the same training as Horovod's optimizer."""
    make = lambda opt, named, **kw: hvd.DistributedOptimizer(  # noqa: E731
        opt, named_parameters=named, compression=hvd_sparse.Compression.sparse, **kw)
    assert train(make) == ""


@pytest.mark.parametrize("kw", [{"compression": hvd.Compression.fp16}, {"groups": 2},
                                {"num_groups": 2},
                                {"compression": hvd_sparse.Compression.sparse(scheme="zen")}],
                         ids=["compression", "groups", "num-groups", "our-compression"])
def test_optimizer_refuses_what_it_does_not_support(kw, sets):
    """Horovod's optimizer arguments hvd_sparse.DistributedOptimizer does not support are
    refused by name (compression= Compression.none is accepted)."""
    m = Net()
    hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                    compression=hvd.Compression.none)
    with pytest.raises(ValueError, match=next(iter(kw))):
        hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), **kw)


def test_reinit(sets):
    """Last: Horovod shut down and started again."""
    assert reinit() == ""
