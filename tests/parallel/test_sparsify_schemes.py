"""Sparsifiers under every scheme and both APIs: the reduced gradient must be Horovod's dense
allreduce of the sparsified gradients.

The reference runs a second, identical sparsifier on the raw gradient (computed on a copy of the
model) and reduces the result with hvd.allreduce; it observes that result, so both sparsifiers
stay in the same state (ExDyna's partitions and threshold). 4 ranks; 2 ranks on the path of GPU
tensors (HVD_SPARSE_CPU_AS_DEVICE: sparsified by torch operations, staged through host memory);
HVD_SPARSE_TEST_DEVICE=cuda: the model (so the sparsifiers and their memory) on the GPU, the
reference on the CPU (hvd_sparse._C's kernels).
"""
from __future__ import annotations

import copy
import io

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import DEVICE, close_to, codec_paths, start
from torch import nn

import hvd_sparse
from hvd_sparse import device

LAUNCHES = [Launch(np=2, timeout=300), Launch(np=4, timeout=300, extended=True),
            Launch(np=2, id="staged-np2", env={"HVD_SPARSE_CPU_AS_DEVICE": "1"}, timeout=300),
            Launch(np=4, id="cuda-np4", env={"HVD_SPARSE_TEST_DEVICE": "cuda"}, gpu=True,
                   timeout=600)]
SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
SPARSIFIERS = {"topk": lambda: hvd_sparse.TopK(0.01), "exdyna": lambda: hvd_sparse.ExDyna(0.01),
               "dgc": lambda: hvd_sparse.DGC(0.05)}
BLOCK = 4
# Every scheme under both APIs; the sparsifiers spread over them (each runs under two schemes).
CASES = [(s, "optimizer", "exdyna") for s in SCHEMES] + [
    (s, "compression", "topk") for s in SCHEMES] + [
    ("allgather", "compression", "dgc"), ("zen", "optimizer", "dgc")]


def check(scheme: str, api: str, kind: str) -> str:
    torch.manual_seed(0)
    model = nn.Linear(300, 200).to(DEVICE)  # 240 kB of weight: "auto" considers sparse schemes
    sp, twin = SPARSIFIERS[kind](), SPARSIFIERS[kind]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if api == "optimizer":
        opt = hvd_sparse.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                              scheme=scheme, block_size=BLOCK, sparsifier=sp)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvd_sparse.Compression.sparse(
                                           scheme=scheme, block_size=BLOCK, sparsifier=sp))
    g = torch.Generator().manual_seed(hvd.rank())
    for step in range(2):
        x = torch.randn(16, 300, generator=g)
        shadow = copy.deepcopy(model).cpu()
        raw = torch.autograd.grad(shadow(x).pow(2).mean(), list(shadow.parameters()))
        ref = {}
        for (n, _), r in zip(model.named_parameters(), raw, strict=True):
            r = twin(n, r.clone(), BLOCK)
            ref[n] = hvd.allreduce(r, name=f"ref.{scheme}.{api}.{kind}.{n}.{step}")
            twin.observe(n, ref[n], BLOCK)
        opt.zero_grad()
        model(x.to(DEVICE)).pow(2).mean().backward()
        opt.synchronize()
        for n, p in model.named_parameters():
            err = close_to(p.grad, ref[n].double(), torch.float32, DEVICE)
            if err != "":
                return f"step {step}, {n}: {err}"
        with opt.skip_synchronize():
            opt.step()
    name = "weight" if api == "optimizer" else "grad.weight"
    m = hvd_sparse.metrics()[name]
    if m["sparsifier"] != type(sp).__name__ or "union" not in m:
        return f"metrics lack the sparsifier's fields: {m}"
    if ("staged" in m) != (DEVICE != "cpu" or device.CPU_AS_DEVICE):
        return f"staged through host memory or not, unlike the tensor's device: {m}"
    # the bias (200 elements, 2 or 10 of them selected) went out whole: by a ring allreduce
    bias = hvd_sparse.metrics()["bias" if api == "optimizer" else "grad.bias"]
    if bias.get("scheme") != "dense":
        return f"the whole bias went by {bias.get('scheme')}, not dense: {bias}"
    return ""


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start()


@pytest.mark.parametrize("scheme,api,kind", CASES, ids=[".".join(c) for c in CASES])
def test_reduces_the_sparsified_gradient_like_dense_allreduce(scheme, api, kind):
    assert check(scheme, api, kind) == ""


@pytest.mark.parametrize("kind", ["topk", "exdyna", "dgc"])
def test_resumed_optimizer_continues_bit_for_bit(kind):
    """hvd_sparse.DistributedOptimizer's state_dict carries its sparsifier's state (this
    rank's residuals): a run stopped after 2 steps and resumed from model and optimizer state
    (through torch.save/torch.load) gives the uninterrupted run's third step exactly."""
    def make(model: nn.Module) -> torch.optim.Optimizer:
        return hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if kind == "dgc" else 0.5),
            named_parameters=model.named_parameters(), scheme="allgather", block_size=BLOCK,
            sparsifier=SPARSIFIERS[kind]())

    torch.manual_seed(0)
    model = nn.Linear(300, 200)
    opt = make(model)
    g = torch.Generator().manual_seed(hvd.rank())
    xs = [torch.randn(16, 300, generator=g) for _ in range(3)]

    def step(m: nn.Module, o: torch.optim.Optimizer, x: torch.Tensor) -> None:
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()

    for x in xs[:2]:
        step(model, opt, x)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    assert "hvd_sparse.sparsifier" in ckpt["opt"]
    resumed = nn.Linear(300, 200)
    resumed.load_state_dict(ckpt["model"])
    ropt = make(resumed)
    ropt.load_state_dict(ckpt["opt"])
    assert ropt._parameter_names[resumed.weight] == "weight"
    step(model, opt, xs[2])
    step(resumed, ropt, xs[2])
    for (n, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("api", ["optimizer", "compression"])
def test_dgc_takes_the_optimizers_momentum(api):
    """SGD(momentum=0.9) with DGC, as users write it: the momentum moves into DGC with a
    warning and the training equals, bit for bit, the run written the DGC way (SGD without
    momentum, DGC(momentum=0.9)); with optimizer_momentum="error" it is refused, saying what to
    do; a Nesterov optimizer is refused too."""
    def run(sgd_momentum: float, dgc_momentum: float) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Linear(300, 200)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=sgd_momentum)
        dgc = hvd_sparse.DGC(0.05, momentum=dgc_momentum)
        opt = (hvd_sparse.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(), scheme="allgather",
            block_size=BLOCK, sparsifier=dgc) if api == "optimizer" else
            hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                     compression=hvd_sparse.Compression.sparse(
                                         scheme="allgather", block_size=BLOCK, sparsifier=dgc)))
        opt.dgc = dgc
        g = torch.Generator().manual_seed(hvd.rank())
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, 300, generator=g)).pow(2).mean().backward()
            opt.step()
        return model, opt

    with pytest.warns(UserWarning, match="momentum 0.9 moves into DGC"):
        moved, opt = run(0.9, 0.5)
    assert opt.param_groups[0]["momentum"] == 0.0 and opt.dgc.momentum == 0.9
    written, _ = run(0.0, 0.9)
    for (n, p), q in zip(moved.named_parameters(), written.parameters(), strict=True):
        assert torch.equal(p, q), n
    if api == "compression":  # the refusals come at construction, from our optimizer
        return
    model = nn.Linear(4, 4)
    for kw, dgc in (({"momentum": 0.9}, {"optimizer_momentum": "error"}),
                    ({"momentum": 0.9, "nesterov": True}, {})):
        with pytest.raises(ValueError, match="give the optimizer momentum=0"):
            hvd_sparse.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, **kw),
                                            named_parameters=model.named_parameters(),
                                            sparsifier=hvd_sparse.DGC(0.05, **dgc))


def test_the_codec_ran_on_the_path_of_this_launch():
    """Last: CUDA tensors took the kernels, CPU tensors posing as a device's torch operations."""
    assert codec_paths() == ""
