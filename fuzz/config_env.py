"""Fuzz target: the configuration parser, ``hvd_sparse.config.from_env_and_kwargs``, with
``HVD_SPARSE_*`` variables from the input: lines ``name=value`` (a Config field's name, any
case; other lines are ignored), the bytes decoded as the environment's are (UTF-8, undecodable
bytes escaped), NUL dropped.

Its one documented refusal is a ValueError naming the option (docs/configuration.md: "a value
out of range raises ValueError naming the option"): one whose message names none of the
variables set is a finding, as is any other exception. What it accepts must be usable as the
docs describe it: the timeouts finite and positive, the link rate a finite rate, the port
range and every address parsed with ports in 1..65535, the log level a ``logging`` level name.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os

from hvd_sparse import config
from hvd_sparse.runfile import parse_rate

CLEAN: tuple[type[BaseException], ...] = (ValueError,)
FIELDS = {f.name for f in dataclasses.fields(config.Config)}
PREFIX = "HVD_SPARSE_"


def variables(data: bytes) -> dict[str, str]:
    out = {}
    for line in data.decode("utf-8", "surrogateescape").replace("\0", "").splitlines():
        name, eq, value = line.partition("=")
        if eq and name.strip().lower() in FIELDS:
            out[PREFIX + name.strip().upper()] = value
    return out


def usable(cfg: config.Config) -> None:
    """What the runtime does with an accepted config, short of starting it."""
    for name in ("timeout", "rto"):
        v = getattr(cfg, name)
        assert isinstance(v, float | int) and math.isfinite(v) and v > 0, (name, v)
    if cfg.link_rate:
        assert math.isfinite(parse_rate(cfg.link_rate)), cfg.link_rate
    lo, hi = cfg.port_range()
    assert (lo, hi) == (0, 0) or 1 <= lo <= hi <= 65535, cfg.ports
    addresses = [*cfg.aggregator_list(), *filter(None, [cfg.switch_address()])]
    for host, port in addresses:
        assert host and 1 <= port <= 65535, (host, port)
    assert isinstance(logging.getLevelName(cfg.log_level.upper()), int), cfg.log_level


def test_one_input(data: bytes) -> None:
    env = variables(data)
    saved = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        try:
            cfg = config.from_env_and_kwargs()
        except CLEAN as e:
            names = {k[len(PREFIX):].lower() for k in env} | set(env)
            if not any(n in str(e) for n in names):
                raise AssertionError(f"a refusal that names no option set ({sorted(env)}): "
                                     f"{e}") from e
            return
        usable(cfg)
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)
