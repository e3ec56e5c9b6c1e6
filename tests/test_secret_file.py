"""Who may read the deployment's secret file (docs/security.md, "Secrets"), with real files,
real owners and modes, and processes of real identities (as root: chown, and children started
under another uid and groups): a file only its owner reads is accepted; one its group may read
only where that group is private to the reader, as a Kubernetes pod's fsGroup is (the file
root:fsGroup, mode 0440, read by a non-root user whose supplementary group it is). Python
(hvd_sparse.auth) and the C++ aggregator decide alike, word for word.

Users and groups are numbers no entry of /etc/passwd or /etc/group names, so nothing is added
to the system; the one directory made for the files is removed also when a test fails."""
from __future__ import annotations

import grp
import os
import pwd
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hvd_sparse.aggregator
from hvd_sparse.auth import read_secret_file
from hvd_sparse.errors import HvdSparseError

ROOT = Path(__file__).resolve().parents[1]
SECRET = os.urandom(32).hex()
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0, reason="chown and setuid need root")]


def unnamed(n: int) -> list[int]:
    """``n`` ids above 20000 that no user or group entry names or uses as a primary group."""
    used = {p.pw_uid for p in pwd.getpwall()} | {p.pw_gid for p in pwd.getpwall()} \
        | {g.gr_gid for g in grp.getgrall()}
    return [i for i in range(20001, 60000) if i not in used][:n]


def _group(gid: int) -> grp.struct_group | None:
    try:
        return grp.getgrgid(gid)
    except KeyError:
        return None


USER, FSGROUP, OTHER = unnamed(3)
# a group whose entry lists no member but that is some other user's primary group
SHARED = next((p.pw_gid for p in pwd.getpwall() if p.pw_uid != 0 and p.pw_gid != 0
               and not getattr(_group(p.pw_gid), "gr_mem", None)), None)


@pytest.fixture
def folder() -> Iterator[Path]:
    """A directory other users may pass through (not list), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="hvdsp-secret-"))
    try:
        d.chmod(0o711)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def secret_file(folder: Path, mode: int, uid: int = 0, gid: int = 0) -> Path:
    path = folder / f"secret-{mode:o}-{uid}-{gid}"
    path.write_text(SECRET + "\n")
    os.chown(path, uid, gid)
    path.chmod(mode)
    return path


def python_reads(path: Path, uid: int, gid: int, groups: list[int]) -> tuple[bool, str]:
    """What hvd_sparse.auth says to a process of that identity: (accepted, its words). A
    forked child takes the identity (the interpreter's own files, under /root, are not
    reachable by another user, so no new interpreter is started) and reports through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                out, code = "ok " + read_secret_file(path).decode(), 0
            except HvdSparseError as e:
                out, code = f"no {e}", 0
            os.write(w, out.encode())
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + 30  # a child that hangs is killed, not awaited
    with os.fdopen(r, "rb", buffering=0) as f:
        while True:
            ready, _, _ = select.select([f], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the reader's child did not answer within 30 s")
            data = f.read(65536)
            if not data:
                break
            chunks.append(data)
    out = b"".join(chunks).decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and out[:3] in ("ok ", "no "), out
    return out.startswith("ok "), out[3:]


def aggregator_reads(path: Path, uid: int, gid: int, groups: list[int],
                     folder: Path) -> tuple[bool, str]:
    """What the C++ aggregator says: it reads --secret-file while parsing its options and
    exits 2 with the reason, or binds and writes --port-file once it runs."""
    run = folder / f"run-{uid}-{gid}-{'-'.join(map(str, groups))}"
    run.mkdir(mode=0o700)
    os.chown(run, uid, gid)  # where the aggregator, as that user, writes its port
    port_file = run / "port"
    with open(folder / "agg.log", "w+") as log:
        proc = subprocess.Popen([str(hvd_sparse.aggregator.binary()), "--bind", "127.0.0.1:0",
                                 "--secret-file", str(path), "--port-file", str(port_file)],
                                user=uid, group=gid, extra_groups=groups, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            for _ in range(200):
                if proc.poll() is not None or port_file.exists():
                    break
                time.sleep(0.05)
            accepted = proc.poll() is None and port_file.exists()
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(10)
        log.seek(0)
        words = log.read().strip()
    if accepted:
        return True, SECRET
    assert proc.returncode == 2, words
    return False, words.removeprefix("hvd-sparse-aggregator: ")


def both_read(path: Path, uid: int, gid: int, groups: list[int],
              folder: Path) -> tuple[bool, str]:
    """Python's and the aggregator's verdict, which must agree, the reason included."""
    ok, words = python_reads(path, uid, gid, groups)
    agg_ok, agg_words = aggregator_reads(path, uid, gid, groups, folder)
    assert agg_ok == ok, (words, agg_words)
    if ok:
        assert words == SECRET
    else:
        # Python's message carries the package's prefix
        assert words == f"hvd_sparse: {agg_words}", (words, agg_words)
    return ok, words


def test_owner_only_file_is_accepted(folder: Path) -> None:
    """0400 for the reader's own user (a non-root user here), as before."""
    path = secret_file(folder, 0o400, USER, USER)
    assert both_read(path, USER, USER, [], folder) == (True, SECRET)


def test_kubernetes_fsgroup_file_is_accepted(folder: Path) -> None:
    """What kubelet makes of a Secret mounted with defaultMode 0400 in a pod with an fsGroup:
    root:fsGroup, mode 0440, read by runAsUser (a uid the image does not name) whose
    supplementary group is the fsGroup. A gid no entry names has no other member."""
    path = secret_file(folder, 0o440, 0, FSGROUP)
    assert both_read(path, USER, USER, [FSGROUP], folder) == (True, SECRET)
    # the same with runAsGroup equal to the fsGroup (the process's primary group)
    assert both_read(path, USER, FSGROUP, [], folder) == (True, SECRET)


def test_group_readable_refused_where_the_reader_is_not_in_the_group(folder: Path) -> None:
    """Another group may read it: a user of that group could, this process cannot vouch."""
    path = secret_file(folder, 0o440, USER, FSGROUP)
    ok, words = both_read(path, USER, USER, [OTHER], folder)
    assert not ok and f"readable by its group {FSGROUP}, which this process is not in" in words


@pytest.mark.skipif(SHARED is None, reason="no user here has a primary group of its own")
def test_group_readable_refused_where_another_user_is_in_the_group(folder: Path) -> None:
    """The group is the reader's, but the user database names another user with it as
    primary group: that user could read the secret."""
    path = secret_file(folder, 0o440, 0, SHARED)
    ok, words = both_read(path, USER, USER, [SHARED], folder)
    assert not ok and f"readable by its group {SHARED}, the primary group of other users (" \
        in words, words


def test_group_readable_refused_where_the_group_lists_members(folder: Path) -> None:
    """A group whose entry lists members (other than the reader) is shared."""
    listed = next((g for g in grp.getgrall() if g.gr_mem), None)
    if listed is None:
        pytest.skip("no group here lists members")
    path = secret_file(folder, 0o440, 0, listed.gr_gid)
    ok, words = both_read(path, USER, USER, [listed.gr_gid], folder)
    assert not ok and f"which has other members ({', '.join(listed.gr_mem)})" in words, words


def test_group_readable_refused_when_owned_by_another_user(folder: Path) -> None:
    """Its owner (neither root nor the reader) could open it to anyone at any time."""
    path = secret_file(folder, 0o440, OTHER, FSGROUP)
    ok, words = both_read(path, USER, USER, [FSGROUP], folder)
    assert not ok and f"and owned by uid {OTHER}, neither this process's user nor root" in words


@pytest.mark.parametrize("mode", [0o444, 0o460, 0o450, 0o442])
def test_more_than_group_read_is_refused(folder: Path, mode: int) -> None:
    """Open to others, or the group may write or execute: refused whatever the group."""
    path = secret_file(folder, mode, 0, FSGROUP)
    ok, words = both_read(path, USER, USER, [FSGROUP], folder)
    assert not ok and "readable by others (chmod 600 it)" in words, words
