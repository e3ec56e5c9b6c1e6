"""Runs a Python fuzz target under atheris (the libFuzzer engine for Python):

    python fuzz/atheris_run.py NAME [libFuzzer options] [CORPUS_DIR ...]

NAME is a module fuzz/NAME.py that defines ``test_one_input(data: bytes)``; hvd_sparse is
instrumented for coverage as the target imports it (only hvd_sparse: torch, scapy and rich are
not). `make fuzz` runs every target this way (fuzz/run.py). An exception the target lets
through is a finding: atheris prints it and writes the input as crash-*.
"""
from __future__ import annotations

import os
import sys

import atheris
from pyharness import load_target

if __name__ == "__main__":
    with atheris.instrument_imports(include=["hvd_sparse"]):
        target = load_target(sys.argv[1])
    # argv[0] as libFuzzer runs it again (-merge): the executable fuzz/run.py wrote
    atheris.Setup([os.environ.get("FUZZ_SELF", sys.argv[0]), *sys.argv[2:]],
                  target.test_one_input)
    atheris.Fuzz()
