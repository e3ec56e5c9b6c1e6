"""Host names on the testbed, as a cluster's DNS gives them: ``<host>.<testbed>`` (``a0.hvdsp``)
resolves to the host's address inside every namespace of the testbed.

``ip netns exec`` mounts each file of /etc/netns/<namespace>/ over its namesake in /etc for the
process it starts, so every namespace gets a hosts file: the machine's own entries, then the
testbed's. When a host moves (lifecycle.move) the file is rewritten in place, because its inode
is what running processes have mounted: their next lookup of the name gives the new address."""
from __future__ import annotations

from pathlib import Path

from . import links
from .topology import Testbed

ROOT = Path("/etc/netns")


def text(tb: Testbed) -> str:
    """The hosts file of every namespace of ``tb``."""
    mark = f"# hvd-sparse testbed {tb.name}\n"
    # Called from inside a host too (a job's rank moving a host), where /etc/hosts is this file
    base = Path("/etc/hosts").read_text().split(mark)[0].rstrip("\n")
    ours = "".join(f"{h.ip} {tb.hostname(h)}\n" for h in tb.hosts)
    return f"{base}\n{mark}{ours}"


def write(tb: Testbed) -> None:
    """Writes (or rewrites, in place) the hosts file of every namespace of ``tb``."""
    content = text(tb)
    for ns in [h.ns for h in tb.hosts] + [tb.switch_ns]:
        d = ROOT / ns
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "hosts", "w") as f:  # truncated, not replaced: see above
            f.write(content)


def remove(name: str) -> None:
    """Removes the hosts files of testbed ``name`` (and their folders, when nothing else is
    in them)."""
    for d in ROOT.glob(f"{name}-*"):
        if links.is_namespace_of(name, d.name):
            (d / "hosts").unlink(missing_ok=True)
            try:
                d.rmdir()
            except OSError:  # someone else's files: theirs to remove
                pass
