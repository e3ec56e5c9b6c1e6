"""Frame loss, duplication and reordering on the switch: nftables rules in the switch
namespace, or the emulated switch's own loss (it reads frames before netfilter could drop them).

Loss is dropped on the path (never in a sender's own output chain, which a sender would see
as a send error). A rule per lossy host drops frames entering or leaving its port at random
(``numgen random``); the testbed-wide rate applies to every port. Rules are rewritten whole
from the state on every change, so a job can see loss change while it runs.

This kernel has no netem, so duplication and reordering are built from what it has:

* duplication: a netdev ``ingress`` chain on each port sends a copy of a frame (``dup to
  "br0"``: transmitted on the bridge device, the bridge forwards the copy by its MAC table as
  it forwards the original) for frames from the host, and, on every other port, for frames
  addressed to it (a copy made on the host's own port's ``egress`` would pass that hook again
  and be copied again);
* reordering: the bridge's forward chain sets the priority of a share of the frames to and
  from the host to ``1:2``, which the ports' HTB qdiscs (links.shape) send through a class of a
  tenth of the link's rate: those frames wait there while the others pass them.
"""
from __future__ import annotations

import json
import subprocess

from .topology import Testbed

TABLE = "hvd_sparse"
SCALE = 1_000_000  # loss rates in millionths
SLOW_CLASS = "1:2"  # the HTB class a reordered frame waits in (links.shape)


def _nft(tb: Testbed, *args: str, script: str | None = None) -> str:
    cmd = ["ip", "netns", "exec", tb.switch_ns, "nft", *args]
    try:
        p = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=10)
    except FileNotFoundError as e:
        raise RuntimeError("testbed: loss needs nftables (`apt-get install nftables`; "
                           "make build installs it)") from e
    if p.returncode != 0:
        raise RuntimeError(f"testbed: {' '.join(cmd)} failed: {p.stderr.strip()}")
    return p.stdout


def apply(tb: Testbed) -> None:
    """Installs the testbed's loss rates (replacing any earlier rules)."""
    if tb.switch == "emu":
        if any(h.dup or h.reorder for h in tb.hosts):
            raise ValueError("testbed: duplication and reordering need the bridge switch "
                             "(--switch bridge): the emulated switch has no rules for them")
        from hvd_sparse.tools.switch import control
        c = control.Client(tb.switch_control)
        c.call(f"loss * {tb.loss} {tb.loss_proto}")
        for h in tb.hosts:
            c.call(f"loss {h.port} {h.loss} {tb.loss_proto}")
        return
    match = "meta l4proto udp " if tb.loss_proto == "udp" else ""
    rules = []
    if tb.loss > 0:
        rules.append(f"{match}numgen random mod {SCALE} < {int(tb.loss * SCALE)} counter drop")
    for h in tb.hosts:
        if h.loss > 0:
            n = int(h.loss * SCALE)
            rules += [f'iifname "{h.port}" {match}numgen random mod {SCALE} < {n} counter drop',
                      f'oifname "{h.port}" {match}numgen random mod {SCALE} < {n} counter drop']
    for h in tb.hosts:  # after the drops: a dropped frame is not also reordered
        if h.reorder > 0:
            n = int(h.reorder * SCALE)
            rules += [f'{d}ifname "{h.port}" {match}numgen random mod {SCALE} < {n} counter '
                      f'meta priority set {SLOW_CLASS}' for d in ("i", "o")]
    script = (f"table bridge {TABLE}\ndelete table bridge {TABLE}\n"  # first makes delete safe
              f"table netdev {TABLE}\ndelete table netdev {TABLE}\n"
              f"table bridge {TABLE} {{\n chain forward {{\n"
              "  type filter hook forward priority 0; policy accept;\n"
              + "".join(f"  {r}\n" for r in rules) + " }\n}\n" + _dup_table(tb, match))
    _nft(tb, "-f", "-", script=script)


def _dup_table(tb: Testbed, match: str) -> str:
    """The netdev table of the duplication rules ("" when no host has any): per port, an
    ingress chain that copies a share of the frames from its host and of those to each host
    that duplicates."""
    dups = [h for h in tb.hosts if h.dup > 0]
    if not dups:
        return ""
    chains = []
    for port in tb.hosts:
        rules = []
        for h in dups:
            n = int(h.dup * SCALE)
            if h is port:
                rules.append(f'{match}numgen random mod {SCALE} < {n} counter dup to "br0"')
            else:  # to h: by its addresses (an IPv6 testbed's hosts have both)
                rules += [f'{fam} daddr {ip} {match}numgen random mod {SCALE} < {n} counter '
                          'dup to "br0"' for fam, ip in (("ip", h.ip), ("ip6", h.ip6)) if ip]
        chains.append(f" chain in_{port.port} {{\n  type filter hook ingress device "
                      f'"{port.port}" priority 0; policy accept;\n'
                      + "".join(f"  {r}\n" for r in rules) + " }\n")
    return f"table netdev {TABLE} {{\n" + "".join(chains) + "}\n"


def dropped(tb: Testbed) -> int:
    """Frames the loss rules have dropped so far."""
    if tb.switch == "emu":
        from hvd_sparse.tools.switch import control
        return sum(p["lost"] for p in control.Client(tb.switch_control).stats()["ports"])
    return counted(tb)["dropped"]


def counted(tb: Testbed) -> dict[str, int]:
    """Frames the rules have dropped, duplicated and held back (reordered) so far (bridge
    switch only); the counts start again at each change of the rules."""
    out = {"dropped": 0, "duplicated": 0, "reordered": 0}
    for family in ("bridge", "netdev"):
        listed = json.loads(_nft(tb, "-j", "list", "ruleset", family))
        for item in listed.get("nftables", []):
            rule = item.get("rule")
            if not rule or rule.get("table") != TABLE:
                continue
            exprs = rule.get("expr", [])
            n = sum(e["counter"]["packets"] for e in exprs if "counter" in e)
            kind = ("dropped" if any("drop" in e for e in exprs) else
                    "duplicated" if any("dup" in e for e in exprs) else "reordered")
            out[kind] += n
    return out
