"""The compose cluster (docker/docker-compose.yml) driven end to end: build its two images, run
one job on it, tear it down leaving no container, network or volume behind.

    python scripts/testbed/compose.py build
    python scripts/testbed/compose.py run [--job "python /opt/hvd-sparse/scripts/demo.py"] \
        [--rate 1gbit]

``make demo DEMO_ON=compose`` runs the demo this way (starting a Docker engine first where none
runs: scripts/testbed/dockerd.py). A plain ``docker compose up --build`` does the same on a machine
that reaches Docker Hub and PyPI; this script also builds where neither is directly usable:

* no image registry: the base image is a Debian bookworm made with debootstrap
  (docker/base-image.sh);
* PyPI behind a TLS-intercepting proxy: the host's extra CAs (/usr/local/share/ca-certificates)
  go to the build as EXTRA_CA_CERTS;
* no download.pytorch.org: the host's wheel house (pip's find-links, where torch's CPU wheel
  is) is served to the build over HTTP on the Docker bridge's gateway.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "docker-compose.yml"
# the worker image's dev target (docker/Dockerfile) and the aggregator image
IMAGES = ("hvd-sparse-worker-dev", "hvd-sparse-aggregator")
# Fixed, so the build argument (and with it the build cache) is the same from run to run.
WHEEL_PORT = int(os.environ.get("HVD_SPARSE_WHEEL_PORT", "18765"))
BUILD_TIMEOUT_S = 3600
DOWN_TIMEOUT_S = 120


def log(msg: str) -> None:
    print(f"[compose] {msg}", file=sys.stderr, flush=True)


@functools.cache
def compose_cmd() -> list[str]:
    """Compose v2 (the docker CLI plugin) where it is installed, else v1's docker-compose."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError("compose: neither `docker compose` nor docker-compose is installed")


def compose(project: str, *args: str, env: dict[str, str] | None = None,
            timeout: float = DOWN_TIMEOUT_S, capture: bool = True) -> subprocess.CompletedProcess:
    cmd = [*compose_cmd(), "-f", str(COMPOSE_FILE), "-p", project, *args]
    return subprocess.run(cmd, env={**os.environ, **(env or {})}, text=True, timeout=timeout,
                          capture_output=capture, stdin=subprocess.DEVNULL)


def pip_find_links() -> Path | None:
    """The host's wheel house: a local directory pip looks in (PIP_FIND_LINKS or pip config)."""
    value = os.environ.get("PIP_FIND_LINKS", "")
    if not value:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            value = subprocess.run([sys.executable, "-m", "pip", "config", "get",
                                    "global.find-links"], capture_output=True, text=True,
                                   timeout=30).stdout.strip()
    for item in value.split():
        path = Path(item.removeprefix("file://"))
        if path.is_dir() and any(path.glob("*.whl")):
            return path
    return None


@contextlib.contextmanager
def wheel_server(directory: Path) -> Iterator[str]:
    """``directory`` served over HTTP on the default bridge's gateway, for the build's RUNs."""
    gateway = subprocess.run(["docker", "network", "inspect", "bridge", "-f",
                              "{{(index .IPAM.Config 0).Gateway}}"], capture_output=True,
                             text=True, check=True, timeout=30).stdout.strip()
    if not gateway:  # dockerd 20.10 leaves the default bridge's Gateway empty: docker0's address
        addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "docker0"], capture_output=True,
                              text=True, check=True, timeout=30).stdout.split()
        gateway = addr[addr.index("inet") + 1].split("/")[0]
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer((gateway, WHEEL_PORT), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{gateway}:{WHEEL_PORT}/"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


def base_image() -> str:
    out = subprocess.run(["sh", str(ROOT / "docker" / "base-image.sh")], capture_output=True,
                         text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"compose: no base image: {out.stderr.strip()}")
    return out.stdout.strip().splitlines()[-1]


def build(project: str = "hvdsparse", no_cache: bool = False) -> float:
    """Builds both images (docker's layer cache makes a rebuild quick unless ``no_cache``);
    returns the seconds."""
    t0 = time.monotonic()
    env = {"BASE": base_image()}
    cas = sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt"))
    if cas:
        # as "$(cat ...)" gives them: one value from run to run keeps the build cache
        env["EXTRA_CA_CERTS"] = "".join(p.read_text() for p in cas).rstrip("\n")
    wheels = pip_find_links()
    with wheel_server(wheels) if wheels else contextlib.nullcontext("") as url:
        if url:
            env["BUILD_PIP_FIND_LINKS"] = url
            env["BUILD_PIP_TRUSTED_HOST"] = url.split("/")[2].split(":")[0]  # plain http
            if any(wheels.glob("torch-*.whl")):  # torch from there: no retries of its index
                env["TORCH_INDEX_URL"] = ""
        log(f"building {', '.join(IMAGES)} on {env['BASE']}"
            + (f", wheels from {wheels}" if wheels else ""))
        # One service per image: v1 would build the shared worker image once per service.
        # --force-rm: a failed step's container goes too
        out = compose(project, "build", "--force-rm", *(["--no-cache"] if no_cache else []),
                      "agg0", "launcher",
                      env={**env, "DOCKER_BUILDKIT": "0"}, timeout=BUILD_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"compose: build failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return time.monotonic() - t0


def image_size(name: str) -> int:
    return int(subprocess.run(["docker", "image", "inspect", name, "-f", "{{.Size}}"],
                              capture_output=True, text=True, check=True).stdout)


@dataclass
class Result:
    returncode: int
    output: str  # the launcher's (the job's) output
    aggregator: dict  # the aggregator's counters, printed at its exit
    leftovers: list[str]  # containers, networks, volumes of the project still there
    seconds: float


def leftovers(project: str) -> list[str]:
    out = []
    label = f"label=com.docker.compose.project={project}"
    for kind, fmt in (("container", "{{.Names}}"), ("network", "{{.Name}}"),
                      ("volume", "{{.Name}}")):
        listing = subprocess.run(["docker", kind, "ls", *(["-a"] if kind == "container" else []),
                                  "--filter", label, "--format", fmt], capture_output=True,
                                 text=True, timeout=60).stdout.split()
        out += [f"{kind} {n}" for n in listing]
    return out


def run(job: str | None = None, rate: str = "1gbit", project: str | None = None,
        timeout: float = 900, echo: bool = False) -> Result:
    """Brings the cluster up, runs ``job`` on the launcher (default: the demo), and takes it
    down, whatever happened. The images must be built (``build``)."""
    project = project or f"hvdsparse{os.getpid()}"
    env = {"RATE": rate, **({"JOB": job} if job else {})}
    t0 = time.monotonic()
    try:
        up = compose(project, "up", "--no-build", "--abort-on-container-exit",
                     "--exit-code-from", "launcher", env=env, timeout=timeout, capture=not echo)
        logs = compose(project, "logs", "--no-color", "launcher", env=env)
        agg = compose(project, "logs", "--no-color", "agg0", env=env)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"compose: the job did not end within {timeout:.0f} s") from e
    finally:
        down = compose(project, "down", "--volumes", "--remove-orphans", "--timeout", "10",
                       env=env)
        if down.returncode != 0:
            log(f"down failed: {down.stderr.strip()}")
    # "<service>_1  | " (v1) or "<service>-1  | " (v2) before each line
    output = "\n".join(re.sub(r"^\S+\s+\| ?", "", ln) for ln in logs.stdout.splitlines())
    stats = [ln.split("stats ", 1)[1] for ln in agg.stdout.splitlines()
             if "hvd-sparse aggregator stats {" in ln]
    return Result(up.returncode, output, json.loads(stats[-1]) if stats else {},
                  leftovers(project), time.monotonic() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("build", "run"))
    p.add_argument("--job", help="the launcher's command (default: the demo)")
    p.add_argument("--rate", default="1gbit", help="every container's link rate")
    p.add_argument("--no-cache", action="store_true", help="build every layer anew (cold build)")
    args = p.parse_args()
    seconds = build(no_cache=args.no_cache)
    log(f"images built in {seconds:.0f} s: " + ", ".join(
        f"{n} {image_size(n) / 1e6:.0f} MB" for n in IMAGES))
    if args.command == "build":
        return 0
    log("4 workers + 1 aggregator, links at " + args.rate)
    res = run(args.job, args.rate, echo=True)
    left = f"; LEFT BEHIND: {res.leftovers}" if res.leftovers else ", nothing left behind"
    log(f"job exited {res.returncode} after {res.seconds:.0f} s; cluster down{left}")
    return res.returncode or (1 if res.leftovers else 0)


if __name__ == "__main__":
    sys.exit(main())
