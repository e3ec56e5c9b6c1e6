"""Fuzz target: the run file reader, ``hvd_sparse.runfile.load``, on a file holding the input.

What is not a run file of a version it reads it refuses with ValueError, naming the file
(JSON's own errors and undecodable bytes are ValueErrors too); what it returns is a run
file's document. Any other exception is a finding.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from hvd_sparse import runfile

CLEAN: tuple[type[BaseException], ...] = (ValueError,)
_DIR = Path(tempfile.mkdtemp(prefix="hvd-sparse-fuzz-"))
atexit.register(shutil.rmtree, _DIR, True)


def load(data: bytes) -> dict | None:
    """The document of a run file holding ``data``, or None when load refuses it."""
    path = _DIR / "run.json"
    path.write_bytes(data)
    try:
        doc = runfile.load(path)
    except CLEAN as e:
        if str(path) not in str(e):
            raise AssertionError(f"a refusal that does not name the file: {e!r}") from e
        return None
    if not (isinstance(doc, dict) and doc.get("format") == runfile.FORMAT
            and doc.get("version") in runfile.READS):
        raise AssertionError(f"load returned what is not a run file: {str(doc)[:200]}")
    return doc


def test_one_input(data: bytes) -> None:
    load(data)
