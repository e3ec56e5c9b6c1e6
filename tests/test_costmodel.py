"""The cost model's choices on the default network model (no Horovod job needed)."""
from __future__ import annotations

from hvd_sparse import costmodel

NUMEL, BS = 26_214_400, 256
NBLOCKS = NUMEL // BS


def predict(density: float, n: int = 4) -> costmodel.Prediction:
    return costmodel.predict(costmodel.NetModel.default(), NUMEL, 4, BS,
                             [round(density * NBLOCKS)] * n, None)


def test_prediction_keeps_times_and_bytes_apart():
    p = predict(0.01)
    assert set(p.seconds) == set(p.received) == {"dense", "allgather", "zen"}
    assert p.received["allgather"] < p.received["dense"]
    assert all(0 < s < 10 for s in p.seconds.values())


def test_sparse_only_when_clearly_cheaper():
    assert costmodel.choose(predict(0.01)) in ("allgather", "zen")
    assert costmodel.choose(predict(1.0)) == "dense"
    assert costmodel.choose(predict(0.4)) == "dense"  # most of dense's bytes: not worth it
    assert costmodel.choose(predict(0.1)) in ("allgather", "zen")
    assert costmodel.choose(predict(0.0)) != "dense"


def test_switch_sends_each_link_its_own_blocks_and_the_union_once():
    """On 1 Gbit/s links, aggregation in the switch costs each worker link its own blocks in
    and the union out, where one aggregator host's link carries n copies of the union: at 10%
    the switch must be predicted below one aggregator host and below dense."""
    base = costmodel.NetModel.default(layout=(64512, 64), switch_layout=(8192, 64))
    m = costmodel.NetModel.for_link(1e9, 4, base, aggregators=1)
    nnz = [round(0.1 * NBLOCKS)] * 4
    union = 0.344 * NBLOCKS  # 1 - 0.9^4 of the blocks, independent patterns
    p = costmodel.predict(m, NUMEL, 4, BS, nnz, union)
    assert p.received["switch"] == union * BS * 4  # int32 on the wire, the union once
    per_block = BS * 4 + costmodel.packet_overhead(m.switch_layout, NBLOCKS, 4, BS)
    wire = union * per_block * 8 / 1e9  # seconds on one worker link
    assert wire <= p.seconds["switch"] <= 2 * wire, (wire, p.seconds["switch"])
    assert p.seconds["switch"] < p.seconds["omnireduce"], p.seconds
    assert p.seconds["switch"] < p.seconds["dense"], p.seconds
    # without a switch there is no such prediction
    assert "switch" not in costmodel.predict(costmodel.NetModel.default(), NUMEL, 4, BS, nnz,
                                             union).seconds
