"""Run-time options: ``hvd_sparse.init(**kwargs)`` or ``HVD_SPARSE_*`` environment variables."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

SCHEMES = ("dense", "allgather", "zen", "auto")


@dataclass
class Config:
    block_size: int = 256
    scheme: str = "auto"
    timeout: float = 30.0  # seconds any wait may take before HvdSparseError
    small_bytes: int = 64 * 1024  # "auto" sends tensors smaller than this dense
    probe: str = "auto"  # network probe at init: "auto" (cached), "force", "off"
    cache_dir: str = str(Path.home() / ".cache" / "hvd_sparse")
    log_level: str = "WARNING"
    threads: int = 0  # codec threads per rank; 0: cores / ranks on this host

    def validate(self) -> Config:
        if self.block_size < 1 or self.block_size > 1 << 24:
            raise ValueError(f"block_size must be in [1, 2**24], got {self.block_size}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.probe not in ("auto", "force", "off"):
            raise ValueError(f"probe must be 'auto', 'force' or 'off', got {self.probe!r}")
        return self


def from_env_and_kwargs(**kwargs: object) -> Config:
    """Keyword arguments win over HVD_SPARSE_<NAME> variables, which win over defaults."""
    values: dict[str, object] = {}
    for f in dataclasses.fields(Config):
        env = os.environ.get(f"HVD_SPARSE_{f.name.upper()}")
        if env is not None:
            values[f.name] = type(f.default)(env)
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise TypeError(f"unknown hvd_sparse option(s): {sorted(unknown)}")
    values.update({k: v for k, v in kwargs.items() if v is not None})
    return Config(**values).validate()  # type: ignore[arg-type]
