"""Training parity (4 ranks): sparse synchronization tracks dense Horovod step by step.

Two copies of one model from one seed see the same batches of the demo's workload
(hvd_sparse.tools.workload: three embedding tables of about 105k rows x 32 over Zipf ids, dense
features, an MLP); one syncs with hvd.Compression.none, the other with hvd_sparse. Parameters
must agree after every step. Variants cover hvd_sparse.DistributedOptimizer, op=Sum, predivide
factor, several backward passes per step, nn.Embedding(sparse=True), and Adasum's clear error.
HVD_SPARSE_TEST_DEVICE=cuda: the hvd_sparse copy trains on the GPU, the reference on the CPU.
"""
from __future__ import annotations

import copy

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from ranktools import DEVICE, codec_paths, start
from torch import nn

import hvd_sparse
from hvd_sparse.tools.workload import CTRModel, Shard, make_shard, vocab_sizes

LAUNCHES = [Launch(np=4, timeout=480, extended=True),
            Launch(np=4, id="cuda-np4", env={"HVD_SPARSE_TEST_DEVICE": "cuda"}, gpu=True,
                   timeout=600)]
SIZES, DIM, BATCH, MAX_PASSES = vocab_sizes(0.4), 32, 64, 2
_shards: dict[int, Shard] = {}


def model(sparse: bool = False) -> CTRModel:
    return CTRModel(SIZES, DIM, sparse=sparse)


def batch(step: int, sub: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's examples of ``step`` (backward pass ``sub``): (ids, dense, label)."""
    if hvd.rank() not in _shards:
        _shards[hvd.rank()] = make_shard(0, hvd.rank(), 30 * MAX_PASSES * BATCH, SIZES)
    return _shards[hvd.rank()].batch(step * MAX_PASSES + sub, BATCH)


def compare(make_ref, make_test, steps: int, passes: int = 1, sparse: bool = False) -> str:
    torch.manual_seed(0)
    ref_model = model(sparse)
    test_model = copy.deepcopy(ref_model).to(DEVICE)
    ref_opt, test_opt = make_ref(ref_model), make_test(test_model)
    for step in range(steps):
        for m, opt, dev in ((ref_model, ref_opt, "cpu"), (test_model, test_opt, DEVICE)):
            opt.zero_grad()
            for sub in range(passes):
                m.loss(*(x.to(dev) for x in batch(step, sub))).backward()
            opt.step()
        for (n, a), b in zip(ref_model.named_parameters(), test_model.parameters(), strict=True):
            if b.device.type != DEVICE:
                return f"step {step}: {n} on {b.device}, not on {DEVICE}"
            if not torch.allclose(a, b.cpu(), rtol=1e-4, atol=1e-6):
                return f"step {step}: {n} differs by {(a - b.cpu()).abs().max().item():g}"
    return ""


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def horovod(compression, **kw):
    return lambda m: hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(),
                                              compression=compression, **kw)


def ours(**kw):
    return lambda m: hvd_sparse.DistributedOptimizer(
        sgd(m), named_parameters=m.named_parameters(), **kw)


@pytest.fixture(scope="module", autouse=True)
def hvd_sparse_started():
    start()


none, sparse = hvd.Compression.none, hvd_sparse.Compression.sparse


def test_compression_auto_30_steps():
    assert compare(horovod(none), horovod(sparse(scheme="auto")), 30) == ""


def test_compression_zen():
    assert compare(horovod(none), horovod(sparse(scheme="zen", block_size=64)), 8) == ""


def test_compression_omnireduce():
    assert compare(horovod(none), horovod(sparse(scheme="omnireduce")), 10) == ""


def test_optimizer_omnireduce_predivide_and_passes():
    assert compare(
        horovod(none, gradient_predivide_factor=2.0, backward_passes_per_step=2),
        ours(scheme="omnireduce", gradient_predivide_factor=2.0, backward_passes_per_step=2),
        5, passes=2) == ""


def test_optimizer_allgather():
    assert compare(horovod(none), ours(scheme="allgather"), 10) == ""


def test_op_sum():
    assert compare(horovod(none, op=hvd.Sum), horovod(sparse(scheme="allgather"), op=hvd.Sum),
                   5) == ""


def test_optimizer_op_sum():
    assert compare(horovod(none, op=hvd.Sum), ours(scheme="zen", op=hvd.Sum), 5) == ""


def test_predivide_and_passes():
    assert compare(
        horovod(none, gradient_predivide_factor=2.0, backward_passes_per_step=2),
        horovod(sparse(scheme="zen"), gradient_predivide_factor=2.0, backward_passes_per_step=2),
        5, passes=2) == ""


def test_optimizer_predivide_and_passes():
    assert compare(
        horovod(none, gradient_predivide_factor=2.0, backward_passes_per_step=2),
        ours(scheme="auto", gradient_predivide_factor=2.0, backward_passes_per_step=2),
        5, passes=2) == ""


def test_compression_grouped():
    hvd_sparse.reset_metrics()
    err = compare(horovod(none, groups=1), horovod(sparse(scheme="zen"), groups=1), 4)
    assert err == ""
    names = sorted(hvd_sparse.metrics())
    want = sorted(f"grad.{n}" for n, _ in model().named_parameters())
    assert names == want, f"reductions named {names}, want {want}"


# nn.Embedding(sparse=True): Horovod's own sparse path is the reference.
def test_sparse_embedding_compression():
    assert compare(horovod(none), horovod(sparse(scheme="allgather"), sparse_as_dense=True), 5,
                   sparse=True) == ""


def test_sparse_embedding_optimizer():
    assert compare(horovod(none), ours(scheme="zen"), 5, sparse=True) == ""


def test_sparse_embedding_omnireduce():
    assert compare(horovod(none), ours(scheme="omnireduce"), 5, sparse=True) == ""


def test_adasum_rejected():
    m = model()
    opt = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(),
                                   compression=sparse(), op=hvd.Adasum)
    with pytest.raises(hvd_sparse.HvdSparseError, match="Adasum"):
        m.loss(*batch(0)).backward()
        opt.step()


def test_the_codec_ran_on_the_path_of_this_launch():
    """Last: CUDA tensors took the kernels (device.py falls back to torch operations silently)."""
    assert codec_paths() == ""
