"""Start a Docker engine for the compose testbed when none runs, and stop it leaving the host's
network as it was.

    python scripts/testbed/dockerd.py start   # installs docker.io + docker-compose (apt) if missing
    python scripts/testbed/dockerd.py stop    # stops the daemon only if start started it

dockerd changes the root namespace's network when it starts: it turns on ip_forward and, when
it did so itself, sets the iptables FORWARD policy to DROP (every other bridge on the host
would stop forwarding routed traffic), adds its chains and NAT rules and the docker0 bridge.
``start`` records all of it first and turns ip_forward on itself, so dockerd leaves the
policy alone; ``stop`` stops the daemon it started and undoes each change. Needs root. Uses
are counted (a lock file), so a test and ``make demo DEMO_ON=compose`` can overlap; an engine
that already ran before is used and never stopped.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

STATE_DIR = Path("/run/hvd-sparse-dockerd")
STATE = STATE_DIR / "state.json"
LOG = Path("/var/log/hvd-sparse-dockerd.log")
PACKAGES = ["docker.io", "docker-compose", "debootstrap", "iptables"]
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
SYSCTLS = ["net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables",
           "net/bridge/bridge-nf-call-ip6tables", "net/bridge/bridge-nf-call-arptables"]


def log(msg: str) -> None:
    print(f"[dockerd] {msg}", file=sys.stderr, flush=True)


def run(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout)


def engine_up() -> bool:
    """A daemon answers on the default socket."""
    if shutil.which("docker") is None:
        return False
    try:
        return run("docker", "version", "--format", "{{.Server.Version}}", check=False,
                   timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def read_sysctls() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for k in SYSCTLS:
        try:
            out[k] = Path("/proc/sys", k).read_text().strip()
        except OSError:  # br_netfilter not loaded: dockerd will load it
            out[k] = None
    return out


def iptables_dump(tool: str) -> dict[str, list[str]]:
    """table -> its lines (chain heads with policies, and rules) as ``<tool>-save`` prints them."""
    if shutil.which(f"{tool}-save") is None:
        return {}
    tables: dict[str, list[str]] = {}
    cur = None
    for line in run(f"{tool}-save").stdout.splitlines():
        if line.startswith("*"):
            cur = tables.setdefault(line[1:], [])
        elif cur is not None and line.startswith((":", "-A")):
            cur.append(line)
    return tables


def nft_tables() -> list[str]:
    if shutil.which("nft") is None:
        return []
    return [" ".join(line.split()[1:3]) for line in run("nft", "list", "tables").stdout.splitlines()
            if line.startswith("table ")]


def links() -> list[str]:
    return sorted(os.listdir("/sys/class/net"))


@contextlib.contextmanager
def locked() -> Iterator[dict]:
    """The shared state, read and written under an exclusive lock."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(STATE.read_text()) if STATE.exists() else {"users": 0}
        yield state
        if state.get("users", 0) > 0:
            STATE.write_text(json.dumps(state, indent=1) + "\n")
        else:
            STATE.unlink(missing_ok=True)


def install() -> None:
    missing = [p for p in PACKAGES if run("dpkg-query", "-W", "-f=${Status}", p,
                                          check=False).stdout != "install ok installed"]
    if not missing:
        return
    log(f"apt-get install {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    # policy-rc.d-less hosts would start the daemon from the package's init script: we start it.
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
                   check=True, env=env, timeout=1200, stdout=subprocess.DEVNULL)


def start() -> int:
    if os.geteuid() != 0:
        log("needs root")
        return 1
    with locked() as state:
        if state["users"] > 0:
            state["users"] += 1
            return 0 if engine_up() else 1
        if engine_up():
            log("a Docker engine already runs: using it, it stays up")
            state.update(users=1, started=False)
            return 0
        install()
        if engine_up():  # the package's init script started one after all
            log("docker.io's install started a daemon: using it, it stays up")
            state.update(users=1, started=False)
            return 0
        before = {"sysctls": read_sysctls(), "iptables": iptables_dump("iptables"),
                  "ip6tables": iptables_dump("ip6tables"),
                  "links": links(), "br_netfilter": Path("/proc/sys/net/bridge").exists()}
        # With ip_forward already on, dockerd keeps the FORWARD policy as it is (it sets DROP
        # only when it turns forwarding on itself).
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        log(f"starting dockerd (log {LOG})")
        with open(LOG, "ab") as f:
            proc = subprocess.Popen(["dockerd", "--pidfile", str(STATE_DIR / "dockerd.pid")],
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        state.update(users=1, started=True, pid=proc.pid, before=before)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not engine_up():
            if proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with {proc.returncode}" if proc.poll() is not None
                       else f"not answering after {START_TIMEOUT_S} s")
                log(f"dockerd {why}; last lines of {LOG}:\n" + tail(LOG))
                stop_locked(state)
                state["users"] = 0
                return 1
            time.sleep(0.5)
        log(f"dockerd {proc.pid} up")
    return 0


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def stop() -> int:
    with locked() as state:
        if state["users"] == 0:
            log("nothing to stop")
            return 0
        state["users"] -= 1
        if state["users"] > 0 or not state.get("started"):
            return 0
        return stop_locked(state)


def stop_locked(state: dict) -> int:
    pid = state["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while alive(pid):
        if time.monotonic() > deadline:
            log(f"dockerd {pid} still up after {STOP_TIMEOUT_S} s: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            time.sleep(1)
            break
        time.sleep(0.2)
    with contextlib.suppress(OSError, ChildProcessError):
        os.waitpid(pid, 0)  # ours when start() and stop() share a process (the tests' fixture)
    restore(state["before"])
    log(f"dockerd {pid} stopped, host network restored")
    return 0


def alive(pid: int) -> bool:
    try:
        # a zombie (our child, not reaped yet) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def restore(before: dict) -> None:
    """Undo what dockerd added: its links, chains and rules, and the sysctls as they were."""
    for name in set(links()) - set(before["links"]):
        if name == "docker0" or name.startswith(("br-", "veth")):
            run("ip", "link", "del", name, check=False)
    for tool in ("iptables", "ip6tables"):
        old = before[tool]
        for table, lines in iptables_dump(tool).items():
            # only dockerd's: rules others add meanwhile stay
            added = [ln for ln in lines if ln.startswith("-A") and ln not in old.get(table, [])
                     and re.search(r"DOCKER|docker0| br-", ln)]
            for rule in reversed(added):
                run(tool, "-t", table, "-D", *shlex.split(rule)[1:], check=False)
            for ln in lines:
                chain, policy = ln[1:].split()[:2] if ln.startswith(":") else (None, None)
                if chain is None:
                    continue
                was = next((o for o in old.get(table, []) if o.startswith(f":{chain} ")), None)
                if was is None and policy == "-":  # a chain dockerd made
                    run(tool, "-t", table, "-F", chain, check=False)
                    run(tool, "-t", table, "-X", chain, check=False)
                elif was is not None and was.split()[1] != policy and policy != "-":
                    run(tool, "-t", table, "-P", chain, was.split()[1], check=False)
    # Tables only dockerd made, empty again, go too (iptables-nft leaves them behind).
    for tool, family in (("iptables", "ip"), ("ip6tables", "ip6")):
        for table, lines in iptables_dump(tool).items():
            empty = all(ln.startswith(":") and ln.split()[1] in ("ACCEPT", "-") for ln in lines)
            if table not in before[tool] and empty and f"{family} {table}" in nft_tables():
                run("nft", "delete", "table", family, table, check=False)
    for k, v in before["sysctls"].items():
        p = Path("/proc/sys", k)
        if v is not None and p.exists() and p.read_text().strip() != v:
            p.write_text(v + "\n")


def main() -> int:
    cmd = sys.argv[1] if len(sys.argv) == 2 else ""
    if cmd == "start":
        return start()
    if cmd == "stop":
        return stop()
    if cmd == "status":
        print(STATE.read_text() if STATE.exists() else '{"users": 0}')
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
