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


def test_a_straggler_costs_its_peers_no_window(aggs, make_workers):
    """Rank 1 submits tensor 5 late. Rank 0's rounds of it wait at the aggregator while its
    rounds of tensor 6 (sent later, by both ranks) are answered, so its timers fire and, by
    RACK's rule, cut its window. The resends are answered HELD: nothing was lost, and every cut
    is undone (without HELD the window stayed halved, and under CPU caps fell to a slot or
    two). Every rank gets the sums."""
    n, bs = 2, 64
    rng = np.random.default_rng(8)
    ins = {t: [block_sparse(rng, bs * 256, bs, 0.5, torch.float32) for _ in range(n)]
           for t in (5, 6)}
    agg = aggs(n)
    ws = make_workers([agg], n, token=3, payload_bytes=1024, slots_per_aggregator=4)
    outs = {t: [torch.zeros_like(x) for x in ins[t]] for t in (5, 6)}

    def submit(r: int, t: int) -> int:
        return ws[r].submit(t, ins[t][r], outs[t][r], bs, 7, None, f"t{t}", 1.0)

    late = submit(0, 5)
    time.sleep(0.01)
    other = [submit(r, 6) for r in range(n)]
    for r in range(n):
        assert ws[r].wait(other[r], 30.0), f"rank {r}: tensor 6"
    deadline = time.monotonic() + 10
    while ws[0].stats()["held"] < 2:  # the first resends of tensor 5, and their HELDs
        assert time.monotonic() < deadline, ws[0].stats()
        time.sleep(0.05)
    tickets = [late, submit(1, 5)]
    for r in range(n):
        assert ws[r].wait(tickets[r], 30.0), f"rank {r}: tensor 5"
        ws[r].finish(tickets[r])
        ws[r].finish(other[r])
    for t in (5, 6):
        for r in range(n):
            assert_result(outs[t][r], reference(ins[t]), f"tensor {t} rank {r}")
    s = ws[0].stats()
    [path] = s["aggregators"]
    assert s["retransmits"] > 0 and s["spurious"] > 0, s
    assert path["window_cuts"] >= 1 and s["undone_cuts"] == path["window_cuts"], s
    assert path["ssthresh"] == 4096, path  # slow start's, as before the cut: no trace of it
    assert agg.stats()["duplicates"] >= s["held"], agg.stats()


def test_a_missing_peer_is_named(aggs, make_workers):
    """Rank 1 never submits the tensor: rank 0's resends are answered HELD naming worker 1,
    and its timeout error says that the aggregator holds its DATA and waits for rank 1."""
    agg = aggs(2)
    ws = make_workers([agg], 2, token=4, payload_bytes=1024, slots_per_aggregator=4,
                      timeout=2.0)
    x = torch.ones(64 * 16)
    ticket = ws[0].submit(9, x, torch.zeros_like(x), 64, 7, None, "alone", 1.0)
    assert ws[0].wait(ticket, 30.0)
    with pytest.raises(_C.AggregatorTimeout,
                       match=r"holds this rank's DATA of the round and waits for rank 1's"):
        ws[0].finish(ticket)
    assert ws[0].stats()["held"] > 0
