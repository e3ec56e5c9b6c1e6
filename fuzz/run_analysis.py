"""Fuzz target: ``hvd-sparse analyze`` on a run file holding the input: the run file reader
(fuzz/run_file.py), then ``hvd_sparse.tools.analyze.analyze`` on what it loaded, the JSON the
analysis writes (``--json``) and the report it prints.

A document load accepts that cannot be analyzed (a field missing, of another type or out of
range) is refused with ValueError naming it, which ``hvd-sparse analyze`` prints; any other
exception is a finding.
"""
from __future__ import annotations

import contextlib
import io
import json

from pyharness import load_target

from hvd_sparse.tools import analyze

CLEAN: tuple[type[BaseException], ...] = (ValueError,)
_reader = load_target("run_file")


def test_one_input(data: bytes) -> None:
    run = _reader.load(data)
    if run is None:
        return
    try:
        a = analyze.analyze(run)
    except CLEAN:
        return
    json.dumps(analyze.json_safe(a), allow_nan=False)
    with contextlib.redirect_stdout(io.StringIO()):
        analyze.print_report(a)
