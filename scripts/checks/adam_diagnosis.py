"""Why Adam loses to error feedback (docs/notes/adam-accuracy.md): one process, no Horovod,
the convergence suite's language model (task ``lm``) on rank 0's batches, Adam lr 3e-3, three
ways for ``--steps``:
dense; TopK at ``--density`` with error feedback on each gradient (what
``DistributedOptimizer(sparsify="gradient")`` does on one rank); TopK with error feedback on
each Adam update (``sparsify="update"``); and a prototype of the next fix, "frozen": 1-bit
Adam's recipe with TopK, ``--warmup`` dense Adam steps, then Adam's second moment frozen and
error feedback on the preconditioned gradient g / (sqrt(v) + eps), the momentum and the step
taken after the (here one-rank) reduction (nothing of it is in hvd_sparse yet). Prints the
held-out loss of each, and per sparsified weight how far it moved (|p_T - p_0|) and the mean of
Adam's sqrt(v), relative to dense.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/checks/adam_diagnosis.py --steps 150
"""
from __future__ import annotations

import argparse
import sys

import torch

import hvd_sparse
from hvd_sparse.tools.lab import accuracy as _accuracy


def run(mode: str, steps: int, density: float, warmup: int = 10,
        floor: float = 1e-3) -> tuple[dict, dict, float]:
    """Trains the LM ``steps`` steps with ``mode`` ("dense", "gradient", "update" or
    "frozen").

    Args:
        mode: what error feedback applies to, or "dense" for none.
        steps: Adam steps.
        density: TopK's density.
        warmup: "frozen": dense Adam steps before the second moment is frozen.
        floor: "frozen": each frozen sqrt(v) + eps is at least this times its tensor's mean.

    Returns:
        (movement per tensor, mean sqrt(v) per tensor, held-out loss in nats/byte).
    """
    task = _accuracy.lm(1, 0, 1)
    model = task.model()
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sp = hvd_sparse.TopK(density, rank=0, size=1)
    batches = (b for e in range(10**6) for b in task.batches(e))
    denoms: dict[str, torch.Tensor] = {}
    for t in range(steps):
        (x,), y = next(batches)
        opt.zero_grad()
        task.loss(model(x), y).backward()
        if mode == "frozen" and t >= warmup:
            frozen_step(opt, model, sp, denoms, warmup, floor)
        elif mode == "gradient":
            for n, p in model.named_parameters():
                sp(n, p.grad)
            opt.step()
        elif mode == "update":
            old = [p.detach().clone() for p in model.parameters()]
            opt.step()
            with torch.no_grad():
                for (n, p), o in zip(model.named_parameters(), old, strict=True):
                    d = o - p
                    sp(n, d)
                    p.copy_(o - d)
        else:
            opt.step()
    moved = {n: float((p.detach() - p0[n]).norm()) for n, p in model.named_parameters()}
    rv = {n: float(opt.state[p]["exp_avg_sq"].sqrt().mean())
          for n, p in model.named_parameters()}
    return moved, rv, task.score(model)


def frozen_step(opt: torch.optim.Adam, model: torch.nn.Module, sp: hvd_sparse.Sparsifier,
                denoms: dict[str, torch.Tensor], warmup: int, floor: float) -> None:
    """One step of the "frozen" prototype: v as Adam had it after ``warmup`` steps (bias
    corrected then), error feedback on g / denom, Adam's momentum on the sent part (kept in
    gradient units in ``exp_avg``, so the state keeps its meaning), then Adam's step.

    Args:
        opt: the Adam whose state is used and updated (exp_avg, step; exp_avg_sq frozen).
        model: the model.
        sp: the sparsifier (its memory: the preconditioned residuals).
        denoms: per tensor, the frozen sqrt(v_hat) + eps (filled at the first call).
        warmup: the steps v was averaged over.
        floor: the frozen denominators are at least this times their tensor's mean.
    """
    g = opt.param_groups[0]
    (b1, b2), lr, eps = g["betas"], g["lr"], g["eps"]
    with torch.no_grad():
        for n, p in model.named_parameters():
            st = opt.state[p]
            if n not in denoms:
                d = (st["exp_avg_sq"] / (1 - b2 ** warmup)).sqrt() + eps
                # a coordinate never seen in the warm-up (v = 0) would step by g / eps
                denoms[n] = d.clamp_(min=floor * float(d.mean()))
            d = denoms[n]
            u = p.grad / d
            sp(n, u)  # u: the sent part of the residual, averaged over ranks in a real job
            st["step"] += 1
            st["exp_avg"].mul_(b1).add_(u * d, alpha=1 - b1)
            p.sub_(lr / (1 - b1 ** float(st["step"])) * st["exp_avg"] / d)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=10, help="frozen: dense steps first")
    ap.add_argument("--floor", type=float, default=1e-3,
                    help="frozen: least sqrt(v) + eps, times its tensor's mean")
    ap.add_argument("--modes", default="gradient,update,frozen")
    args = ap.parse_args()
    torch.set_num_threads(1)
    modes = ["dense", *(m for m in args.modes.split(",") if m != "dense")]
    res = {m: run(m, args.steps, args.density, args.warmup, args.floor) for m in modes}
    print(f"held-out nats/byte after {args.steps} steps:",
          {m: round(r[2], 3) for m, r in res.items()})
    print(f"{'tensor':40s} moved: gradient/dense update/dense frozen/dense   "
          "sqrt(v): gradient/dense")
    dense = res["dense"]
    nan = ({}, {}, float("nan"))
    for n in dense[0]:
        if n.endswith("weight") and "norm" not in n and n != "pos.weight":  # the sparsified
            moved = [res.get(m, nan)[0].get(n, float("nan")) / dense[0][n]
                     for m in ("gradient", "update", "frozen")]
            print(f"{n:40s} {moved[0]:15.2f} {moved[1]:12.2f} {moved[2]:12.2f} "
                  f"{res.get('gradient', nan)[1].get(n, float('nan')) / dense[1][n]:20.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
