"""Frame loss on the switch: nftables rules in the switch namespace's bridge forward chain, or
the emulated switch's own loss (it reads frames before netfilter could drop them).

Loss is dropped on the path (never in a sender's own output chain, which a sender would see
as a send error). A rule per lossy host drops frames entering or leaving its port at random
(``numgen random``); the testbed-wide rate applies to every port. Rules are rewritten whole
from the state on every change, so a job can see loss change while it runs."""
from __future__ import annotations

import json
import subprocess

from .topology import Testbed

TABLE = "hvd_sparse"
SCALE = 1_000_000  # loss rates in millionths


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
    script = (f"table bridge {TABLE}\ndelete table bridge {TABLE}\n"  # first makes delete safe
              f"table bridge {TABLE} {{\n chain forward {{\n"
              "  type filter hook forward priority 0; policy accept;\n"
              + "".join(f"  {r}\n" for r in rules) + " }\n}\n")
    _nft(tb, "-f", "-", script=script)


def dropped(tb: Testbed) -> int:
    """Frames the loss rules have dropped so far."""
    if tb.switch == "emu":
        from hvd_sparse.tools.switch import control
        return sum(p["lost"] for p in control.Client(tb.switch_control).stats()["ports"])
    out = json.loads(_nft(tb, "-j", "list", "table", "bridge", TABLE))
    total = 0
    for item in out.get("nftables", []):
        for expr in item.get("rule", {}).get("expr", []):
            if "counter" in expr:
                total += expr["counter"]["packets"]
    return total
