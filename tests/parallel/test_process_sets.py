"""Process sets that are subsets of the job (4 ranks), with an explicit scheme="omnireduce",
whose aggregators sum over every rank: it falls back to dense alike on every rank of the set,
never raising on some ranks while the others go on (issue: Horovod's own
test_optimizer_process_sets with Compression.sparse(scheme="omnireduce") left rank 1 in
hvd.remove_process_set and rank 0 in the closing barrier). Sets {0,1}/{2,3}, one per rank, and
even/odd; added and removed while Horovod runs; results against Horovod's dense allreduce in
float64 (and its optimizer on a float64 copy).
"""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch
from driver import Launch
from optimizer_pairs import maker, train
from ranktools import close_to, start

import hvd_sparse

# small_bytes=0: the tiny tensors take omnireduce, not the dense shortcut for small ones.
LAUNCHES = [Launch(np=4, timeout=240, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1",
                                           "HVD_SPARSE_SMALL_BYTES": "0"})]


@pytest.fixture(scope="module", autouse=True)
def started():
    start(probe="off")
    assert hvd_sparse.basics.state().config.small_bytes == 0


def sample(seed: int) -> torch.Tensor:
    t = torch.zeros(4096, dtype=torch.float64)
    t[64 * hvd.rank():64 * hvd.rank() + 64] = torch.arange(64.0) + seed
    return t


def reduce_in(ps: hvd.ProcessSet, name: str) -> str:
    """omnireduce in ``ps``, out of place and in place: dense's result, reason recorded."""
    errs = []
    for k, op in enumerate((hvd.Average, hvd.Sum)):
        t = sample(k)
        ref = hvd.allreduce(t, op=op, process_set=ps, name=f"ref.{name}.{k}")
        outs = {"out": hvd_sparse.allreduce(t, name=f"{name}.{k}", op=op, scheme="omnireduce",
                                            process_set=ps),
                "in": hvd_sparse.allreduce_(t.clone(), name=f"{name}.{k}.in", op=op,
                                            scheme="omnireduce", process_set=ps)}
        for how, out in outs.items():
            if (why := close_to(out, ref, torch.float64)) != "":
                errs.append(f"{name}.{k} {how}: {why}")
            m = hvd_sparse.metrics()[f"{name}.{k}" + (".in" if how == "in" else "")]
            if (m["scheme"], m.get("reason")) != ("dense", "process set"):
                errs.append(f"{name}.{k} {how}: ran {m['scheme']} ({m.get('reason')})")
    return "; ".join(errs)


def removed_in_step(*sets: hvd.ProcessSet) -> None:
    """Horovod's closing steps: every rank removes the sets and meets the others."""
    for ps in sets:
        hvd.remove_process_set(ps)
    hvd.barrier()


def test_allreduce_in_pairs_and_one_rank_sets_falls_back_alike():
    pairs = [hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])]
    singles = [hvd.add_process_set([r]) for r in range(hvd.size())]
    try:
        assert reduce_in(pairs[hvd.rank() // 2], "pair") == ""
        assert reduce_in(singles[hvd.rank()], "single") == ""
    finally:
        removed_in_step(*pairs, *singles)


@pytest.mark.parametrize("path", ["compression", "optimizer"])
def test_optimizer_on_the_even_ranks_falls_back_alike(path):
    """Horovod's test_optimizer_process_sets: gradients reduced over {0, 2}; 1 and 3 step on
    their own (the reference optimizer, Horovod's with no compression, does the same)."""
    even, odd = hvd.add_process_set([0, 2]), hvd.add_process_set([1, 3])
    try:
        hvd_sparse.reset_metrics()
        assert train(maker(path, "omnireduce"), steps=2, process_set=even) == ""
        went = {m.get("reason") for m in hvd_sparse.metrics().values()}
        assert went == ({"process set"} if hvd.rank() % 2 == 0 else set()), went
    finally:
        removed_in_step(odd, even)


def test_omnireduce_still_serves_the_whole_job():
    """After the fallbacks: the aggregators still sum over every rank."""
    t = sample(7)
    ref = hvd.allreduce(t, name="ref.global")
    out = hvd_sparse.allreduce(t, name="global", scheme="omnireduce")
    assert close_to(out, ref, torch.float64) == ""
    m = hvd_sparse.metrics()["global"]
    assert (m["scheme"], m.get("reason")) == ("omnireduce", None), m


def test_auto_learns_a_name_apart_in_each_set():
    """auto learns a tensor's union (for its next prediction) per name and set of ranks: ranks
    0 and 1 also reduce the name in their pair, with blocks apart where the whole job's are
    shared, yet the next reduction over the whole job is predicted alike on every rank (a
    prediction learnt in the pair would split the ranks' choices: a hang)."""
    pair = hvd.add_process_set([0, 1])

    def rows(seed: int, apart: bool) -> torch.Tensor:
        t = torch.zeros(1 << 20, dtype=torch.float64)
        at = 4096 * hvd.rank() if apart else 0
        t[at:at + 256] = torch.arange(256.0) + seed + hvd.rank()
        return t

    try:
        calls = [(hvd.global_process_set, rows(0, False)), (pair, rows(1, True)),
                 (hvd.global_process_set, rows(2, False))]
        for k, (ps, t) in enumerate(calls):
            if hvd.rank() >= 2 and ps is pair:
                continue
            ref = hvd.allreduce(t, op=hvd.Average, process_set=ps, name=f"learn.ref.{k}")
            out = hvd_sparse.allreduce(t, name="learn", scheme="auto", process_set=ps)
            assert close_to(out, ref, torch.float64) == ""
            m = hvd_sparse.metrics()["learn"]
            assert m["scheme"] != "dense", m  # sparse: it learns the union it saw
        every = hvd.allgather_object(m["predicted_ms"], name="learn.predicted")
        assert all(p == every[0] for p in every), every
    finally:
        removed_in_step(pair)
