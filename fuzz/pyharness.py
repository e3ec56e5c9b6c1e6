"""What the Python fuzz targets share: loading one by name (fuzz/NAME.py, without making
fuzz/ a package), and reading an input as the C++ targets' script of datagrams
(fuzz/harness.h: {control byte, uint16 little-endian length, bytes}), so that one seed format
serves both."""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def load_target(name: str) -> ModuleType:
    """The module fuzz/``name``.py."""
    spec = importlib.util.spec_from_file_location(f"hvd_sparse_fuzz_{name}", HERE / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no fuzz target {name!r} in {HERE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def datagrams(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(control byte, datagram) of each step of a script."""
    at = 0
    while len(data) - at >= 3:
        ctl, n = data[at], data[at + 1] | data[at + 2] << 8
        yield ctl, data[at + 3:at + 3 + n]
        at += 3 + n
