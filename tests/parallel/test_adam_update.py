"""sparsify="update" (issue 52), 2 ranks: with Adam or AdamW,
hvd_sparse.DistributedOptimizer(..., sparsify="update") steps each rank's optimizer on that rank's
own gradients and averages what it applied, sparsified with error feedback. Held to a reference
that runs one plain torch optimizer per rank and averages their parameters; sparsified, every
rank still holds the same parameters and the optimizer's state_dict is plain torch's.
"""
from __future__ import annotations

import copy

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import start
from torch import nn

import hvd_sparse

LAUNCHES = [Launch(np=2, timeout=300)]
OPTS = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def init() -> None:
    start(probe="off", timeout=30)


def net() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)


def train(opt_name: str, sparsifier: hvd_sparse.Sparsifier | None, tag: str,
          sparsify: str = "update") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = net()
    names = [(f"{tag}.{n}", p) for n, p in model.named_parameters()]
    opt = hvd_sparse.DistributedOptimizer(OPTS[opt_name](model.parameters()),
                                          named_parameters=names, sparsifier=sparsifier,
                                          scheme="allgather", block_size=1, sparsify=sparsify)
    for t in range(STEPS):
        x, y = batch(hvd.rank(), t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def reference(opt_name: str) -> list[torch.Tensor]:
    """One plain optimizer per rank on that rank's batches, each step from the averaged
    parameters; the parameters averaged after each step."""
    shared = net()
    copies = [copy.deepcopy(shared) for _ in range(hvd.size())]
    opts = [OPTS[opt_name](c.parameters()) for c in copies]
    for t in range(STEPS):
        for r, (c, o) in enumerate(zip(copies, opts, strict=True)):
            c.load_state_dict(shared.state_dict())
            x, y = batch(r, t)
            o.zero_grad()
            nn.functional.mse_loss(c(x), y).backward()
            o.step()
        with torch.no_grad():
            for i, p in enumerate(shared.parameters()):
                p.copy_(torch.stack([list(c.parameters())[i] for c in copies]).mean(0))
    return [p.detach() for p in shared.parameters()]


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_dense_update_average_matches_per_rank_optimizers(opt_name):
    # density 1: nothing held back, so the result is the plain average of the ranks' steps
    model, _ = train(opt_name, hvd_sparse.TopK(1.0, min_numel=0, min_selected=0),
                     f"full.{opt_name}")
    for p, want in zip(model.parameters(), reference(opt_name), strict=True):
        assert torch.allclose(p.detach(), want, atol=1e-6), float((p - want).abs().max())


@pytest.mark.parametrize("opt_name", list(OPTS))
def test_sparsified_update_keeps_ranks_identical_and_state_dict_plain(opt_name):
    sp = hvd_sparse.TopK(0.05, min_numel=0, min_selected=0)
    model, opt = train(opt_name, sp, f"sparse.{opt_name}")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name=f"check.{opt_name}")
    assert all(torch.equal(everyone[0], row) for row in everyone), "ranks differ"
    # not the dense average: 5% of each update went out a step, the rest waits in the memory
    dense = torch.cat([p.reshape(-1) for p in reference(opt_name)])
    assert not torch.allclose(flat, dense, atol=1e-6)
    assert sum(float(r.abs().sum()) for r in sp.memory.residuals.values()) > 0
    # the optimizer's own state, keyed and shaped as torch's, loads into a plain optimizer
    state = opt.state_dict()
    plain = OPTS[opt_name](net().parameters())
    plain.load_state_dict({k: v for k, v in state.items()
                           if k != hvd_sparse.optimizer.SPARSIFIER_KEY})
    for p, (i, s) in zip(model.parameters(), sorted(state["state"].items()), strict=True):
        assert set(s) == {"step", "exp_avg", "exp_avg_sq"}, (i, set(s))
        assert s["exp_avg"].shape == p.shape and int(s["step"]) == STEPS
    again = hvd_sparse.DistributedOptimizer(OPTS[opt_name](model.parameters()),
                                            named_parameters=model.named_parameters(),
                                            sparsifier=hvd_sparse.TopK(0.05, min_numel=0),
                                            sparsify="update")
    again.load_state_dict(state)
    assert again.state_dict()[hvd_sparse.optimizer.SPARSIFIER_KEY]["memory"].keys() \
        == state[hvd_sparse.optimizer.SPARSIFIER_KEY]["memory"].keys()


def test_update_leaves_gradients_local_and_gradient_is_the_default():
    """sparsify="update": the gradients stay this rank's own (the update is what is reduced);
    the default, "gradient", averages them before the step, for Adam as for SGD."""
    def grads_after_step(make, sparsify: str | None, tag: str) -> bool:
        model = net()
        kw = {} if sparsify is None else {"sparsify": sparsify}
        opt = hvd_sparse.DistributedOptimizer(
            make(model.parameters()), named_parameters=[(f"{tag}.{n}", p) for n, p in
                                                        model.named_parameters()],
            sparsifier=hvd_sparse.TopK(1.0, min_numel=0, min_selected=0), scheme="allgather",
            block_size=1, **kw)
        x, y = batch(hvd.rank(), 0)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).unsqueeze(0)
        every = hvd.allgather(g, name=f"grads.{tag}")
        return bool(torch.equal(every[0], every[1]))

    assert not grads_after_step(OPTS["adam"], "update", "upd.adam")
    assert not grads_after_step(lambda ps: torch.optim.SGD(ps, lr=0.1), "update", "upd.sgd")
    assert grads_after_step(OPTS["adam"], "gradient", "grad.adam")
    assert grads_after_step(OPTS["adamw"], None, "default.adamw")


def test_sparsify_is_checked():
    with pytest.raises(ValueError, match="sparsify must be one of"):
        hvd_sparse.DistributedOptimizer(torch.optim.Adam(net().parameters()),
                                        sparsifier=hvd_sparse.TopK(0.1), sparsify="auto")
