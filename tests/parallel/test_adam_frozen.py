"""sparsify="frozen", 2 ranks: 1-bit Adam's recipe with a sparsifier
(hvd_sparse.DistributedOptimizer(adam, sparsifier=..., sparsify="frozen", dense_steps=W)).
Held to a float64 reference written here from the recipe alone: plain torch Adam/AdamW on the
ranks' averaged gradients for W steps, then, per rank, error feedback on Adam's momentum of
g / d (u = b1 u + g / d, e += u; u not masked where sent) with an exact top-k, and the
average of what was sent as the step, with d = sqrt(v_hat) + eps frozen (without error
feedback: top-k of g / d, Adam's momentum on the average); at steps 2W and 3W (refresh_cap 3)
dense steps that refresh v weighted by the steps since the last. Every rank ends with the same
parameters, the warm-up goes dense, and the optimizer's state_dict loads into plain torch and
resumes the run exactly. With local_updates, each rank's parameters are the agreed ones minus
lr (1 - b1) times its own residual (its gradient taken there), the refreshes and flush()
average the residuals in.
"""
from __future__ import annotations

import copy
import io

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import start
from torch import nn

import hvd_sparse
from hvd_sparse.optimizer import CONSENSUS_KEY, FROZEN_FLOOR, STEPS_KEY

LAUNCHES = [Launch(np=2, timeout=300)]
OPTS = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}
WARM, STEPS, DENSITY, CAP = 3, 13, 0.1, 3
# the dense steps after the warm-up below STEPS: 2W (doubling), then every CAP W: 3W; not 4W
REFRESH = (6, 9)


@pytest.fixture(scope="module", autouse=True)
def init() -> None:
    start(probe="off", timeout=30)


def net() -> nn.Module:
    # tensors of at most 1,000 elements: DGC's sampled threshold is then exact (a top-k)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def make(opt_name: str, model: nn.Module, tag: str, sparsifier: str,
         local: bool = False) -> torch.optim.Optimizer:
    kw = {"min_numel": 0, "min_selected": 0}
    sp = (hvd_sparse.DGC(DENSITY, **kw) if sparsifier == "dgc"
          else hvd_sparse.TopK(DENSITY, error_feedback=sparsifier != "noef", **kw))
    return hvd_sparse.DistributedOptimizer(
        OPTS[opt_name](model.parameters()),
        named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
        sparsifier=sp, scheme="allgather", block_size=1, sparsify="frozen", dense_steps=WARM,
        local_updates=local, refresh_cap=CAP)


def run(opt: torch.optim.Optimizer, model: nn.Module, steps: range) -> None:
    for t in steps:
        x, y = batch(hvd.rank(), t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """x with all but its k largest magnitudes zeroed."""
    out = torch.zeros_like(x)
    idx = x.abs().reshape(-1).topk(k).indices
    out.reshape(-1)[idx] = x.reshape(-1)[idx]
    return out


def reference(opt_name: str, sparsifier: str, local: bool = False
              ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The recipe in float64, every rank simulated here.

    Returns:
        (the agreed parameters, per rank its residuals scaled as a step: lr (1 - b1) e).
    """
    shared = net().double()
    params = list(shared.parameters())
    adam = OPTS[opt_name](params)
    group = adam.param_groups[0]
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    n = hvd.size()
    resid = [[torch.zeros_like(p) for p in params] for _ in range(n)]
    veloc = [[torch.zeros_like(p) for p in params] for _ in range(n)]
    denoms: list[torch.Tensor] = []
    last = WARM - 1  # the last dense step

    def denominators(v_steps: int) -> list[torch.Tensor]:
        out = []
        for p in params:
            d = (adam.state[p]["exp_avg_sq"] / (1 - b2 ** v_steps)).sqrt() + eps
            out.append(d.clamp(min=FROZEN_FLOOR * float(d.mean())))
        return out

    ef = sparsifier != "noef"
    for t in range(STEPS):
        grads = []
        for r in range(n):
            c = copy.deepcopy(shared)
            if local and t >= WARM:  # where this rank's own unsent momentum took it
                with torch.no_grad():
                    for q, e in zip(c.parameters(), resid[r], strict=True):
                        q.sub_(lr * (1 - b1) * e)
            x, y = batch(r, t)
            nn.functional.mse_loss(c(x.double()), y.double()).backward()
            grads.append([p.grad for p in c.parameters()])
        if t < WARM:  # plain torch Adam on the average
            for i, p in enumerate(params):
                p.grad = sum(g[i] for g in grads) / n
            adam.step()
            continue
        if not denoms:
            denoms = denominators(WARM)
        with torch.no_grad():
            if t in REFRESH:  # v takes the dense average as the gradient of the steps since
                keep = b2 ** (t - last)
                for i, p in enumerate(params):
                    g = sum(gr[i] for gr in grads) / n
                    adam.state[p]["exp_avg_sq"].mul_(keep).add_((1 - keep) * g * g)
                denoms, last = denominators(t + 1), t
            for i, p in enumerate(params):
                d, k = denoms[i], max(1, round(DENSITY * p.numel()))
                sent = []
                if t in REFRESH:  # the dense average, in units of d, nothing sparsified
                    sent = [g[i] / d for g in grads]
                for r in range(n if t not in REFRESH else 0):
                    if ef:  # u = b1 u + g/d; e += u; send top-k of e
                        veloc[r][i] = b1 * veloc[r][i] + grads[r][i] / d
                        resid[r][i] += veloc[r][i]
                    else:
                        resid[r][i] = grads[r][i] / d
                    s = topk(resid[r][i], k)
                    resid[r][i] -= s  # u goes on: Adam's momentum, exact (no masking)
                    sent.append(s)
                avg = sum(sent) / n
                if wd:  # AdamW: decoupled
                    p.mul_(1 - lr * wd)
                st = adam.state[p]
                st["step"] += 1
                if ef:
                    p.sub_(lr * (1 - b1) * avg)
                else:
                    st["exp_avg"].mul_(b1).add_(avg * d, alpha=1 - b1)
                    p.sub_(lr / (1 - b1 ** float(st["step"])) * st["exp_avg"] / d)
                if local and t in REFRESH:  # the refresh flushes the residuals
                    p.sub_(lr * (1 - b1) * sum(e[i] for e in resid) / n)
                    for e in resid:
                        e[i].zero_()
    return ([p.detach() for p in params],
            [[lr * (1 - b1) * e for e in rank] for rank in resid])


def identical_on_every_rank(model: nn.Module, tag: str) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name=f"same.{tag}")
    return all(torch.equal(every[0], row) for row in every)


@pytest.mark.parametrize("opt_name,sparsifier", [("adam", "topk"), ("adamw", "topk"),
                                                 ("adam", "dgc"), ("adam", "noef")])
def test_frozen_matches_float64_reference(opt_name, sparsifier):
    tag = f"frozen.{opt_name}.{sparsifier}"
    model = net()
    opt = make(opt_name, model, tag, sparsifier)
    run(opt, model, range(WARM))
    first = f"{tag}.0.weight"
    assert hvd_sparse.metrics()[first]["scheme"] == "dense", "the warm-up goes dense"
    v_at_freeze = opt.state[model[0].weight]["exp_avg_sq"].clone()
    run(opt, model, range(WARM, REFRESH[0]))
    assert torch.equal(opt.state[model[0].weight]["exp_avg_sq"], v_at_freeze), "v moved"
    v_refreshed = v_at_freeze
    for t, end in zip(REFRESH, (*REFRESH[1:], STEPS), strict=True):
        run(opt, model, range(t, t + 1))
        assert hvd_sparse.metrics()[first]["scheme"] == "dense", f"the refresh at {t} is dense"
        assert not torch.equal(opt.state[model[0].weight]["exp_avg_sq"], v_refreshed)
        v_refreshed = opt.state[model[0].weight]["exp_avg_sq"].clone()
        run(opt, model, range(t + 1, end))
        m = hvd_sparse.metrics()[first]
        assert m["scheme"] == "allgather" and m["selected"] == round(DENSITY * 512), m
        assert torch.equal(opt.state[model[0].weight]["exp_avg_sq"], v_refreshed), "v moved"
    assert identical_on_every_rank(model, tag), "ranks differ"
    ref, _ = reference(opt_name, sparsifier)
    for (name, p), want in zip(model.named_parameters(), ref, strict=True):
        err = float((p.detach().double() - want).abs().max())
        assert err < 2e-5, f"{name}: max abs error {err:g} against the float64 reference"
    # sparsified, so not the dense Adam run: the reference's own dense run differs
    dense = net()
    plain = OPTS[opt_name](dense.parameters())
    for t in range(STEPS):
        plain.zero_grad()
        sum(nn.functional.mse_loss(dense(x), y) for x, y in
            (batch(r, t) for r in range(hvd.size()))).div(hvd.size()).backward()
        plain.step()
    assert max(float((a - b).detach().abs().max()) for a, b in
               zip(model.parameters(), dense.parameters(), strict=True)) > 1e-4


@pytest.mark.parametrize("opt_name,sparsifier", [("adam", "topk"), ("adamw", "topk"),
                                                 ("adam", "dgc")])
def test_local_updates_match_float64_reference(opt_name, sparsifier):
    tag = f"local.{opt_name}.{sparsifier}"
    model = net()
    opt = make(opt_name, model, tag, sparsifier, local=True)
    run(opt, model, range(STEPS))
    agreed, own = reference(opt_name, sparsifier, local=True)
    me = hvd.rank()
    for (name, p), x, e in zip(model.named_parameters(), agreed, own[me], strict=True):
        err = float((p.detach().double() - (x - e)).abs().max())
        assert err < 2e-5, f"{name}: max abs error {err:g} against the float64 reference"
    assert not identical_on_every_rank(model, tag + ".before"), "nothing kept back?"
    opt.flush()
    assert hvd_sparse.metrics()[f"{tag}.0.weight.flush"]["scheme"] == "dense"
    assert identical_on_every_rank(model, tag), "ranks differ after flush()"
    for (name, p), x, *es in zip(model.named_parameters(), agreed, *own, strict=True):
        want = x - sum(es) / len(es)
        err = float((p.detach().double() - want).abs().max())
        assert err < 2e-5, f"{name}: after flush, max abs error {err:g}"
    # a checkpoint mid-run (the agreed values in it) resumes to the same bits
    straight = net()
    o = make(opt_name, straight, tag + ".straight", sparsifier, local=True)
    run(o, straight, range(STEPS))
    half = net()
    o = make(opt_name, half, tag + ".half", sparsifier, local=True)
    run(o, half, range(WARM + 1))
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "opt": o.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    assert ckpt["opt"][CONSENSUS_KEY][0] is not None
    resumed = net()
    resumed.load_state_dict(ckpt["model"])
    o = make(opt_name, resumed, tag + ".half", sparsifier, local=True)
    o.load_state_dict(ckpt["opt"])
    run(o, resumed, range(WARM + 1, STEPS))
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())


def test_frozen_state_dict_loads_into_plain_torch_and_resumes_exactly():
    straight = net()
    opt = make("adam", straight, "straight", "topk")
    run(opt, straight, range(STEPS))

    model = net()
    opt = make("adam", model, "resumed", "topk")
    run(opt, model, range(WARM + 4))  # past the refresh at 2W
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    assert ckpt["opt"][STEPS_KEY] == WARM + 4
    plain = torch.optim.Adam(net().parameters(), lr=1e-2)
    plain.load_state_dict(ckpt["opt"])  # plain torch's: the extra keys are ignored
    assert set(plain.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    model = net()
    model.load_state_dict(ckpt["model"])
    opt = make("adam", model, "resumed", "topk")
    opt.load_state_dict(ckpt["opt"])
    run(opt, model, range(WARM + 4, STEPS))
    for a, b in zip(model.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())


def test_frozen_is_checked(monkeypatch):
    ps = list(net().parameters())
    sp = hvd_sparse.TopK(0.1)
    with pytest.raises(ValueError, match="torch.optim.Adam or AdamW, got SGD"):
        hvd_sparse.DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), sparsifier=sp,
                                        sparsify="frozen", dense_steps=5)
    with pytest.raises(ValueError, match="needs dense_steps >= 1"):
        hvd_sparse.DistributedOptimizer(torch.optim.Adam(ps), sparsifier=sp,
                                        sparsify="frozen")
    with pytest.raises(ValueError, match="amsgrad"):
        hvd_sparse.DistributedOptimizer(torch.optim.Adam(ps, amsgrad=True), sparsifier=sp,
                                        sparsify="frozen", dense_steps=5)
    with pytest.raises(ValueError, match="local_updates=True .* needs sparsify='frozen'"):
        hvd_sparse.DistributedOptimizer(torch.optim.Adam(ps), sparsifier=sp, local_updates=True)
    with pytest.raises(ValueError, match="a sparsifier with error feedback"):
        hvd_sparse.DistributedOptimizer(
            torch.optim.Adam(ps), sparsifier=hvd_sparse.TopK(0.1, error_feedback=False),
            sparsify="frozen", dense_steps=5, local_updates=True)
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(ValueError, match="not supported under Horovod elastic"):
        hvd_sparse.DistributedOptimizer(torch.optim.Adam(ps), sparsifier=sp, sparsify="frozen",
                                        dense_steps=5, local_updates=True)
    monkeypatch.delenv("HOROVOD_ELASTIC")
    with pytest.raises(ValueError, match="dense_steps must be an int >= 0"):
        hvd_sparse.DistributedOptimizer(torch.optim.Adam(ps), sparsifier=sp, dense_steps=-1)
    with pytest.raises(ValueError, match="refresh_cap must be an int >= 0"):
        hvd_sparse.DistributedOptimizer(torch.optim.Adam(ps), sparsifier=sp, sparsify="frozen",
                                        dense_steps=5, refresh_cap=-1)
