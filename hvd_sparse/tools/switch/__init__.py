"""The emulated switch: a P4-like programmable switch that aggregates hvd-sparse traffic in the
network, and its control plane.

``program`` declares the aggregation program as a switch pipeline and fits it to a switch's
limits (Tofino 1 by default), as a P4 compiler would; ``control`` starts the switch with a
program that fits and talks to its control socket (``hvd-sparse switch ...``). The data path is
C++ (csrc/switch/: the pipeline, DPDK ports, the control socket; the ``hvd-sparse-switch``
binary): it forwards ordinary frames by MAC learning, and the testbed runs it in place of its
bridge (``hvd-sparse testbed up --switch emu``). Torch-free.
"""
from __future__ import annotations

import os
from pathlib import Path

BINARY = Path(__file__).resolve().parents[2] / "bin" / "hvd-sparse-switch"


def binary() -> Path:
    """The switch executable: the package's, or HVD_SPARSE_SWITCH_BINARY (another build of it,
    e.g. `make sanitize`'s)."""
    if other := os.environ.get("HVD_SPARSE_SWITCH_BINARY"):
        return Path(other)
    if not BINARY.exists():
        raise FileNotFoundError(f"hvd-sparse: the emulated switch {BINARY} is missing: setup.py "
                                "builds it with DPDK (libdpdk-dev, installed by make build)")
    return BINARY
