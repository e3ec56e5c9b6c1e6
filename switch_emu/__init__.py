"""switch_emu: a P4-like programmable switch that aggregates hvd-sparse traffic in the network.

``program`` declares the aggregation program as a switch pipeline and fits it to a switch's
limits (Tofino 1 by default), as a P4 compiler would. The data path (csrc/: main.cpp,
ports.cpp, control.cpp; the ``hvd-sparse-switch`` binary, on DPDK) forwards ordinary frames
by MAC learning; the testbed runs it in place of its bridge (``hvd-sparse testbed up --switch
emu``).
"""
from __future__ import annotations

from pathlib import Path

BINARY = Path(__file__).resolve().parent / "bin" / "hvd-sparse-switch"


def binary() -> Path:
    if not BINARY.exists():
        raise FileNotFoundError(f"switch_emu: {BINARY} missing: it is built with DPDK "
                                "(libdpdk-dev, installed by make build) by setup.py")
    return BINARY
