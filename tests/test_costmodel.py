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
