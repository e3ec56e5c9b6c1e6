"""Sparsifiers under every scheme and both APIs (horovodrun -np 4): the reduced gradient must be
Horovod's dense allreduce of the sparsified gradients.

The reference runs a second, identical sparsifier on the raw gradient (computed on a copy of the
model) and reduces the result with hvd.allreduce; it observes that result, so both sparsifiers
stay in the same state (ExDyna's partitions and threshold).
HVD_SPARSE_TEST_DEVICE=cuda: the model (so the sparsifiers and their memory) on the GPU, the
reference on the CPU (hvd_sparse._C's kernels).
"""
from __future__ import annotations

import copy
import os

import horovod.torch as hvd
import torch
from common import case, close_to, report, start
from torch import nn

import hvd_sparse
from hvd_sparse import device

DEVICE = os.environ.get("HVD_SPARSE_TEST_DEVICE", "cpu")
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
            err = close_to(p.grad.cpu(), ref[n].double(), torch.float32)
            if err:
                return f"step {step}, {n}: {err}"
        with opt.skip_synchronize():
            opt.step()
    name = "weight" if api == "optimizer" else "grad.weight"
    m = hvd_sparse.metrics()[name]
    if m["sparsifier"] != type(sp).__name__ or "union" not in m:
        return f"metrics lack the sparsifier's fields: {m}"
    if ("staged" in m) != (DEVICE != "cpu" or device.CPU_AS_DEVICE):
        return f"staged through host memory or not, unlike the tensor's device: {m}"
    return ""


def main() -> None:
    start()
    results: dict[str, object] = {}
    for scheme, api, kind in CASES:
        case(results, f"{scheme}.{api}.{kind}", lambda s=scheme, a=api, k=kind: check(s, a, k))
    report(results)


if __name__ == "__main__":
    main()
