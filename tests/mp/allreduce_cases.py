"""Every scheme x dtype x density x size against Horovod's dense allreduce in float64.

Also: bit-identical results on every rank, async reductions submitted in different orders on
different ranks, op=Sum with scaling factors. Writes one JSON report per rank.
HVD_SPARSE_TEST_DEVICE=cuda: the tensors are on the GPU, the references on the CPU.
"""
from __future__ import annotations

import hashlib
import os

import horovod.torch as hvd
import torch
from common import case, close_to, report, start

import hvd_sparse

SCHEMES = ["dense", "allgather", "zen", "omnireduce", "auto"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DENSITIES = [0.0, 1e-4, 0.01, 0.3, 1.0]
# 1,048,577 float32 or float64: over 4 MiB, so out of place lands in fresh zeros (blocks.zeros)
SHAPES = [(1,), (255,), (256,), (257,), (1_048_577,), (3, 5, 7), (1000, 33)]
DEVICE = os.environ.get("HVD_SPARSE_TEST_DEVICE", "cpu")
if os.environ.get("HVD_SPARSE_TEST_QUICK"):
    DTYPES, SHAPES = [torch.float32, torch.float16], [(1,), (257,), (3, 5, 7), (100_003,)]


def sample(shape: tuple[int, ...], density: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Block-clustered sparse data: whole 256-blocks chosen at ``density``, half-filled."""
    g = torch.Generator().manual_seed(seed)
    numel = int(torch.tensor(shape).prod())
    nblocks = (numel + 255) // 256
    chosen = (torch.rand(nblocks, generator=g) < density).repeat_interleave(256)[:numel]
    fill = torch.rand(numel, generator=g) < 0.5
    values = torch.randn(numel, generator=g) * (chosen & fill)
    if density > 0 and seed % 2 == 0:
        values[0] = 1.5  # index 0 must never be dropped
    if density >= 1.0:
        values = torch.randn(numel, generator=g)
    return values.reshape(shape).to(dtype).to(DEVICE)


def f64(t: torch.Tensor) -> torch.Tensor:
    """The reference's input: float64 on the CPU, which Horovod's CPU operations reduce."""
    return t.double().cpu()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).cpu().numpy()
                        .tobytes()).hexdigest()


def main() -> None:
    start(small_bytes=1024)  # small threshold low so "auto" takes its sparse paths in tests
    rank, results, digests = hvd.rank(), {}, {}
    k = 0
    for scheme in SCHEMES:
        for dtype in DTYPES:
            for density in DENSITIES:
                for shape in SHAPES:
                    k += 1
                    name = f"{scheme}/{str(dtype)[6:]}/{density:g}/{'x'.join(map(str, shape))}"
                    t = sample(shape, density, dtype, seed=1000 * k + rank)
                    op = hvd.Sum if k % 3 == 0 else hvd.Average

                    def check(t=t, name=name, op=op, dtype=dtype, scheme=scheme) -> str:
                        ref = hvd.allreduce(f64(t), name=f"ref.{name}", op=op)
                        out = hvd_sparse.allreduce(t, name=name, op=op, scheme=scheme)
                        digests[name] = digest(out)
                        m = hvd_sparse.metrics()[name]
                        if scheme not in ("auto", m["scheme"]) and "reason" not in m:
                            return f"reduced by scheme {m['scheme']!r}, not {scheme!r}, unsaid"
                        return close_to(out, ref, dtype)

                    case(results, name, check)

    # Several reductions in flight, submitted and synchronized in different orders per rank.
    def out_of_order() -> str:
        names = [f"ooo.{i}" for i in range(6)]
        tensors = {n: sample((5000,), 0.05, torch.float32, seed=i * 7 + rank)
                   for i, n in enumerate(names)}
        # References first, in one order: a blocking Horovod call mixed into the waits below
        # could itself deadlock against a peer that waits on a different tensor.
        refs = {n: hvd.allreduce(f64(tensors[n]), name=f"ref.{n}", op=hvd.Sum) for n in names}
        order = names if rank % 2 == 0 else names[::-1]
        handles = {n: hvd_sparse.allreduce_async(
            tensors[n], name=n, op=hvd.Sum, scheme=SCHEMES[names.index(n) % len(SCHEMES)])
            for n in order}
        errors = []
        for n in (order[::-1] if rank % 2 == 0 else order):
            err = close_to(hvd_sparse.synchronize(handles[n]), refs[n], torch.float32)
            if err:
                errors.append(f"{n}: {err}")
        return "; ".join(errors)

    case(results, "async/out-of-order", out_of_order)

    def scaled() -> str:
        t = sample((20000,), 0.05, torch.float32, seed=rank)
        ref = hvd.allreduce(f64(t), name="ref.scaled", op=hvd.Average,
                            prescale_factor=0.5, postscale_factor=3.0)
        errs = []
        for s in SCHEMES:
            out = hvd_sparse.allreduce(t, name=f"scaled.{s}", op=hvd.Average, scheme=s,
                                       prescale_factor=0.5, postscale_factor=3.0)
            errs += [f"{s}: {e}" for e in [close_to(out, ref, torch.float32)] if e]
        return "; ".join(errs)

    case(results, "scaling-factors", scaled)

    def compression_functional() -> str:
        """hvd.allreduce(t, compression=Compression.sparse()) returns a new tensor, as Horovod
        promises, and leaves t alone (Horovod's optimizer alone gets an in-place reduction)."""
        t = sample((20000,), 0.05, torch.float32, seed=rank + 3)
        orig = t.clone()
        ref = hvd.allreduce(f64(t), name="ref.compression", op=hvd.Sum, postscale_factor=3.0)
        errs = []
        for s in SCHEMES:
            out = hvd.allreduce(t, name=f"compression.{s}", op=hvd.Sum, postscale_factor=3.0,
                                compression=hvd_sparse.Compression.sparse(scheme=s))
            errs += [f"{s}: {e}" for e in [close_to(out, ref, torch.float32)] if e]
            if not torch.equal(t, orig):
                errs.append(f"{s}: the input was modified")
                t.copy_(orig)
        return "; ".join(errs)

    case(results, "compression-functional", compression_functional)

    def inplace() -> str:
        errs = []
        for s in SCHEMES:
            for dtype in (torch.float32, torch.float16):
                base = sample((300, 90), 0.05, dtype, seed=rank + 5)
                ref = hvd.allreduce(f64(base), name=f"ref.inplace.{s}.{dtype}")
                for layout, t in (("contiguous", base.clone()), ("transposed", base.clone().t())):
                    want = ref if layout == "contiguous" else ref.t()
                    out = hvd_sparse.allreduce_(t, name=f"inplace.{s}.{dtype}.{layout}", scheme=s)
                    if out is not t:
                        errs.append(f"{s}/{dtype}/{layout}: not the same tensor")
                    errs += [f"{s}/{dtype}/{layout}: {e}" for e in [close_to(t, want, dtype)] if e]
        return "; ".join(errs)

    case(results, "inplace", inplace)

    def inplace_bits() -> str:
        """allreduce_ rewrites only the blocks some rank sent: the rest must still come out +0
        (-0 included), the same bits as out of place, on every rank. (Auto may clear -0 in
        all-zero blocks and then pick dense: equal values, the same bits on every rank.)"""
        errs = []
        for s in SCHEMES:
            for dtype in (torch.float32, torch.float64):
                base = sample((40_000,), 0.02, dtype, seed=rank + 11)
                if rank % 2:  # -0 on some ranks only: unsent blocks must not keep it
                    base[base == 0] = -0.0
                out = hvd_sparse.allreduce(base, name=f"bits.{s}.{dtype}", scheme=s)
                t = hvd_sparse.allreduce_(base.clone(), name=f"bits_.{s}.{dtype}", scheme=s)
                ints = torch.int64 if dtype == torch.float64 else torch.int32
                if not (torch.equal(t, out) if s == "auto"
                        else torch.equal(t.view(ints), out.view(ints))):
                    errs.append(f"{s}/{dtype}: in place differs from out of place")
                digests[f"inplace-bits/{s}/{dtype}"] = digest(t)
                results[f"inplace-bits/{s}/{dtype}"] = ""
        return "; ".join(errs)

    case(results, "inplace-bits", inplace_bits)

    # Identical bits on every rank: compare every digest with rank 0's.
    all_digests = hvd.allgather_object(digests, name="digests")
    for name in digests:
        if results.get(name) == "" and any(d.get(name) != digests[name] for d in all_digests):
            results[name] = "result differs across ranks"
    staged = ["staged" in m for m in hvd_sparse.metrics().values()]
    results["_staged"], results["_unstaged"] = sum(staged), len(staged) - sum(staged)
    results["_metrics_auto_choice"] = {n: m["scheme"] for n, m in hvd_sparse.metrics().items()
                                       if n.startswith("auto/float32/0.01")}
    report(results)


if __name__ == "__main__":
    main()
