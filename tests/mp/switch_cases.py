"""One job on the netns testbed with switch_emu's switch in place of the bridge (2 worker hosts,
1 aggregator host), launched by tests/test_switch_emu.py: MPI (Horovod's dense allreduce), the
allgather scheme and omnireduce through an aggregator host all cross the emulated switch and
equal Horovod's allreduce of the same tensors in float64."""
from __future__ import annotations

import horovod.torch as hvd
import torch
from common import case, close_to, report, start

import hvd_sparse

NUMEL = 1 << 18


def data(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + hvd.rank())
    keep = torch.rand(NUMEL // 256, generator=g) < 0.1
    return (torch.randn(NUMEL // 256, 256, generator=g) * keep[:, None]).view(-1).to(dtype)


def schemes() -> str:
    bad = []
    for i, scheme in enumerate(("dense", "allgather", "omnireduce")):
        for dtype in (torch.float32, torch.float16):
            t = data(i, dtype)
            ref = hvd.allreduce(t.double(), name=f"ref.{scheme}.{dtype}", op=hvd.Sum)
            out = hvd_sparse.allreduce(t, name=f"s.{scheme}.{dtype}", scheme=scheme, op=hvd.Sum)
            if why := close_to(out, ref, dtype):
                bad.append(f"{scheme} {dtype}: {why}")
    return "; ".join(bad)


def main() -> None:
    start(probe="off", timeout=20.0)
    results: dict[str, object] = {}
    case(results, "schemes", schemes)
    report(results)
    hvd_sparse.shutdown()


if __name__ == "__main__":
    main()
