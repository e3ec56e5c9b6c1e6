"""Bad input on 2 ranks: mismatched tensors, edge shapes, NaN/Inf, a silent peer, a dead peer.

Run with HVD_SPARSE_TIMEOUT set low. Every check records '' on success or why it failed.
"""
from __future__ import annotations

import os
import time

import horovod.torch as hvd
import torch
from common import case, close_to, report, start

import hvd_sparse

SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]


def expect_error(name: str, fn, *words: str) -> str:
    try:
        fn()
    except hvd_sparse.HvdSparseError as e:
        missing = [w for w in (name, *words) if w not in str(e)]
        return f"error does not mention {missing}: {e}" if missing else ""
    return "no HvdSparseError raised"


def main() -> None:
    start(small_bytes=1024)
    rank, results = hvd.rank(), {}
    timeout = hvd_sparse.basics.state().config.timeout

    # Ranks disagree about a tensor: every rank must raise, naming it.
    for scheme in SCHEMES:
        shapes = {"shape": ([64, 300], [300, 64]), "numel": ([2000], [3000]),
                  "small": ([4, 4], [16])}
        for kind, (a, b) in shapes.items():
            name = f"mismatch.{kind}.{scheme}"
            t = torch.zeros(a if rank == 0 else b)
            t.view(-1)[::7] = 1.0
            case(results, name, lambda name=name, t=t, s=scheme: expect_error(
                name, lambda: hvd_sparse.allreduce(t, name=name, scheme=s)))
        name = f"mismatch.dtype.{scheme}"
        t = torch.ones(5000, dtype=torch.float32 if rank == 0 else torch.float64)
        case(results, name, lambda name=name, t=t, s=scheme: expect_error(
            name, lambda: hvd_sparse.allreduce(t, name=name, scheme=s)))

    # Edge shapes and layouts reduce correctly.
    def edge(scheme: str) -> str:
        g = torch.Generator().manual_seed(rank)
        base = torch.randn(300, 41, generator=g) * (torch.rand(300, 41, generator=g) < 0.02)
        orig = base.clone()
        tensors = {"empty": torch.zeros(0), "one": torch.tensor([float(rank + 1)]),
                   "noncontig": base.t(), "sliced": base[::3, 1:], "scalar": torch.tensor(2.0)}
        errs = []
        for k, t in tensors.items():
            ref = hvd.allreduce(t.double().contiguous(), name=f"ref.{k}.{scheme}")
            out = hvd_sparse.allreduce(t, name=f"edge.{k}.{scheme}", scheme=scheme)
            errs += [f"{k}: {e}" for e in [close_to(out, ref, torch.float32)] if e]
        ref = hvd.allreduce(base.double(), name=f"ref.coo.{scheme}")
        # Sparse inputs, plain and hybrid (nn.Embedding's gradients), are reduced by rows unless
        # the scheme is dense, which densifies (in a copy) as Horovod would.
        for k, coo in (("coo", base.to_sparse()), ("hybrid", base.to_sparse(sparse_dim=1))):
            out = hvd_sparse.allreduce(coo, name=f"edge.{k}.{scheme}", scheme=scheme)
            if out.is_sparse != (scheme != "dense"):
                errs.append(f"{k}: result is_sparse={out.is_sparse}")
            errs += [f"{k}: {e}" for e in [close_to(out.to_dense(), ref, torch.float32)] if e]
        if not torch.equal(base, orig):
            errs.append("the caller's tensor (viewed as noncontig, sliced) was modified")
        return "; ".join(errs)

    # NaN and Inf propagate exactly as in Horovod's dense allreduce.
    def nan_inf(scheme: str) -> str:
        t = torch.zeros(4096)
        t[10] = float("nan") if rank == 0 else 1.0
        t[600] = float("inf")
        t[1500] = float("inf") if rank == 0 else float("-inf")
        t[3000] = 2.0
        ref = hvd.allreduce(t, name=f"ref.nan.{scheme}", op=hvd.Sum)
        out = hvd_sparse.allreduce(t, name=f"nan.{scheme}", op=hvd.Sum, scheme=scheme)
        same = torch.equal(out.isnan(), ref.isnan()) and torch.equal(
            out.nan_to_num(0, 1e30, -1e30), ref.nan_to_num(0, 1e30, -1e30))
        at = [10, 600, 1500, 3000]
        return "" if same else f"got {out[at]}, want {ref[at]}"

    for scheme in SCHEMES:
        case(results, f"edge.{scheme}", lambda s=scheme: edge(s))
        case(results, f"nan-inf.{scheme}", lambda s=scheme: nan_inf(s))

    def bad_args() -> str:
        errs = []
        for kwargs in ({"op": hvd.Adasum}, {"scheme": "bogus"}):
            try:
                hvd_sparse.allreduce(torch.ones(3), name="bad", **kwargs)
                errs.append(f"{kwargs}: accepted")
            except ValueError:
                pass
        return "; ".join(errs)

    case(results, "bad-arguments", bad_args)

    # A peer that never submits the tensor: a timeout error naming it, not a hang.
    if rank == 0:
        def lonely() -> str:
            t0 = time.monotonic()
            err = expect_error("lonely", lambda: hvd_sparse.allreduce(
                torch.ones(5000), name="lonely", scheme="allgather"), "timed out")
            took = time.monotonic() - t0
            return err or ("" if took < timeout + 5 else f"took {took:.1f}s")

        case(results, "silent-peer-timeout", lonely)
    else:
        time.sleep(timeout + 2)
        results["silent-peer-timeout"] = ""
        report(results)
        os._exit(0)  # a dead peer for rank 0's last check

    # The peer is gone: the next reduction fails within the timeout, naming the tensor.
    def dead_peer() -> str:
        t0 = time.monotonic()
        err = expect_error("after-death", lambda: hvd_sparse.allreduce(
            torch.ones(5000), name="after-death", scheme="zen"))
        took = time.monotonic() - t0
        return err or ("" if took < timeout + 10 else f"took {took:.1f}s")

    case(results, "dead-peer", dead_peer)
    report(results)
    os._exit(0)  # Horovod's shutdown would wait for the dead peer


if __name__ == "__main__":
    main()
