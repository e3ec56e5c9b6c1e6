"""The job's authentication key (docs/PROTOCOL.md "Authentication").

Aggregators hold the deployment's secret (``--secret-file``) and derive each job's key from it
and the job's token; rank 0 does the same and hands the key to the other ranks over the job's
own collectives, wrapped under an X25519 agreement with each, so that a host that reads the
collectives' traffic does not learn it. The packets' MACs are C++'s (csrc/omni/auth.h).
Torch-free: aggregator hosts and the testbed read and write secrets with it.
"""
from __future__ import annotations

import grp
import hashlib
import hmac
import os
import pwd
import stat
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import HvdSparseError

if TYPE_CHECKING:  # torch-free at import: aggregator hosts and the testbed read secrets too
    from .comm import Collectives

KEY_BYTES = 16
MIN_SECRET_BYTES = 16
_JOB_LABEL = b"hvd-sparse job key v1"
_WRAP_LABEL = b"hvd-sparse key wrap v1"
_SECRET_LABEL = b"hvd-sparse secret wrap v1"
SHARD_SECRET_BYTES = 32  # a job's own secret for the aggregators its hosts start (colocated)


def read_secret_file(path: str | Path) -> bytes:
    """The secret in ``path``, read as the aggregator reads it (csrc/omni/auth.cpp).

    The file must be a regular file, not a symbolic link, with at least 16 bytes of secret
    (trailing whitespace is not part of it), which no one but its owner may read, or which its
    group may read where that group is private to this process (``group_refusal``): the
    rules of docs/security.md, "Secrets".

    Args:
        path: the secret file.

    Returns:
        The secret, trailing whitespace removed.

    Raises:
        HvdSparseError: the file cannot be opened, is not a regular file, is open to others,
            or holds fewer than 16 bytes of secret; the message says which.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise HvdSparseError(f"hvd_sparse: secret file {path}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise HvdSparseError(f"hvd_sparse: secret file {path}: not a file")
        if st.st_mode & 0o037:  # others may do anything, or the group more than read
            raise HvdSparseError(f"hvd_sparse: secret file {path}: readable by others "
                                 "(chmod 600 it)")
        if st.st_mode & 0o040:
            why = group_refusal(st.st_uid, st.st_gid)
            if why:
                raise HvdSparseError(f"hvd_sparse: secret file {path}: readable by its group "
                                     f"{st.st_gid}, {why} (chmod 600 it, or see "
                                     "docs/security.md)")
        secret = f.read(1 << 20).rstrip(b" \t\r\n")
    if len(secret) < MIN_SECRET_BYTES:
        raise HvdSparseError(f"hvd_sparse: secret file {path}: fewer than "
                             f"{MIN_SECRET_BYTES} bytes of secret")
    return secret


def group_refusal(uid: int, gid: int) -> str:
    """Why a secret file owned by ``uid`` that group ``gid`` may read is not safe for this
    process, or "" where it is: its owner is root or this process's effective user (nobody
    else can widen its mode), ``gid`` is this process's effective or a supplementary group,
    and no other user belongs to it, as far as the user and group databases say (no member
    listed but this process's user, no other user with it as primary group). A Kubernetes
    pod's fsGroup that the image does not name, or a user-private group, passes. The C++
    aggregator applies the same rule (csrc/omni/auth.cpp).

    Args:
        uid: the file's owner.
        gid: the file's group.

    Returns:
        The reason, worded to follow "readable by its group GID, ", or "".
    """
    me = os.geteuid()
    if uid not in (0, me):
        return f"and owned by uid {uid}, neither this process's user nor root"
    if gid != os.getegid() and gid not in os.getgroups():
        return "which this process is not in"
    try:
        my_name = pwd.getpwuid(me).pw_name
    except KeyError:  # a uid the image does not name (Kubernetes' runAsUser): no name
        my_name = None
    try:
        others = [m for m in grp.getgrgid(gid).gr_mem if m != my_name]
    except KeyError:  # a gid no group entry names: it lists no members
        others = []
    if others:
        return f"which has other members ({', '.join(others)})"
    primary = sorted({p.pw_name for p in pwd.getpwall() if p.pw_gid == gid and p.pw_uid != me})
    if primary:
        return f"the primary group of other users ({', '.join(primary)})"
    return ""


def write_secret_file(path: str | Path, secret: bytes | None = None) -> bytes:
    """``secret`` (default: a fresh one, 64 hex digits) in a new file of mode 0600 at
    ``path``."""
    secret = secret or os.urandom(32).hex().encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return secret


def job_key(secret: bytes, token: int) -> bytes:
    """HMAC-SHA256(secret, label || token), first 16 bytes: what every aggregator derives."""
    msg = _JOB_LABEL + token.to_bytes(8, "big")
    return hmac.new(secret, msg, hashlib.sha256).digest()[:KEY_BYTES]


def agree(comm: Collectives, key: bytes | None, token: int) -> bytes:
    """Rank 0's ``key`` on every rank. Collective over ``comm``. Each rank sends an X25519
    public key; rank 0 sends back the key masked for each rank under their shared secret; every
    rank then shows a check value of what it holds, so that a rank with another key fails here
    rather than at its first packet."""
    key = _hand_over(comm, key, token, _WRAP_LABEL, range(comm.size), "hvd_sparse.auth")
    assert key is not None
    check = hmac.new(key, b"check", hashlib.sha256).hexdigest()[:16]
    checks = comm.allgather_object(check, "hvd_sparse.auth.check")
    if len(set(checks)) != 1:
        bad = [r for r, c in enumerate(checks) if c != checks[0]]
        raise HvdSparseError(f"hvd_sparse: ranks {bad} hold another job key than rank 0: the "
                             "key exchange was tampered with")
    return key


def share_secret(comm: Collectives, secret: bytes | None, token: int,
                 to: Collection[int]) -> bytes | None:
    """Rank 0's ``secret`` (SHARD_SECRET_BYTES) on the ranks ``to`` (rank 0 among them),
    None on the others. Collective over ``comm``. Wrapped as ``agree`` wraps the key, under a
    label of its own: the ranks that start a job's aggregators on their hosts (colocated
    layout) need the secret those derive the job's key from, and nobody else learns it."""
    to = set(to)
    assert 0 in to
    got = _hand_over(comm, secret, token, _SECRET_LABEL, to, "hvd_sparse.auth.secret")
    check = hmac.new(got, b"check", hashlib.sha256).hexdigest()[:16] if got else None
    checks = comm.allgather_object(check, "hvd_sparse.auth.secret.check")
    bad = sorted(r for r in to if checks[r] != checks[0])
    if bad:
        raise HvdSparseError(f"hvd_sparse: ranks {bad} hold another aggregator secret than "
                             "rank 0: the exchange was tampered with")
    return got


def _hand_over(comm: Collectives, value: bytes | None, token: int, label: bytes,
               to: Collection[int], name: str) -> bytes | None:
    """Rank 0's ``value`` (at most 32 bytes) on the ranks ``to``: each of them sends an X25519
    public key, rank 0 sends back ``value`` masked with HMAC-SHA256(shared secret, label ||
    token) for each. Collective over ``comm``; None on ranks outside ``to``."""
    from ._C import x25519, x25519_keypair  # here: importing this module needs no torch
    to = set(to)
    mine, public = x25519_keypair()
    publics = comm.allgather_object(public if comm.rank in to else None, f"{name}.public")
    wrapped = None
    if comm.rank == 0:
        assert value is not None and len(value) <= 32
        wrapped = [_xor(value, _mask(x25519(mine, p), token, label, len(value)))
                   if p is not None else None for p in publics]
    root, masked = comm.broadcast_object((publics[0], wrapped), f"{name}.wrapped")
    if comm.rank not in to:
        return None
    if comm.rank != 0:
        value = _xor(masked[comm.rank], _mask(x25519(mine, root), token, label,
                                              len(masked[comm.rank])))
    return value


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def _mask(shared: bytes, token: int, label: bytes = _WRAP_LABEL, n: int = KEY_BYTES) -> bytes:
    return hmac.new(shared, label + token.to_bytes(8, "big"), hashlib.sha256).digest()[:n]
