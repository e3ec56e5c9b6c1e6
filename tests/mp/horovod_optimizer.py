"""Horovod's DistributedOptimizer behaviours with hvd_sparse, on 2 ranks.

The behaviours Horovod 0.28.1's own optimizer tests exercise (forced reductions, gradient
clipping, checkpoint resume with broadcast_optimizer_state, process sets, sparse embeddings,
grouped allreduce, naming errors...), each run through two paths for every sparse scheme:
``hvd.DistributedOptimizer(compression=hvd_sparse.Compression.sparse(scheme=S))`` and
``hvd_sparse.DistributedOptimizer(scheme=S)``. The reference is Horovod's own optimizer with
``hvd.Compression.none`` on a float64 copy of the model fed the same batches; parameters must
agree after every step. Each check records '' or why it failed.
"""
from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable

import horovod.torch as hvd
import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from common import case, close_to, report
from torch import nn

import hvd_sparse

SCHEMES = ["allgather", "zen", "omnireduce", "auto"]
BLOCK = 4  # codec block size: these tiny tensors still have several blocks, some all-zero
Make = Callable[..., torch.optim.Optimizer]  # (optimizer, named_parameters, **kw) -> wrapped


class Net(nn.Module):
    """Two heads: a loss on the first leaves fc3 without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.fc2(F.relu(self.fc1(x)))
        return a, self.fc3(F.relu(a))


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64)
    return x * (torch.rand(5, 6, generator=g) < 0.5)  # zero features: all-zero gradient blocks


def reference(opt: torch.optim.Optimizer, named, **kw) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(opt, named_parameters=named, compression=hvd.Compression.none,
                                    **kw)


def maker(path: str, scheme: str) -> Make:
    if path == "compression":
        comp = hvd_sparse.Compression.sparse(scheme=scheme, block_size=BLOCK)
        return lambda opt, named, **kw: hvd.DistributedOptimizer(
            opt, named_parameters=named, compression=comp, **kw)
    return lambda opt, named, **kw: hvd_sparse.DistributedOptimizer(
        opt, named_parameters=named, scheme=scheme, block_size=BLOCK, **kw)


def differs(ref: nn.Module, test: nn.Module, when: str) -> str:
    for (n, a), b in zip(ref.named_parameters(), test.parameters(), strict=True):
        if not a.is_floating_point():  # frozen integer parameters
            why = "" if torch.equal(a, b) else "frozen parameter changed"
        else:
            why = close_to(b.detach(), a.detach(), torch.float64)
        if why:
            return f"{when}: {n}: {why}"
    return ""


def sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def pair(make: Make, opt_fn=sgd, module=Net, **kw):
    """The reference and the tested model, equal at start, with their optimizers; a callable
    ``groups`` is given the model and returns its parameter groups."""
    torch.manual_seed(0)
    ref = module().double()
    test = copy.deepcopy(ref)

    def wrap(m: nn.Module, fn: Make) -> torch.optim.Optimizer:
        extra = {**kw, "groups": kw["groups"](m)} if callable(kw.get("groups")) else kw
        return fn(opt_fn(m), m.named_parameters(), **extra)

    return ref, wrap(ref, reference), test, wrap(test, make)


def lockstep(ref: nn.Module, ref_opt: torch.optim.Optimizer, test: nn.Module,
             test_opt: torch.optim.Optimizer, steps: range,
             head: int = 1, clip: bool = False) -> str:
    """Steps the pair on the same batches, loss on output ``head``; '' or the first difference."""
    for step in steps:
        for m, opt in ((ref, ref_opt), (test, test_opt)):
            opt.zero_grad()
            m(batch(step))[head].pow(2).sum().backward()
            if clip:  # Horovod's pattern: reduce, clip the reduced gradients, then step
                opt.synchronize()
                nn.utils.clip_grad_norm_(m.parameters(), 0.1)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        if err := differs(ref, test, f"step {step}"):
            return err
    return ""


def train(make: Make, steps: int = 3, head: Callable[[int], int] = lambda rank: 1,
          clip: bool = False, **kw) -> str:
    """A fresh pair in lockstep; ``head`` picks each rank's loss head."""
    return lockstep(*pair(make, **kw), range(steps), head(hvd.rank()), clip)


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
        if err := differs(ref, test, f"step {step}"):
            return err
    return ""


def resume(make: Make) -> str:
    """Checkpoint resume the Horovod way: rank 0 loads model and optimizer state, then
    broadcast_parameters and broadcast_optimizer_state; training goes on as if never stopped."""
    ref, ref_opt, test, test_opt = pair(make, opt_fn=lambda m: torch.optim.Adam(m.parameters(),
                                                                                lr=0.01))
    if err := lockstep(ref, ref_opt, test, test_opt, range(2)):
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
            if why := close_to(st[k], sr[k], torch.float64):
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
        if err := differs(ref, test, f"step {step}"):
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
    """Gradients reduced over {rank 0} only; rank 1 steps on its own gradients."""
    if scheme != "omnireduce":
        return train(make, process_set=even)
    try:  # the aggregators sum over every rank: refused clearly where it would be used
        err = train(make, steps=1, process_set=even)
    except (ValueError, hvd_sparse.HvdSparseError) as e:
        return "" if "process set" in str(e) else f"unclear error: {e}"
    return "omnireduce accepted a process set" if hvd.rank() == 0 else err


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
        if why:
            return f"{dtype}: {why}"
    return ""


def allreduce_process_sets(scheme: str, mine: hvd.ProcessSet) -> str:
    """Each rank reduces in its own one-rank set, concurrently, under the same names."""
    t = torch.zeros(64, dtype=torch.float64)
    t[8 * hvd.rank():8 * hvd.rank() + 8] = torch.arange(8.0) + hvd.rank()
    want = hvd.allreduce(t, op=hvd.Average, process_set=mine, name=f"ps.ref.{scheme}")
    try:
        out = hvd_sparse.allreduce(t, name=f"ps.{scheme}", scheme=scheme, block_size=BLOCK,
                                   process_set=mine)
    except hvd_sparse.HvdSparseError as e:
        if scheme == "omnireduce" and "process set" in str(e) and f"'ps.{scheme}'" in str(e):
            return ""
        raise
    if scheme == "omnireduce":
        return "omnireduce accepted a process set"
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
                                           omnireduce=(0.0, 0.0, 0.0), omni_layout=saved.omni_layout)
    try:
        t = torch.zeros(4096, dtype=torch.float64)
        t[:16] = 1.0 + hvd.rank()
        chosen = {}
        for where, ps in (("global", hvd.global_process_set), ("set", mine)):
            name = f"auto.{where}"
            out = hvd_sparse.allreduce(t, name=name, scheme="auto", process_set=ps)
            if why := close_to(out, hvd.allreduce(t, name=f"ref.{name}", process_set=ps),
                               torch.float64):
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
    return compress_direct("allgather") or train(maker("optimizer", "zen"), steps=1)


def variant(results: dict[str, object], path: str, scheme: str, even: hvd.ProcessSet) -> None:
    make, v = maker(path, scheme), f"{path}-{scheme}"
    case(results, f"{v}/train", lambda: train(make))
    case(results, f"{v}/force", lambda: train(make, head=lambda rank: rank % 2))
    case(results, f"{v}/clip", lambda: train(make, clip=True))
    case(results, f"{v}/step-warning", lambda: step_warning(make))
    case(results, f"{v}/unnamed", lambda: unnamed(make))
    case(results, f"{v}/bad-names", lambda: bad_names(make))
    case(results, f"{v}/requires-grad", lambda: requires_grad(make))
    case(results, f"{v}/resume", lambda: resume(make))
    case(results, f"{v}/state-options", lambda: state_options(make))
    case(results, f"{v}/no-grad-param", lambda: no_grad_param(make))
    case(results, f"{v}/sparse-embedding", lambda: sparse_embedding(make))
    case(results, f"{v}/process-set", lambda: process_set(make, scheme, even))
    if path == "compression":  # what only Horovod's optimizer takes, or only a compressor does
        case(results, f"{v}/sparse-as-dense", lambda: sparse_embedding(make, sparse_as_dense=True))
        case(results, f"{v}/groups-2", lambda: train(make, groups=2))
        case(results, f"{v}/groups-sparse-error", lambda: groups_sparse(make))
        case(results, f"{v}/groups-list", lambda: train(
            make, groups=lambda m: [[m.fc1.weight, m.fc3.bias], [m.fc2.weight]]))
        case(results, f"{v}/compress-direct", lambda: compress_direct(scheme))


def main() -> None:
    even, odd = hvd.ProcessSet([0]), hvd.ProcessSet([1])
    torch.set_num_threads(1)
    hvd.init(process_sets=[even, odd])
    # small_bytes=0: these tiny tensors take the sparse schemes, not the dense shortcut
    hvd_sparse.init(small_bytes=0, probe="off", timeout=10)
    mine = even if hvd.rank() == 0 else odd
    results: dict[str, object] = {}
    for scheme in SCHEMES:
        for path in ("compression", "optimizer"):
            variant(results, path, scheme, even)
        case(results, f"allreduce-{scheme}/process-set",
             lambda: allreduce_process_sets(scheme, mine))  # noqa: B023 - called at once
    case(results, "allreduce-rows/process-set", lambda: rows_process_sets(mine))
    case(results, "auto/process-set-avoids-omnireduce", lambda: auto_avoids_omnireduce(mine))
    case(results, "reinit", reinit)
    report(results)


if __name__ == "__main__":
    main()
