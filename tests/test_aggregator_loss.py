"""Loss, duplication and reordering, injected by the aggregator (--drop-rate, --dup-rate,
--reorder-rate) or by the workers: results bit-identical to a lossless run, and the counters
that show the faults happened moved."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from aggregator_helpers import (
    assert_result,
    bits,
    block_sparse,
    reference,
    run,
)

from hvd_sparse import _C

LOSS = [  # (id, aggregator flags, worker kwargs, counters that must have moved)
    ("agg-drop-in-1%", ("--drop-rate", "0.01"), {}, ("injected_drops", "w:retransmits")),
    ("agg-drop-in-10%", ("--drop-rate", "0.1"), {}, ("injected_drops", "w:retransmits")),
    ("agg-drop-out-1%", ("--drop-rate-out", "0.01"), {}, ("injected_drops", "retransmits")),
    ("agg-drop-out-10%", ("--drop-rate-out", "0.1"), {}, ("injected_drops", "retransmits")),
    ("worker-drop-10%", (), {"drop_rate": 0.1}, ("w:injected_drops", "retransmits")),
    # a DATA twice at the aggregator after its round completed: a second RESULT, which the
    # worker counts as a spurious resend (and backs its timer off for)
    ("agg-dup", ("--dup-rate", "0.2"), {}, ("injected_dups", "duplicates+retransmits",
                                            "w:spurious")),
    ("worker-dup", (), {"dup_rate": 0.2}, ("duplicates+retransmits",)),
    ("agg-reorder", ("--reorder-rate", "0.5"), {}, ("rounds",)),
    ("everything", ("--drop-rate", "0.1", "--drop-rate-out", "0.1", "--dup-rate", "0.1",
                    "--reorder-rate", "0.3"), {"drop_rate": 0.05, "dup_rate": 0.05},
     ("injected_drops", "injected_dups", "retransmits", "w:retransmits")),
]


@pytest.mark.parametrize("flags,kw,moved", [c[1:] for c in LOSS], ids=[c[0] for c in LOSS])
def test_loss_duplication_reordering_give_identical_results(aggs, make_workers, flags, kw,
                                                            moved):
    n, bs = 4, 64
    rng = np.random.default_rng(4)
    numel = bs * 500 + 5
    ins = [block_sparse(rng, numel, bs, 0.15, torch.float32, force=(0,) if r == 2 else ())
           for r in range(n)]
    ref = reference(ins)
    clean = make_workers([aggs(n)], n, token=1, payload_bytes=1024, slots_per_aggregator=16)
    lossless, _ = run(clean, ins, 5, bs, inplace=False)
    assert_result(lossless[0], ref, "lossless")

    agg = aggs(n, *flags, "--seed", "3")
    ws = make_workers([agg], n, token=2, payload_bytes=1024, slots_per_aggregator=16,
                      seed=11, **kw)
    for tid, inplace in ((5, False), (6, True)):
        outs, _ = run(ws, ins, tid, bs, inplace=inplace)
        for r, o in enumerate(outs):
            assert bits(o) == bits(lossless[0]), f"rank {r} inplace={inplace}"
    s = agg.stats()
    wstats = [w.stats() for w in ws]
    for counter in moved:
        if counter.startswith("w:"):
            value = sum(x[counter[2:]] for x in wstats)
        else:
            value = sum(s[c] for c in counter.split("+"))
        assert value > 0, f"{counter} did not move: {s} {wstats}"
    assert s["malformed"] == 0 and s["mismatch"] == 0, s
    assert agg.alive()


def test_eight_workers_with_lossy_peers_never_stall(aggs):
    """Two of 8 workers lose 20% of what they send, so windows differ from worker to worker.
    When the window gated every round, the workers filled their windows with rounds that
    their peers held queued behind their own and only one slot at a time moved: this job ran
    into its 20 s timeout every time. A slot's later rounds now go at once (csrc/omni/worker/
    engine.h), and every rank gets the sum."""
    n, bs = 8, 64
    rng = np.random.default_rng(1)
    ins = [block_sparse(rng, bs * 6000, bs, 0.3, torch.float32) for _ in range(n)]
    ref = reference(ins)
    agg = aggs(n, "--threads", "1")
    ws = [_C.OmniWorker([agg.addr], 9, r, n, payload_bytes=1024, slots_per_aggregator=64,
                        seed=r + 1, timeout=20.0, drop_rate=0.2 if r in (0, 4) else 0.0)
          for r in range(n)]  # make_workers gives every rank the same drop rate
    try:
        for w in ws:
            w.register(15.0)
        outs = [torch.zeros_like(x) for x in ins]
        tickets = [w.submit(7, ins[r], outs[r], bs, 7, None, "t7", 1.0)
                   for r, w in enumerate(ws)]
        for r, w in enumerate(ws):
            assert w.wait(tickets[r], 30.0), f"worker {r} did not finish"
        stats = [w.finish(tickets[r]) for r, w in enumerate(ws)]  # raises on a timeout
        for r, o in enumerate(outs):
            assert_result(o, ref, f"rank {r}")
        assert sum(s["retransmits"] for s in stats) > 0, stats  # the drops happened
    finally:
        for w in ws:
            w.close()


@pytest.mark.parametrize("late", [False, True], ids=["never", "late"])
def test_a_missing_peer_is_named(aggs, make_workers, late):
    """Ranks 0 and 1 submit a tensor, rank 2 does not (never, or 3 s late). The aggregator
    answers their resends HELD naming worker 2, and their timeout errors say that it holds
    their DATA and waits for rank 2; a late rank 2 instead completes the sums, exact."""
    n, bs = 3, 64
    agg = aggs(n)
    ws = make_workers([agg], n, token=4, payload_bytes=1024, slots_per_aggregator=4,
                      timeout=4.0 if not late else 20.0)
    rng = np.random.default_rng(5)
    ins = [block_sparse(rng, bs * 64, bs, 0.5, torch.float32) for _ in range(n)]
    outs = [torch.zeros_like(x) for x in ins]

    def submit(r: int) -> int:
        return ws[r].submit(9, ins[r], outs[r], bs, 7, None, "t9", 1.0)

    tickets = [submit(0), submit(1)]
    if late:
        time.sleep(3.0)
        tickets.append(submit(2))
    for r, ticket in enumerate(tickets):
        assert ws[r].wait(ticket, 30.0)
        assert ws[r].stats()["held"] > 0 or r == 2, ws[r].stats()
        if late:
            ws[r].finish(ticket)
            assert_result(outs[r], reference(ins), f"rank {r}")
            continue
        with pytest.raises(_C.AggregatorTimeout,
                           match=r"holds this rank's DATA of the round and waits for rank 2's"):
            ws[r].finish(ticket)
