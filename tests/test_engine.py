"""The progress engine alone (one process, no Horovod collective): a stage that fails or never
finishes ends in an error naming the tensor and the stage, also when it fails while polled."""
from __future__ import annotations

import pytest
import torch

from hvd_sparse import engine
from hvd_sparse.errors import HvdSparseError
from hvd_sparse.job import Job


class Pending:
    """A Waitable that is ready after ``polls`` polls, or raises while polled."""

    def __init__(self, polls: int = 0, fail: str = "") -> None:
        self.polls, self.fail = polls, fail

    def poll(self) -> bool:
        if self.fail:
            raise RuntimeError(self.fail)
        self.polls -= 1
        return self.polls < 0

    def value(self) -> torch.Tensor:
        return torch.ones(3)


def job(name: str) -> Job:
    return Job(name=name, tensor=torch.zeros(3), shape=torch.Size([3]), average=False,
               prescale=1.0, postscale=1.0, block_size=256, meta=0, scheme="test", ctx=None,
               comm=None)


def stages(*pending: Pending):
    out = None
    for i, p in enumerate(pending):
        out = yield f"stage{i}", p
    return out * 2


def test_stages_run_in_order_and_return_the_result():
    h = engine.submit(job("ok"), stages(Pending(2), Pending(5)), lambda h: None)
    assert torch.equal(engine.synchronize(h, timeout=5), torch.full((3,), 2.0))
    assert engine.inflight() == 0


def test_a_stage_failing_while_polled_fails_its_tensor_by_name():
    done = engine.submit(job("fine"), stages(Pending(1)), lambda h: None)
    h = engine.submit(job("bad"), stages(Pending(0), Pending(fail="device lost")), lambda h: None)
    with pytest.raises(HvdSparseError, match=r"tensor 'bad': device lost"):
        engine.synchronize(h, timeout=5)
    assert torch.equal(engine.synchronize(done, timeout=5), torch.full((3,), 2.0))
    assert engine.inflight() == 0


def test_a_stage_that_never_finishes_times_out_naming_it():
    h = engine.submit(job("stuck"), stages(Pending(10**9)), lambda h: None)
    with pytest.raises(HvdSparseError, match=r"tensor 'stuck': timed out after 0.2 s in stage "
                                             r"'stage0'"):
        engine.synchronize(h, timeout=0.2)
    assert engine.inflight() == 0


def test_abandoned_reductions_fail_by_name_and_run_their_clean_up():
    cleaned = []

    def scheme():
        try:
            yield "stage0", Pending(10**9)
        finally:
            cleaned.append(True)
        return torch.ones(3)

    h = engine.submit(job("left"), scheme(), lambda h: None)
    assert engine.abandon("shut down") == 1 and cleaned == [True]
    assert engine.inflight() == 0
    with pytest.raises(HvdSparseError, match=r"tensor 'left': shut down"):
        engine.synchronize(h, timeout=5)


class Lost:
    """Collectives whose failures say none of them can complete any more (Horovod shut down)."""

    def lost(self, error: BaseException) -> bool:
        return "shut down" in str(error)


def test_collectives_lost_fail_every_reduction_in_flight_at_once():
    # one reduction waits at the aggregators (forever: a peer left); another's collective
    # says the front end is gone: both fail now, not at the timeout
    waiting = engine.submit(job("at.aggregators"), stages(Pending(10**9)), lambda h: None)
    gone = Job(**{**job("dense").__dict__, "comm": Lost()})
    h = engine.submit(gone, stages(Pending(fail="Horovod has been shut down")), lambda h: None)
    with pytest.raises(HvdSparseError, match=r"tensor 'dense': Horovod has been shut down"):
        engine.synchronize(h, timeout=5)
    with pytest.raises(HvdSparseError, match=r"tensor 'at.aggregators': Horovod has been shut"):
        engine.synchronize(waiting, timeout=60)
    assert engine.inflight() == 0
    # a failure that does not say so fails its own tensor only
    waiting = engine.submit(job("at.aggregators"), stages(Pending(3)), lambda h: None)
    other = Job(**{**job("other").__dict__, "comm": Lost()})
    h = engine.submit(other, stages(Pending(fail="mismatched shapes")), lambda h: None)
    with pytest.raises(HvdSparseError, match="mismatched shapes"):
        engine.synchronize(h, timeout=5)
    assert torch.equal(engine.synchronize(waiting, timeout=5), torch.full((3,), 2.0))


@pytest.mark.parametrize("numel,tail", [(256 * 7, False), (256 * 7 + 100, True),
                                        (256 * 7 + 100, False), (50, True)])
def test_backup_restores_an_overwritten_tensor(numel: int, tail: bool) -> None:
    """common.Backup keeps only the non-zero blocks, and restores the tensor after a reduction
    scribbled over every element: the same values, the -0s in its non-zero blocks too."""
    from hvd_sparse.schemes.common import Backup
    g = torch.Generator().manual_seed(numel)
    t = torch.randn(numel, generator=g)
    keep = torch.rand(-(-numel // 256), generator=g) < 0.4
    keep[-1] = tail
    t *= keep.repeat_interleave(256)[:numel]
    t[t.nonzero()[:1]] = -0.0  # a -0 inside a kept block
    want = t.clone()
    j = Job(name="b", tensor=t, shape=t.shape, average=False, prescale=1.0, postscale=1.0,
            block_size=256, meta=0, scheme="test", ctx=None, comm=None, inplace=True)
    b = Backup(j)
    assert b.blocks.numel() + (0 if b.tail is None else b.tail.numel()) == \
        int(keep.sum()) * 256 - (256 * len(keep) - numel if tail else 0)
    t.copy_(torch.randn(numel, generator=g))
    b.restore(j)
    # exact, -0s in kept blocks included; all-zero blocks are +0 (local_mask makes them so)
    kept = keep.repeat_interleave(256)[:numel]
    assert torch.equal(t, want) and torch.equal(t.signbit() & kept, want.signbit() & kept)
    assert not t[~kept].signbit().any()
