"""GPU workers (marked ``gpu``): the codec, staging and the sparsifiers on a CUDA device against
the CPU codec and kernels; every scheme, the sparsifiers and training on CUDA tensors under
horovodrun against Horovod's CPU allreduce of the same tensors, and the DDP hook on CUDA models
under torchrun (the ``cuda`` launches of tests/parallel/test_allreduce.py,
test_sparsify_schemes.py, test_training.py and test_ddp_routes.py, run from here: the driver
leaves them out there). Where torch sees no CUDA device (this project's machine)
they are skipped, with the reason; scripts/checks/gpu_check.sh runs them on a GPU host."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_sparsify_ops import SPARSIFIERS

from hvd_sparse import blocks, device, staging

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here (torch.cuda.is_available() is False): run "
           "scripts/checks/gpu_check.sh on a GPU host")]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
PARALLEL = Path(__file__).resolve().parent / "parallel"
sys.path.insert(0, str(PARALLEL))
from driver import launches, run  # noqa: E402

GPU_LAUNCHES = [(m, la) for m in sorted(PARALLEL.glob("test_*.py")) for la in launches(m)
                if la.gpu]


def sample(numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(numel)
    t = torch.randn(numel, generator=g) * (torch.rand(numel, generator=g) < 0.02)
    specials = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])[:numel]
    t[torch.arange(len(specials)) * max(1, numel // 4)] = specials
    return t.to(dtype)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


def same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, NaN where NaN (its bits may differ: a CUDA addition returns the canonical
    NaN, the CPU's keeps the operand's payload), -0 equal to +0."""
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


def only_kernels(*ops: str) -> None:
    """Each of ``ops`` ran on the CUDA kernels since the last reset, never on the torch
    fallback (which device.py takes silently where the kernels are not built)."""
    counts = device.path_counts()
    assert device.KERNELS_BUILT, "hvd_sparse._cuda is not built: torch operations ran instead"
    for op in ops:
        assert counts.get((op, "kernel"), 0) > 0 and (op, "torch") not in counts, \
            f"{op}: {counts}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,bs", [(1, 256), (1000, 3), (1 << 20, 256), ((1 << 22) + 17, 256)])
def test_the_codec_on_cuda_matches_the_cpu_codec(dtype, numel, bs):
    """The CUDA kernels (every dtype of device._KERNEL_DTYPES), asserted to have run."""
    t = sample(numel, dtype)
    device.reset_path_counts()
    idx, vals = device.pack(t.cuda(), bs)
    ref_idx, ref_vals = blocks.pack(t, bs)
    assert idx.is_cuda and vals.is_cuda and torch.equal(idx.cpu(), ref_idx)
    assert torch.equal(bits(vals.cpu()), bits(ref_vals))  # a copy: NaN's bits too
    out, ref = torch.ones_like(t).cuda(), torch.ones_like(t)
    device.unpack(out, idx, vals, bs)
    blocks.unpack(ref, ref_idx, ref_vals, bs)
    assert out.is_cuda
    same_values(out, ref)
    only_kernels("pack", "unpack")


@pytest.mark.parametrize("dtype", DTYPES)
def test_staging_round_trip_on_cuda(dtype):
    t = sample((1 << 20) + 5, dtype).cuda()
    assert staging.staged(t)
    device.reset_path_counts()
    host = staging.to_host(t, 256)
    assert host.device.type == "cpu"
    same_values(host, t.cpu())  # a -0 in an all-zero block comes back +0: values, not bits
    out = torch.full_like(t, 7.0)
    assert staging.to_device(host, out, 256) is out and out.is_cuda
    same_values(out, t.cpu())
    only_kernels("pack", "unpack")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(SPARSIFIERS))
def test_sparsifiers_on_cuda_select_what_the_cpu_kernels_select(kind, dtype):
    """Five error-feedback steps on CUDA (torch operations and the select_ge kernel, memory on
    the GPU) against the same sparsifier on the CPU (hvd_sparse._C): the same gradients, bit
    for bit."""
    gpu, cpu = SPARSIFIERS[kind](), SPARSIFIERS[kind]()
    device.reset_path_counts()
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        x = (torch.randn(1_000_003, generator=g) * (torch.rand(1_000_003, generator=g) < 0.5))
        x = x.to(dtype)
        got, want = gpu("w", x.cuda(), 4), cpu("w", x.clone(), 4)
        assert got.is_cuda and torch.equal(got.cpu(), want), f"step {step}"
        gpu.observe("w", want.cuda() * 2, 4)
        cpu.observe("w", want * 2, 4)
    if dtype == torch.float32 and kind in ("threshold", "dgc"):  # the ones selecting by |x|
        only_kernels("select_ge")


@pytest.mark.parametrize("module,launch", GPU_LAUNCHES,
                         ids=[f"{m.stem}[{la.name}]" for m, la in GPU_LAUNCHES])
def test_on_cuda_tensors_under_a_launcher(module, launch, tmp_path):
    """A tests/parallel module's cuda launch: every scheme, dtype and density (in place and
    out of place, async, scaled, Compression.sparse); every sparsifier under every scheme and
    API; training parity (the hvd_sparse model on the GPU, the dense Horovod one on the CPU).
    2 and 4 ranks share the GPU."""
    run(module, launch, tmp_path).check()
