"""The DDP front end (hvd_sparse.ddp) under torchrun, no Horovod: each scheme's hook against
DDP's own allreduce of the same model and data (several buckets, dense embedding gradients
that are mostly zero blocks, sparse embedding gradients by rows, no_sync accumulation, unused
parameters), results alike on every rank to the bit."""
from __future__ import annotations

import copy
import hashlib
import os

import pytest
import torch
import torch.distributed as dist
from driver import Launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from hvd_sparse import ExDyna, HvdSparseError, TopK, ddp, metrics, reset_metrics

LAUNCHES = [Launch("torchrun", np=2, timeout=300),
            Launch("torchrun", np=4, timeout=400, extended=True),
            # dense buckets staged by their non-zero blocks, as a GPU's are (staging.py)
            Launch("torchrun", np=2, timeout=300, id="torch-np2-staged",
                   env={"HVD_SPARSE_CPU_AS_DEVICE": "1"})]
STAGED = os.environ.get("HVD_SPARSE_CPU_AS_DEVICE") == "1"
ROWS, DIM = 4000, 32
SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
_states: dict[str, ddp.State] = {}


@pytest.fixture(scope="module", autouse=True)
def group():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    yield
    for s in _states.values():
        s.close()
    dist.destroy_process_group()


def state(scheme: str) -> ddp.State:
    """One per scheme, made on first use: the tests run in one order on every rank, so the
    states' collective construction is matched."""
    if scheme not in _states:
        _states[scheme] = ddp.State(scheme=scheme, probe="off")
    return _states[scheme]


class Net(nn.Module):
    def __init__(self, sparse: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse)
        self.mlp = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 1))
        self.extra = nn.Linear(DIM, 1) if unused else None

    def forward(self, ids: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.emb(ids)
        out = self.mlp(h)
        return out + self.extra(h) if use_extra and self.extra is not None else out


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch: Zipf-like ids (hot rows shared by the ranks, a tail of their own)."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    ids = (torch.rand(48, 4, generator=g) ** 3 * ROWS).long()
    return ids, torch.randn(48, 1, generator=g)


def pair(scheme: str, **kw) -> tuple[DDP, DDP]:
    """(DDP with its own allreduce, DDP with our hook) over one model, small buckets so that a
    step has several."""
    torch.manual_seed(0)
    model = Net(**{k: v for k, v in kw.items() if k in ("sparse", "unused")})
    opts = {k: v for k, v in kw.items() if k not in ("sparse", "unused")}
    ref = DDP(model, bucket_cap_mb=0.1, **opts)
    ours = DDP(copy.deepcopy(model), bucket_cap_mb=0.1, **opts)
    ours.register_comm_hook(state(scheme), ddp.hook)
    return ref, ours


def grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
            for n, p in m.named_parameters() if p.grad is not None}


def same_everywhere(tensors: dict[str, torch.Tensor]) -> None:
    h = hashlib.sha1()
    for n in sorted(tensors):
        h.update(tensors[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    assert len(set(digests)) == 1, f"ranks differ: {digests}"


def assert_grads_equal(ref: nn.Module, ours: nn.Module) -> None:
    a, b = grads(ref), grads(ours)
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-5, atol=1e-6, equal_nan=True,
                                   msg=lambda m, n=n: f"{n}: {m}")
    same_everywhere(b)


def train(ref: DDP, ours: DDP, steps: int = 3, **fwd) -> None:
    """SGD steps on both, comparing the gradients of each (DDP rebuilds its buckets after the
    first step: later steps reduce other buckets)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    for step in range(steps):
        ids, y = batch(step)
        for m, o in zip((ref, ours), opts, strict=True):
            o.zero_grad()
            nn.functional.mse_loss(m(ids, **fwd), y).backward()
        assert_grads_equal(ref, ours)
        for o in opts:
            o.step()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dense_buckets_match_ddp(scheme: str) -> None:
    reset_metrics()
    train(*pair(scheme))
    ran = {m["scheme"] for m in metrics().values()}
    # the table's gradient (512 KiB, 3% of its blocks non-zero) is a bucket of its own
    assert scheme in ran or scheme == "auto", ran


@pytest.mark.parametrize("scheme", ["allgather", "omnireduce", "auto"])
def test_sparse_embedding_by_rows(scheme: str) -> None:
    """nn.EmbeddingBag(sparse=True): its bucket holds one sparse COO gradient, reduced by rows
    (DDP's own path: Gloo's sparse allreduce); with "omnireduce" its rows are summed at the
    aggregators."""
    reset_metrics()
    train(*pair(scheme, sparse=True))
    ran = {m["scheme"] for m in metrics().values()}
    # auto tries both ways (steps 1 and 2), then keeps the faster
    ways = {"auto": {"rows", "rows+omnireduce"}, "omnireduce": {"rows+omnireduce"}}
    assert ran & ways.get(scheme, {"rows"}), ran


class Tables(nn.Module):
    """Three sparse tables, two of one row width, and an MLP: DDP gives each table a bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.b = nn.EmbeddingBag(ROWS // 2, DIM, mode="sum", sparse=True)
        self.c = nn.Embedding(ROWS // 4, 8, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM + 8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.a(ids), self.b(ids % (ROWS // 2)),
                                   self.c(ids[:, 0] % (ROWS // 4))], 1))


@pytest.mark.parametrize("scheme", ["allgather", "omnireduce"])
def test_sparse_buckets_reduced_together(scheme: str) -> None:
    """Once their results are known to be small, the tables of one row width are reduced by
    one exchange, the other one alone; every gradient still equals DDP's. (On a device, but
    for "omnireduce", each table goes by the model's group's allgather as it comes.)"""
    reset_metrics()
    torch.manual_seed(0)
    model = Tables()
    ref = DDP(model, bucket_cap_mb=0.1)
    ours = DDP(copy.deepcopy(model), bucket_cap_mb=0.1)
    ours.register_comm_hook(state(scheme), ddp.hook)
    train(ref, ours, steps=4)
    fused = [n for n in metrics() if "+" in n]
    if STAGED and scheme != "omnireduce":
        tables = {n: m["route"] for n, m in metrics().items() if m.get("scheme") == "rows"}
        assert not fused and set(tables.values()) == {"model group"}, tables
    else:
        assert fused and all(n.count("+") == 1 for n in fused), sorted(metrics())


def test_no_sync_accumulates() -> None:
    ref, ours = pair("allgather")
    for m in (ref, ours):
        with m.no_sync():
            nn.functional.mse_loss(m(batch(10)[0]), batch(10)[1]).backward()
        nn.functional.mse_loss(m(batch(11)[0]), batch(11)[1]).backward()
    assert_grads_equal(ref, ours)


def test_unused_parameters() -> None:
    train(*pair("auto", unused=True, find_unused_parameters=True), steps=2)


def test_metrics_name_the_buckets() -> None:
    assert metrics() and all(k.startswith("ddp.bucket") for k in metrics()), sorted(metrics())


def test_dense_buckets_staged_as_the_horovod_front_end_stages() -> None:
    """One job builder for both front ends (reduction.py): on a device (here
    HVD_SPARSE_CPU_AS_DEVICE) a dense bucket crosses to the host by its non-zero blocks, and
    its metrics say so; sparse buckets go by rows."""
    reset_metrics()
    train(*pair("allgather", sparse=True), steps=2)
    staged = {k: v.get("staged") for k, v in metrics().items()}
    dense = {k: v for k, v in staged.items() if metrics()[k]["scheme"] != "rows"}
    assert dense and all(v == ("cpu" if STAGED else None) for v in dense.values()), staged
    assert any(metrics()[k]["scheme"] == "rows" and v is None for k, v in staged.items())


def test_run_file(tmp_path_factory) -> None:
    """metrics_file under DDP: every rank writes its run file ({rank}), one record per bucket
    reduction, for `hvd-sparse analyze`."""
    from hvd_sparse import runfile
    out = tmp_path_factory.mktemp(f"run{dist.get_rank()}")
    st = ddp.State(scheme="allgather", probe="off", metrics_file=str(out / "run.{rank}.json"))
    try:
        torch.manual_seed(0)
        ours = DDP(Net(), bucket_cap_mb=0.1)
        ours.register_comm_hook(st, ddp.hook)
        for step in range(2):
            nn.functional.mse_loss(ours(batch(step)[0]), batch(step)[1]).backward()
        path = runfile.flush()
    finally:
        st.close()
        runfile.stop()
    assert path == out / f"run.{dist.get_rank()}.json", path
    doc = runfile.load(path)
    names = {r["name"] for r in doc["records"]}
    assert names and all(n.startswith("ddp.bucket") for n in names), names
    assert doc["world_size"] == dist.get_world_size() and doc["rank"] == dist.get_rank(), doc


def test_static_graph() -> None:
    train(*pair("allgather", static_graph=True))


class Wide(nn.Module):
    """Several sparse tables and an MLP wide enough for several dense buckets: in DDP's first
    static-graph iteration every bucket says index 0 and none says it is the last."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.b = nn.EmbeddingBag(ROWS // 2, DIM, mode="sum", sparse=True)
        self.c = nn.Embedding(ROWS // 4, 8, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM + 8, 256), nn.ReLU(), nn.Linear(256, 128),
                                 nn.ReLU(), nn.Linear(128, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.a(ids), self.b(ids % (ROWS // 2)),
                                   self.c(ids[:, 0] % (ROWS // 4))], 1))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_static_graph_sparse_and_dense_buckets(scheme: str) -> None:
    """static_graph=True with three sparse tables and several dense buckets, then a step
    accumulated under no_sync: every gradient equals DDP's own."""
    torch.manual_seed(0)
    model = Wide()
    ref = DDP(model, bucket_cap_mb=0.05, static_graph=True)
    ours = DDP(copy.deepcopy(model), bucket_cap_mb=0.05, static_graph=True)
    ours.register_comm_hook(state(scheme), ddp.hook)
    train(ref, ours, steps=4)
    for m in (ref, ours):
        m.zero_grad()
        with m.no_sync():
            nn.functional.mse_loss(m(batch(60)[0]), batch(60)[1]).backward()
        nn.functional.mse_loss(m(batch(61)[0]), batch(61)[1]).backward()
    assert_grads_equal(ref, ours)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_join_uneven_inputs(sparse: bool) -> None:
    """Rank r has 2 + r batches; under DDP.join() the ranks that ran out shadow the others'
    reductions with zeros through the hook. Trained with SGD, the hook's model ends equal to
    DDP's own join (its default allreduce), on every rank, and no rank hangs."""
    torch.manual_seed(0)
    model = Net(sparse=sparse)
    ref = DDP(model, bucket_cap_mb=0.1)
    ours = DDP(copy.deepcopy(model), bucket_cap_mb=0.1)
    ours.register_comm_hook(state("auto"), ddp.hook)
    for m in (ref, ours):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        with m.join():
            for step in range(2 + dist.get_rank()):
                opt.zero_grad()
                ids, y = batch(70 + step)
                nn.functional.mse_loss(m(ids), y).backward()
                opt.step()
    for (n, p), q in zip(ref.module.named_parameters(), ours.module.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    same_everywhere({n: p.detach() for n, p in ours.module.named_parameters()})


@pytest.mark.parametrize("scheme", ["allgather", "omnireduce"])
def test_nan_gradient_reaches_every_rank_as_ddps(scheme: str) -> None:
    """One rank's gradient holds a NaN: every rank gets it where DDP's allreduce puts it
    (omnireduce sends such a bucket dense), the other values exact."""
    ref, ours = pair(scheme)
    for m in (ref, ours):
        if dist.get_rank() == 1:
            m.module.emb.weight.register_hook(lambda g: g.index_put((torch.tensor([7]),
                                                                     torch.tensor([3])),
                                                                    torch.tensor(float("nan"))))
        ids, y = batch(20)
        nn.functional.mse_loss(m(ids), y).backward()
    g = ours.module.emb.weight.grad
    assert torch.isnan(g[7, 3]) and int(torch.isnan(g).sum()) == 1
    assert_grads_equal(ref, ours)


@pytest.mark.parametrize("fallback", ["error", "dense"])
def test_dead_aggregator(fallback: str) -> None:
    """Rank 0 kills the aggregators it started: backward raises naming the aggregator and the
    bucket on every rank (fallback "error"), or the buckets go dense and equal DDP's."""
    torch.manual_seed(0)
    st = ddp.State(scheme="omnireduce", probe="off", timeout=4, fallback=fallback)
    try:
        ref, ours = pair("dense")  # then re-hooked on the state whose aggregators die
        ours = DDP(copy.deepcopy(ref.module), bucket_cap_mb=0.1)
        ours.register_comm_hook(st, ddp.hook)
        addrs = [f"{h}:{p}" for h, p in st.omni.addrs]
        if dist.get_rank() == 0:
            st.omni.local.stop()
        dist.barrier()
        ids, y = batch(30)
        nn.functional.mse_loss(ref(ids), y).backward()
        loss = nn.functional.mse_loss(ours(ids), y)
        if fallback == "dense":
            loss.backward()
            assert_grads_equal(ref, ours)
            return
        with pytest.raises(Exception) as e:
            loss.backward()
        # the hook's own message, not DDP's "Unable to cast ... to Tensor"
        assert any(a in str(e.value) for a in addrs) and "ddp.bucket" in str(e.value), \
            str(e.value)
        assert "Unable to cast" not in str(e.value), str(e.value)
    finally:
        st.close()


def test_unreachable_aggregator_fails_the_state() -> None:
    with pytest.raises(HvdSparseError, match="127.0.0.1:9"):
        ddp.State(scheme="omnireduce", probe="off", timeout=2, aggregators="127.0.0.1:9",
                  auth=False)
    # authenticated (the default), configured aggregators need the deployment's secret
    with pytest.raises(HvdSparseError, match="HVD_SPARSE_SECRET_FILE"):
        ddp.State(scheme="omnireduce", probe="off", timeout=2, aggregators="127.0.0.1:9")


@pytest.mark.parametrize("make", [lambda: TopK(density=0.05), lambda: ExDyna(density=0.05)],
                         ids=["topk", "exdyna"])
def test_sparsifier_per_parameter(make) -> None:
    """A sparsifier in the hook: each parameter's gradient sparsified with its own error
    feedback, then averaged; the reference sparsifies the same local gradients with a twin
    sparsifier and averages them with a float64 all_reduce."""
    torch.manual_seed(0)
    model = Net()
    local = copy.deepcopy(model)
    twin = make()
    twin.join(dist.get_rank(), dist.get_world_size())
    st = ddp.State(scheme="allgather", probe="off", sparsifier=make(),
                   named_parameters=model.named_parameters())
    try:
        ours = DDP(model, bucket_cap_mb=0.1)
        ours.register_comm_hook(st, ddp.hook)
        for step in range(3):
            ids, y = batch(40 + step)
            for m in (ours, local):
                m.zero_grad()
                nn.functional.mse_loss(m(ids), y).backward()
            for n, p in local.named_parameters():
                twin(n, p.grad, st.config.block_size)
                ref = p.grad.double()
                dist.all_reduce(ref)
                ref /= dist.get_world_size()
                twin.observe(n, ref.float(), st.config.block_size)  # ExDyna adapts to it
                got = dict(model.named_parameters())[n].grad
                torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=n: f"{n}: {m}")
        sparsified = [k for k, v in metrics().items() if "achieved_density" in v]
        assert "emb.weight" in sparsified, sorted(metrics())
        # the MLP's tensors (under 16,384 elements) went out whole, reduced apart from their
        # bucket's sparsified table, by a ring allreduce
        whole = {k: v["scheme"] for k, v in metrics().items() if k.endswith(".whole")}
        assert whole and set(whole.values()) == {"dense"}, whole
    finally:
        st.close()


def two_steps_with_topk(first: int) -> tuple[Net, ddp.State, DDP, torch.optim.Optimizer]:
    """A model trained two SGD steps (batches ``first``, ``first + 1``) under the hook with
    TopK(0.05): (the model, its state, its DDP, its optimizer)."""
    torch.manual_seed(0)
    model = Net()
    state = ddp.State(sparsifier=TopK(density=0.05), named_parameters=model.named_parameters(),
                      scheme="allgather", probe="off")
    run = DDP(model, bucket_cap_mb=0.1)
    run.register_comm_hook(state, ddp.hook)
    opt = torch.optim.SGD(run.parameters(), lr=0.05)
    for step in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(run(batch(first + step)[0]), batch(first + step)[1]).backward()
        opt.step()
    return model, state, run, opt


def assert_same_step(run: DDP, resumed: DDP, sparsifier, at: int) -> None:
    """Batch ``at`` through both: the resumed run's gradients equal the uninterrupted one's."""
    for m in (run, resumed):
        nn.functional.mse_loss(m(batch(at)[0]), batch(at)[1]).backward()
    for (n, p), q in zip(run.module.named_parameters(), resumed.module.parameters(),
                         strict=True):
        if sparsifier.too_small(p.numel()):
            # sent whole by a ring allreduce, whose order of sums follows the place in the
            # bucket, and DDP rebuilds its buckets after the first step: float rounding
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=n)
        else:  # sparsified: blocks summed in rank order, wherever they lie
            assert torch.equal(p.grad, q.grad), n


def test_checkpoint_resumes_the_sparsifier(tmp_path_factory) -> None:
    """Two steps, then a checkpoint (model, optimizer, hook state) loaded into a new model and
    a new State: the third step's sparsified gradients equal the uninterrupted run's to the
    bit."""
    model, a, run, opt = two_steps_with_topk(50)
    path = tmp_path_factory.mktemp(f"ckpt{dist.get_rank()}") / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": a.state_dict()},
               path)
    ckpt = torch.load(path)
    twin = Net()
    twin.load_state_dict(ckpt["model"])
    b = ddp.State(sparsifier=TopK(density=0.05), named_parameters=twin.named_parameters(),
                  scheme="allgather", probe="off")
    b.load_state_dict(ckpt["hook"])
    resumed = DDP(twin, bucket_cap_mb=0.1)
    resumed.register_comm_hook(b, ddp.hook)
    try:
        opt.zero_grad()
        assert_same_step(run, resumed, b.sparsifier, 52)
    finally:
        a.close()
        b.close()


def test_state_pickles_and_resumes(tmp_path_factory) -> None:
    """The State itself in the checkpoint (torch.save, as PowerSGDState is saved): loaded, it
    holds no group or thread, keeps the sparsifier's memory and what auto learnt, asks for the
    parameters' names before its first bucket, then joins the ranks there and resumes: the
    third step's sparsified gradients equal the uninterrupted run's to the bit."""
    model, a, run, opt = two_steps_with_topk(80)
    a.context.union_ratio["probe.entry", (0, 1)] = 0.25  # stands for what auto learns
    path = tmp_path_factory.mktemp(f"pickled{dist.get_rank()}") / "ckpt.pt"
    torch.save({"model": model.state_dict(), "hook": a}, path)
    b = torch.load(path, weights_only=False)["hook"]
    assert b.context is None and not b.streams and b.process_group is None
    twin = Net()
    twin.load_state_dict(torch.load(path, weights_only=False)["model"])
    unnamed = DDP(copy.deepcopy(twin), bucket_cap_mb=0.1)
    unnamed.register_comm_hook(b, ddp.hook)
    with pytest.raises(RuntimeError, match="set_names"):
        nn.functional.mse_loss(unnamed(batch(82)[0]), batch(82)[1]).backward()
    b.set_names(twin.named_parameters())
    resumed = DDP(twin, bucket_cap_mb=0.1)
    resumed.register_comm_hook(b, ddp.hook)
    try:
        opt.zero_grad()
        assert_same_step(run, resumed, b.sparsifier, 82)
        assert b.context.union_ratio["probe.entry", (0, 1)] == 0.25
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_bfloat16_on_the_wire(sparse: bool) -> None:
    """State(wire="bf16"): the buckets travel as bfloat16 (summed in float32, rounded once),
    within a bfloat16 step or two of DDP's own float32 average, the same on every rank."""
    torch.manual_seed(0)
    model = Net(sparse=sparse)
    ref, ours = DDP(model, bucket_cap_mb=0.1), DDP(copy.deepcopy(model), bucket_cap_mb=0.1)
    st = ddp.State(scheme="allgather", probe="off", wire="bf16")
    ours.register_comm_hook(st, ddp.hook)
    try:
        reset_metrics()
        ids, y = batch(0)
        for m in (ref, ours):
            nn.functional.mse_loss(m(ids), y).backward()
        a, b = grads(ref), grads(ours)
        for n in a:  # each rank's value rounded (2**-8 of it), the sum rounded once: where
            # the ranks' values cancel, the error is the inputs' scale's, not the sum's
            torch.testing.assert_close(b[n], a[n], rtol=2 ** -7,
                                       atol=2 ** -7 * float(a[n].abs().max()),
                                       msg=lambda m, n=n: f"{n}: {m}")
        same_everywhere(b)
        assert {v.get("wire") for v in metrics().values()} == {"bfloat16"}, metrics()
    finally:
        st.close()
