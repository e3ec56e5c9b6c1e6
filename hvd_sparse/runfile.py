"""The run file: every reduction of a job, one record per call, for ``hvd-sparse analyze``.

On with ``HVD_SPARSE_METRICS_FILE=path`` (option ``metrics_file``). Rank 0 writes it at
``hvd_sparse.shutdown()`` and at exit; a path containing ``{rank}`` makes every rank write its
own; other ranks record nothing. Only the latest ``metrics_records`` calls are kept (about 500
bytes each in memory), so a long job's memory stays bounded; ``dropped`` counts older ones.

Imports nothing heavy: the analyzer reads run files without Horovod.
"""
from __future__ import annotations

import atexit
import collections
import json
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

FORMAT = "hvd-sparse-run"
VERSION = 2  # 2: retransmits and rounds
READS = (1, 2)  # versions this one reads (1 lacks the fields added since)
# One record: the fields of the tuples kept in memory, in order.
FIELDS = ("step", "name", "numel", "esize", "block_size", "ranks", "requested", "scheme", "t",
          "seconds", "bytes_sent", "bytes_received", "block_density", "nnz_local", "union",
          "reason", "retransmits", "rounds")

_UNITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "kibit": 2.0**10, "mibit": 2.0**20, "gibit": 2.0**30, "tibit": 2.0**40}


def parse_rate(value: str | float | int) -> float:
    """A link rate in bit/s from a number or tc-style text: "1gbit", "10gbit", "100mbit", "1e9".

    Byte units ("bps", "gbps": bytes per second in tc, bits to most readers) are refused rather
    than guessed.
    """
    if isinstance(value, int | float):
        try:
            rate = float(value)
        except OverflowError:  # an int beyond the floats
            rate = math.inf
    else:
        # a decimal number (not "1.2.3", which float() refuses naming no option), a unit
        m = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*",
                         value.lower())
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"link_rate: expected bit/s as a number or with a unit among "
                             f"kbit, mbit, gbit, tbit (e.g. '10gbit'), got {value!r}")
        rate = float(m.group(1)) * _UNITS[m.group(2)]
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"link_rate must be a finite rate > 0, got {value!r}")
    return rate


class Recorder:
    """The calls of one process, the latest ``limit`` of them."""

    def __init__(self, path: str, rank: int, limit: int, header: dict[str, Any]) -> None:
        self.path, self.rank, self.header = path, rank, header
        self.records: collections.deque[tuple] = collections.deque(maxlen=limit)
        self.limit = limit
        self.steps: dict[str, int] = {}  # name -> calls so far
        self.total = 0
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def add(self, name: str, started: float, seconds: float, **fields: Any) -> None:
        with self.lock:
            step = self.steps.get(name, 0)
            self.steps[name] = step + 1
            if len(self.steps) > self.limit:  # unnamed tensors: a new name per call
                del self.steps[next(iter(self.steps))]
            fields.update(step=step, name=name, t=round(started - self.t0, 6),
                          seconds=round(seconds, 7))
            self.records.append(tuple(fields.get(f) for f in FIELDS))
            self.total += 1

    def document(self) -> dict[str, Any]:
        with self.lock:
            records = [dict(zip(FIELDS, r, strict=True)) for r in self.records]
            dropped = self.total - len(records)
        return {"format": FORMAT, "version": VERSION, **self.header, "rank": self.rank,
                "max_records": self.limit, "dropped": dropped, "records": records}

    def target(self) -> Path | None:
        if "{rank}" in self.path:
            return Path(self.path.replace("{rank}", str(self.rank)))
        return Path(self.path) if self.rank == 0 else None

    def write(self) -> Path | None:
        path = self.target()
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.document(), default=str))
        os.replace(tmp, path)  # a reader never sees half a file
        return path


_recorder: Recorder | None = None
_atexit = False


def start(path: str, rank: int, limit: int, header: dict[str, Any]) -> None:
    """Starts recording (at ``hvd_sparse.init``) on a rank that writes a file. A second init
    with the same path keeps the calls so far (the file then describes the whole process)
    under the new header."""
    global _recorder, _atexit
    if "{rank}" not in path and rank != 0:
        stop()
        return
    if _recorder is not None and _recorder.path == path and _recorder.rank == rank:
        _recorder.header = header
    else:
        stop()  # a previous file is complete
        _recorder = Recorder(path, rank, limit, header)
    if not _atexit:
        atexit.register(flush)
        _atexit = True


def stop() -> None:
    """Writes the file and stops recording (an init without a run file)."""
    global _recorder
    flush()
    _recorder = None


def record(job: Any, started: float, seconds: float) -> None:
    """One finished reduction (``job``: a job.Job; its ``stats`` give the record's columns);
    nothing when no run file is set."""
    rec = _recorder
    if rec is None:
        return
    t = job.tensor
    rec.add(job.name, started, seconds, **job.stats.reported(), numel=t.numel(),
            esize=t.element_size(), block_size=job.block_size, ranks=job.size,
            requested=job.scheme)


def flush() -> Path | None:
    """Writes the run file (this rank's, if it writes one); returns its path."""
    rec = _recorder
    if rec is None:
        return None
    try:
        return rec.write()
    except OSError as e:  # at exit nobody can handle it: say so and go on
        import logging
        logging.getLogger("hvd_sparse").warning("hvd_sparse: cannot write the run file %s: %s",
                                                rec.path, e)
        return None


def load(path: str | Path) -> dict[str, Any]:
    """A run file's document: an object of this format and a version this one reads, whose
    ``records`` are a list of objects (what each field of them holds is its reader's to check:
    ``hvd_sparse.tools.analyze.check_run``).

    Raises:
        ValueError: naming the file, when it is not such a run file (not JSON, undecodable
            bytes, nested deeper than the JSON parser goes, another format or version).
        OSError: it cannot be read.
    """
    try:
        doc = json.loads(Path(path).read_bytes())
    except (ValueError, RecursionError) as e:  # RecursionError: nesting past the parser's depth
        raise ValueError(f"{path}: not a JSON run file: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not an hvd-sparse run file (no \"format\": \"{FORMAT}\")")
    if doc.get("version") not in READS:
        raise ValueError(f"{path}: run file version {doc.get('version')}, this hvd-sparse "
                         f"reads versions {READS}")
    records = doc.get("records")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: \"records\" is not a list of objects")
    return doc
