"""The library's logger, ``logging.getLogger("hvd_sparse")``: a ``NullHandler`` as the logging
HOWTO asks of libraries (the application chooses handlers and format; hvd_sparse never touches
the root logger), the level of the ``log_level`` option under either front end, and every
record prefixed with the job-wide rank (also kept as ``record.rank``)."""
from __future__ import annotations

import logging

log = logging.getLogger("hvd_sparse")
log.addHandler(logging.NullHandler())
_rank: int | None = None


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _rank is not None and not hasattr(record, "rank"):
            record.rank = _rank
            record.msg = f"[rank {_rank}] {record.msg}"
        return True


log.addFilter(_RankFilter())


def configure(level: str, rank: int) -> None:
    """Sets the library logger's level (``log_level``: "DEBUG", "INFO", "WARNING", ...) and the
    rank its records carry; called by either front end at start.

    Args:
        level: a ``logging`` level name.
        rank: this process's job-wide rank.

    Raises:
        ValueError: ``level`` is not a level name.
    """
    global _rank
    log.setLevel(level.upper())
    _rank = rank
