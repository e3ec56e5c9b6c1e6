"""Why Adam loses to error feedback (issue 52): one process, no Horovod, the convergence suite's
language model (task ``lm``) on rank 0's batches, Adam lr 3e-3, three ways for ``--steps``:
dense; TopK at ``--density`` with error feedback on each gradient (what
``DistributedOptimizer(sparsify="gradient")`` does on one rank); TopK with error feedback on
each Adam update (``sparsify="update"``). Prints the held-out loss of each, and per sparsified
weight how far it moved (|p_T - p_0|) and the mean of Adam's sqrt(v), relative to dense.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/adam_diagnosis.py --steps 150
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _accuracy  # noqa: E402

import hvd_sparse  # noqa: E402


def run(mode: str, steps: int, density: float) -> tuple[dict, dict, float]:
    """Trains the LM ``steps`` steps with ``mode`` ("dense", "gradient" or "update").

    Args:
        mode: what error feedback applies to, or "dense" for none.
        steps: Adam steps.
        density: TopK's density.

    Returns:
        (movement per tensor, mean sqrt(v) per tensor, held-out loss in nats/byte).
    """
    task = _accuracy.lm(1, 0, 1)
    model = task.model()
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sp = hvd_sparse.TopK(density, rank=0, size=1)
    batches = (b for e in range(10**6) for b in task.batches(e))
    for _ in range(steps):
        (x,), y = next(batches)
        opt.zero_grad()
        task.loss(model(x), y).backward()
        if mode == "gradient":
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--density", type=float, default=0.01)
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = {m: run(m, args.steps, args.density) for m in ("dense", "gradient", "update")}
    print(f"held-out nats/byte after {args.steps} steps:",
          {m: round(r[2], 3) for m, r in res.items()})
    print(f"{'tensor':40s} moved: gradient/dense update/dense   sqrt(v): gradient/dense")
    dense = res["dense"]
    for n in dense[0]:
        if n.endswith("weight") and "norm" not in n and n != "pos.weight":  # the sparsified
            print(f"{n:40s} {res['gradient'][0][n] / dense[0][n]:15.2f} "
                  f"{res['update'][0][n] / dense[0][n]:12.2f} "
                  f"{res['gradient'][1][n] / dense[1][n]:20.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
