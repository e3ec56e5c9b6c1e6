"""docker/ checked statically, in seconds and without a Docker engine (tests/test_compose.py
builds and runs it for real where Docker can run).

The compose file's services, the Dockerfiles they build, every file those copy, every command
they run (project scripts, the aggregator binary and its flags, hvd-sparse subcommands, the
Debian packages that provide the rest), the rate caps, the shared secret, and the worker count
the launcher assumes.
"""
from __future__ import annotations

import ast
import copy
import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
VENV_BIN = "/opt/hvd-sparse/.venv/bin"
# Commands the images get from somewhere other than a COPY: the Debian package, "base" (the base
# image has it) or "venv" (scripts/setup/setup.sh and pip install . put it in VENV_BIN).
PROVIDERS = {"ssh": "openssh-client", "/usr/sbin/sshd": "openssh-server", "tc": "iproute2",
             "bash": "base", "sh": "base", "sleep": "base", "python": "venv",
             "horovodrun": "venv", "hvd-sparse": "venv"}
SHELL_WORDS = {"for", "in", "do", "done", "until", "while", "if", "then", "else", "fi", "exec"}


def binaries() -> dict[str, list[str]]:
    """setup.py's BINARIES (name -> sources), read without running setup.py."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "BINARIES":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no BINARIES")


def binary_flags() -> list[str]:
    """The compiler flags setup.py builds those binaries with (the list holding -pthread)."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.List):
            consts = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if "-pthread" in consts:
                return [c for c in consts if c.startswith("-")]
    raise AssertionError("setup.py: no compiler flags with -pthread")


@dataclass
class Stage:
    name: str
    base: str
    workdir: str = "/"
    runs: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # image path -> repo path, or ("stage", path) for COPY --from
    copies: dict[str, Path | tuple[str, str]] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out, cur = [], ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not cur):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        word, _, args = cur.partition(" ")
        out.append((word.upper(), args.strip()))
        cur = ""
    return out


def exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else ["/bin/sh", "-c", args]


def parse(dockerfile: Path, context: Path) -> list[Stage]:
    """The stages of a Dockerfile; checks every COPY/ADD source against the build context."""
    stages: list[Stage] = []
    ignored = dockerignore(context)
    args_before_from: dict[str, str] = {}  # ARGs a FROM may use, at their defaults
    for word, args in instructions(dockerfile):
        if word == "ARG" and not stages:
            name, _, default = args.partition("=")
            args_before_from[name] = default.strip('"')
            continue
        if word == "FROM":
            parts = re.sub(r"\$\{(\w+)\}", lambda m: args_before_from[m.group(1)], args).split()
            name = parts[2] if len(parts) > 2 else str(len(stages))
            parent = [st for st in stages if st.name == parts[0]]
            if parent:  # FROM an earlier stage: everything it has, on its base
                stage = copy.deepcopy(parent[-1])
                stage.name = name
                stages.append(stage)
            else:
                stages.append(Stage(name, parts[0]))
            continue
        st = stages[-1]
        if word == "ARG":
            continue
        if word == "WORKDIR":
            st.workdir = str(PurePosixPath(st.workdir, args))
        elif word == "RUN":
            st.runs.append(args)
        elif word == "ENV":
            st.env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
        elif word in ("ENTRYPOINT", "CMD"):
            setattr(st, word.lower(), exec_form(args))
        elif word in ("COPY", "ADD"):
            tokens = json.loads(args) if args.startswith("[") else shlex.split(args)
            flags = dict(t[2:].split("=", 1) for t in tokens if t.startswith("--"))
            *srcs, dest = [t for t in tokens if not t.startswith("--")]
            dest_abs = PurePosixPath(st.workdir, dest)
            into = dest.endswith("/") or len(srcs) > 1  # files land under dest/, by name

            def target(name: str, is_dir: bool, dest_abs: PurePosixPath = dest_abs,
                       into: bool = into) -> str:
                return str(dest_abs / name if into and not is_dir else dest_abs)

            for src in srcs:
                if "from" in flags:
                    assert flags["from"] in [s.name for s in stages[:-1]], \
                        f"{dockerfile.name}: COPY --from={flags['from']}: no such stage"
                    st.copies[target(PurePosixPath(src).name, False)] = (flags["from"], src)
                    continue
                matches = list(context.glob(src.rstrip("/"))) if src != "." else [context]
                assert matches, f"{dockerfile.name}: {word} {src}: not in the repository"
                for m in matches:
                    rel = m.relative_to(context).as_posix()
                    assert not any(fnmatch.fnmatch(rel, p) for p in ignored), \
                        f"{dockerfile.name}: {word} {src}: excluded by .dockerignore"
                    st.copies[target(m.name, m.is_dir())] = m
    return stages


def dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    return [ln.strip() for ln in path.read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def repo_path(stage: Stage, image_path: str) -> Path | None:
    """The repository file an image path was copied from, if any."""
    for dest, src in sorted(stage.copies.items(), key=lambda kv: -len(kv[0])):
        if isinstance(src, Path) and (image_path == dest or image_path.startswith(dest + "/")):
            return src / image_path[len(dest):].lstrip("/") if src.is_dir() else src
    return None


def apt_packages(stage: Stage) -> set[str]:
    pkgs = set()
    for run in stage.runs:
        for m in re.finditer(r"apt-get install ([^&;|]*)", run):
            pkgs.update(t for t in m.group(1).split() if not t.startswith("-"))
    return pkgs


def command_words(script: str) -> list[list[str]]:
    """Each simple command of a shell script, as tokens (enough for the scripts used here)."""
    lex = shlex.shlex(script, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    cmds, cur = [], []
    for tok in lex:
        if tok in (";", "&&", "||", "|", "&"):
            cmds.append(cur)
            cur = []
        else:
            cur.append(tok)
    cmds.append(cur)
    out = []
    for c in cmds:
        while c and c[0] in SHELL_WORDS:
            c = [] if c[0] == "for" else c[1:]  # `for h in ...`: a loop head, no command
        if c:
            out.append(c)
    return out


# ------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def images(compose: dict) -> dict[str, list[Stage]]:
    """Service -> stages of the Dockerfile it builds (every service must build one here)."""
    out = {}
    for name, svc in compose["services"].items():
        assert "build" in svc or "image" in svc, f"{name}: neither build nor image"
        assert "build" in svc, f"{name}: pulls {svc['image']}: nothing in this project builds it"
        context = (COMPOSE.parent / svc["build"]["context"]).resolve()
        dockerfile = context / svc["build"].get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        stages = parse(dockerfile, context)
        target = svc["build"].get("target")
        if target:  # the build stops at that stage
            names = [st.name for st in stages]
            assert target in names, f"{name}: target {target} not among {names}"
            stages = stages[:names.index(target) + 1]
        out[name] = stages
    return out


def effective(svc: dict, stages: list[Stage]) -> list[str]:
    """What the container runs: compose's entrypoint/command over the image's."""
    entry = svc.get("entrypoint", stages[-1].entrypoint)
    cmd = svc.get("command", stages[-1].cmd if "entrypoint" not in svc else [])
    as_list = [(shlex.split(x) if isinstance(x, str) else x) for x in (entry, cmd)]
    return [t.replace("$$", "$") for t in as_list[0] + as_list[1]]


def roles(compose: dict) -> tuple[list[str], list[str], str]:
    """(workers, aggregators, launcher) service names."""
    services = compose["services"]
    launcher = [n for n, s in services.items() if "launch.sh" in json.dumps(s.get("command"))]
    assert len(launcher) == 1, f"one service must run docker/launch.sh, found {launcher}"
    workers = [n for n, s in services.items()
               if n != launcher[0] and s["build"]["dockerfile"] == "docker/Dockerfile"]
    aggs = [n for n, s in services.items() if s["build"]["dockerfile"].endswith(".aggregator")]
    return workers, aggs, launcher[0]


def default_job(compose: dict, launcher: str) -> list[str]:
    """The launcher's JOB (what docker/launch.sh runs under horovodrun) at its default."""
    job = compose["services"][launcher]["environment"]["JOB"]
    m = re.fullmatch(r"\$\{JOB:-(.+)\}", job)
    assert m, f"{launcher}: JOB={job}: expected ${{JOB:-default}}"
    return shlex.split(m.group(1))


# ---------------------------------------------------------------------------------------- tests

def test_every_service_builds_an_image_of_this_project(images: dict[str, list[Stage]]) -> None:
    assert images
    for name, stages in images.items():
        assert "bookworm" in stages[-1].base, f"{name}: final stage on {stages[-1].base}"


def test_commands_exist_in_the_images(compose: dict, images: dict[str, list[Stage]]) -> None:
    services, bins = compose["services"], binaries()
    for name, svc in services.items():
        stages = images[name]
        argv = effective(svc, stages)
        assert argv, f"{name}: runs nothing"
        programs = [argv[0]]
        if argv[0].endswith("netcap.sh"):
            programs.append(argv[1])
        if "JOB" in svc.get("environment", {}):
            # the job launch.sh runs: an interpreter and a script copied from the repository
            job = default_job(compose, name)
            programs += ["horovodrun", job[0]]
            scripts = [t for t in job if t.endswith(".py")]
            src = repo_path(stages[-1], scripts[0]) if scripts else None
            assert src is not None and src.is_file(), f"{name}: JOB {job}"
        for prog in programs:
            check_program(name, prog, stages, bins)


def check_program(service: str, prog: str, stages: list[Stage], bins: dict[str, str]) -> None:
    final = stages[-1]
    src = repo_path(final, prog)
    if src is not None:
        assert src.is_file() and os.access(src, os.X_OK), f"{service}: {prog} <- {src}: " \
            "missing or not executable in the repository"
        return
    copied = final.copies.get(prog)
    if isinstance(copied, tuple):
        stage, path = copied
        (built,) = [s for s in stages if s.name == stage]
        outputs = [r for r in built.runs if f"-o {path}" in r]
        assert outputs, f"{service}: {prog}: stage {stage} never builds {path}"
        assert Path(prog).name in bins, f"{service}: {prog} is not one of setup.py's {bins}"
        return
    provider = PROVIDERS.get(prog)
    assert provider, f"{service}: runs {prog!r}, which nothing in the image provides"
    if provider == "venv":
        assert VENV_BIN in final.env.get("PATH", ""), f"{service}: {VENV_BIN} not on PATH"
        runs = " ".join(final.runs)
        assert "scripts/setup/setup.sh" in runs and "pip install" in runs, \
            f"{service}: {prog} needs scripts/setup/setup.sh and pip install ."
    elif provider != "base":
        assert provider in apt_packages(final), f"{service}: {prog} needs Debian package {provider}"


def test_scripts_and_cli_subcommands_exist(compose: dict) -> None:
    # what runs: RUN lines, and the services' commands (bash -c scripts or argv lists)
    shell = [a for p in DOCKER.glob("Dockerfile*") for w, a in instructions(p) if w == "RUN"]
    for svc in compose["services"].values():
        shell.append(shlex.join(svc.get("command", [])))
        shell.append(svc.get("environment", {}).get("JOB", ""))
    scripts = {m for t in shell for m in re.findall(r"scripts/[\w./-]+", t)}
    assert {"scripts/demo.py", "scripts/setup/setup.sh"} <= scripts
    for s in scripts:
        assert (ROOT / s).is_file(), f"docker/ refers to {s}, which does not exist"
    subcommands = {w[1] for t in shell for w in command_words(t.replace("$$", "$"))
                   if w[0] == "hvd-sparse"}
    assert subcommands, "docker/ never runs the hvd-sparse CLI"
    for sub in subcommands:
        proc = subprocess.run([sys.executable, "-m", "hvd_sparse.tools.cli", sub, "--help"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"hvd-sparse {sub} --help: {proc.stdout}{proc.stderr}"


def test_aggregator_image_is_torch_free_and_builds_setup_pys_binary(
        images: dict[str, list[Stage]], compose: dict) -> None:
    _, aggs, _ = roles(compose)
    assert aggs
    name, sources = "hvd-sparse-aggregator", binaries()["hvd-sparse-aggregator"]
    for agg in aggs:
        dockerfile = ROOT / compose["services"][agg]["build"]["dockerfile"]
        text = " ".join(a for _, a in instructions(dockerfile)).lower()
        for word in ("torch", "horovod", "pip", "python", "setup.sh"):
            assert word not in text, f"{dockerfile.name} mentions {word}: it must stay torch-free"
        stages = images[agg]
        compiling = [(s, r) for s in stages for r in s.runs if all(c in r for c in sources)]
        assert compiling, f"{dockerfile.name} never compiles all of {sources}"
        stage, run = compiling[0]
        for flag in binary_flags():
            assert flag in run.split(), f"{dockerfile.name}: g++ lacks setup.py's {flag}"
        # Every header the aggregator includes (transitively) must be copied into the image.
        todo, seen = [ROOT / src for src in sources], set()
        while todo:
            f = todo.pop()
            if f in seen:
                continue
            seen.add(f)
            in_image = str(PurePosixPath(stage.workdir, f.relative_to(ROOT).as_posix()))
            assert repo_path(stage, in_image) == f, \
                f"{dockerfile.name}: {f.relative_to(ROOT)} is not copied into the build stage"
            for inc in re.findall(r'#include "([^"]+)"', f.read_text()):
                cands = [f.parent / inc, ROOT / "csrc" / inc]
                todo.append(next(c for c in cands if c.exists()).resolve())  # no ../ left
        assert any(Path(p).name == name for p in stages[-1].copies), \
            f"{dockerfile.name}: final image has no {name}"


def test_every_link_is_rate_capped(compose: dict, images: dict[str, list[Stage]]) -> None:
    netcap = DOCKER / "netcap.sh"
    text = netcap.read_text()
    assert re.search(r"tc qdisc \w+ dev \"?\$DEV\"? root tbf rate \"?\$RATE", text)
    assert "RATE=${RATE:-1gbit}" in text and "DEV=${NET_DEV:-eth0}" in text
    assert 'exec "$@"' in text
    assert subprocess.run(["sh", "-n", str(netcap)]).returncode == 0
    for name, svc in compose["services"].items():
        assert "NET_ADMIN" in svc.get("cap_add", []), f"{name}: tc needs NET_ADMIN"
        assert svc.get("environment", {}).get("RATE") == "${RATE:-1gbit}", f"{name}: RATE"
        argv = effective(svc, images[name])
        assert argv[0].endswith("/netcap.sh"), f"{name}: entrypoint {argv[0]} sets no cap"
        assert repo_path(images[name][-1], argv[0]) == netcap, f"{name}: {argv[0]}"
        assert "iproute2" in apt_packages(images[name][-1]), f"{name}: tc needs iproute2"


def test_launcher_matches_workers_and_aggregators(compose: dict) -> None:
    services = compose["services"]
    workers, aggs, launcher = roles(compose)
    assert len(workers) == 4 and len(aggs) == 1
    # launch.sh waits for these hosts' sshd and runs one rank on each
    hosts = services[launcher]["environment"]["WORKERS"].split()
    worker_hosts = {services[w].get("hostname", w) for w in workers}
    assert set(hosts) == worker_hosts, f"WORKERS {hosts} vs worker services {worker_hosts}"
    np_ = len(hosts)
    assert set(services[launcher].get("depends_on", [])) >= set(workers) | set(aggs)
    # HVD_SPARSE_AGGREGATORS names the aggregator services at the port they bind, each
    # expecting every rank.
    addrs = services[launcher]["environment"]["HVD_SPARSE_AGGREGATORS"].split(",")
    assert sorted(a.split(":")[0] for a in addrs) == sorted(
        services[a].get("hostname", a) for a in aggs)
    for addr in addrs:
        host, port = addr.split(":")
        (agg,) = [a for a in aggs if services[a].get("hostname", a) == host]
        cmd = services[agg]["command"]
        assert cmd[cmd.index("--bind") + 1].endswith(f":{port}")
        assert int(cmd[cmd.index("--workers") + 1]) == np_
    nets = [set(s.get("networks", [])) for s in services.values()]
    assert nets[0] and all(n == nets[0] for n in nets), "services on different networks"
    assert nets[0] <= set(compose.get("networks", {}))


def test_aggregator_flags_exist(compose: dict) -> None:
    import hvd_sparse.aggregator

    help_text = subprocess.run([str(hvd_sparse.aggregator.binary()), "--help"],
                               capture_output=True, text=True, timeout=30)
    usage = help_text.stdout + help_text.stderr
    _, aggs, _ = roles(compose)
    for agg in aggs:
        for flag in (t for t in compose["services"][agg]["command"] if t.startswith("--")):
            assert flag in usage, f"{agg}: hvd-sparse-aggregator has no {flag}"


def test_script_flags_exist(compose: dict, images: dict[str, list[Stage]]) -> None:
    """Flags the launcher passes to a project script appear in its argparse definitions."""
    _, _, launcher = roles(compose)
    job = default_job(compose, launcher)
    (script,) = [t for t in job if t.endswith(".py")]
    src = repo_path(images[launcher][-1], script).read_text()
    for flag in job[job.index(script) + 1:]:
        if flag.startswith("--"):
            assert f'"{flag.split("=")[0]}"' in src, f"{script} has no {flag}"


def test_build_context_keeps_the_checkouts_venv_out() -> None:
    ignored = dockerignore(ROOT)
    for must in (".venv", "build", "**/*.so", "hvd_sparse/bin"):
        assert must in ignored, f".dockerignore must exclude {must}: COPY . would ship it"


def test_cluster_shares_one_secret(compose: dict) -> None:
    """The aggregators run with --secret-file, rank 0's host has the same file (the launcher
    passes HVD_SPARSE_SECRET_FILE to every rank), one container makes it, all mount it."""
    services = compose["services"]
    workers, aggs, launcher = roles(compose)
    path = services[launcher]["environment"]["HVD_SPARSE_SECRET_FILE"]
    assert "HVD_SPARSE_AUTH" not in json.dumps(compose), "the cluster must run authenticated"
    makers = [n for n, s in services.items() if s["environment"].get("SECRET_MAKE") == "1"]
    assert len(makers) == 1, makers
    for name in [*workers, *aggs, launcher]:
        svc = services[name]
        assert svc["environment"].get("SECRET_FILE") == path, f"{name}: SECRET_FILE"
        mounts = [v.split(":") for v in svc.get("volumes", [])]
        assert any(path.startswith(m[1] + "/") and m[0] in compose["volumes"] for m in mounts), \
            f"{name}: no shared volume holds {path}"
    for agg in aggs:
        cmd = services[agg]["command"]
        assert cmd[cmd.index("--secret-file") + 1] == path, f"{agg}: --secret-file"
    assert "SECRET_MAKE" in (DOCKER / "netcap.sh").read_text()


def test_readme_says_how_it_is_tested() -> None:
    text = (DOCKER / "README.md").read_text()
    assert "tests/test_compose.py" in text and "statically" not in text


# ------------------------------------------------------------------- runtime, dev and GPU images

def versions() -> dict[str, str]:
    text = (ROOT / "scripts" / "setup" / "versions.env").read_text()
    return dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', text, re.M))


def test_runtime_image_has_no_key_no_test_tools_and_a_non_root_user() -> None:
    """docker/Dockerfile's default target (its last stage), what the manifests deploy: no key
    made at build time (keys are mounted at run time), sshd's package-made host keys removed,
    scripts/setup/setup.sh in its runtime mode (no pytest, ruff, ...), and a numeric non-root USER
    whose sshd configuration exists."""
    stages = parse(DOCKER / "Dockerfile", ROOT)
    runtime = stages[-1]
    text = " ".join(runtime.runs)
    assert "ssh-keygen" not in text and "authorized_keys" not in text
    assert "rm -f /etc/ssh/ssh_host_*" in text
    assert re.search(r"HVD_SPARSE_SETUP=runtime .*bash scripts/setup/setup\.sh", text), text
    for tool in ("pytest", "ruff", "hypothesis", "PY_TEST_DEPS", "OMPI_ALLOW_RUN_AS_ROOT"):
        assert tool not in text and tool not in json.dumps(runtime.env), tool
    users = [a for w, a in instructions(DOCKER / "Dockerfile") if w == "USER"]
    assert users[0] == "1000:1000", users  # the runtime stage's; Kubernetes' runAsUser
    # uid 1000 (the manifests' runAsUser), an account sshd without PAM does not read as locked
    assert "--uid 1000" in text and "--password '*'" in text
    assert runtime.cmd[:1] == ["/usr/sbin/sshd"] and not runtime.entrypoint, runtime
    conf = repo_path(runtime, runtime.cmd[runtime.cmd.index("-f") + 1])
    assert conf == DOCKER / "sshd_config", conf
    settings = dict(ln.split(None, 1) for ln in conf.read_text().splitlines()
                    if ln.strip() and not ln.startswith("#"))
    assert int(settings["Port"]) > 1024 and settings["HostKey"].startswith("/home/hvd/.ssh/")
    # setup.sh's runtime mode drops the test tools and the test-only Debian packages
    v = versions()
    assert set(v["APT_RUNTIME_PACKAGES"].split()) < set(v["APT_PACKAGES"].split())
    setup = (ROOT / "scripts" / "setup" / "setup.sh").read_text()
    assert 'runtime) APT_PACKAGES=$APT_RUNTIME_PACKAGES; PY_TEST_DEPS=""' in setup


def test_dev_image_is_the_runtime_plus_tools_with_keys_made_at_run_time(compose: dict) -> None:
    """The compose testbed builds the dev target: the runtime stage plus the test tools, root
    and docker/netcap.sh; the ssh key is made by one container at start into a volume every
    worker mounts (netcap.sh, SSH_KEY_DIR), never at build time."""
    stages = parse(DOCKER / "Dockerfile", ROOT)
    (dev,) = [st for st in stages if st.name == "dev"]
    assert "pytest" in versions()["PY_TEST_DEPS"] and "$PY_TEST_DEPS" in " ".join(dev.runs)
    assert not any("ssh-keygen" in r for r in dev.runs)
    services = compose["services"]
    workers, _, launcher = roles(compose)
    for name in [*workers, launcher]:
        assert services[name]["build"].get("target") == "dev", name
        assert services[name]["environment"]["SSH_KEY_DIR"] == "/run/ssh", name
        assert any(v.split(":")[:2] == ["ssh", "/run/ssh"] for v in services[name]["volumes"])
    makers = [n for n, s in services.items() if s["environment"].get("SSH_KEY_MAKE") == "1"]
    assert makers == [launcher], makers
    assert "ssh:/run/ssh" in services[launcher]["volumes"], "the maker writes the volume"
    assert "ssh" in compose["volumes"]
    netcap = (DOCKER / "netcap.sh").read_text()
    assert 'ssh-keygen -q -t ed25519 -N "" -C hvd-sparse-compose -f "$tmp/id_ed25519"' in netcap
    assert "ssh-keygen -A" in netcap  # sshd's host keys, per container


def test_gpu_dockerfile_takes_its_base_as_an_argument() -> None:
    """docker/Dockerfile.gpu (not built here): BASE is an ARG the FROM uses, a CUDA base by
    default; torch's CUDA index an ARG too; no key, no test tools, the runtime's user."""
    gpu = DOCKER / "Dockerfile.gpu"
    ins = instructions(gpu)
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE=") and "cuda" in ins[0][1]
    assert ("FROM", "${BASE}") in ins
    (stage,) = parse(gpu, ROOT)
    text = " ".join(stage.runs)
    assert "ssh-keygen" not in text and "pytest" not in text
    assert "HVD_SPARSE_SETUP=runtime" in text and "rm -f /etc/ssh/ssh_host_*" in text
    assert any(w == "ARG" and a.startswith("TORCH_INDEX_URL=") and "/cu" in a for w, a in ins)
    assert ("USER", "1000:1000") in ins and stage.cmd == parse(DOCKER / "Dockerfile", ROOT)[-1].cmd
    assert "not built" in gpu.read_text().lower()
