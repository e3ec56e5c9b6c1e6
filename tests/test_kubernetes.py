"""The Kubernetes manifests (deploy/kubernetes/) hold up without a cluster: the core kinds
validate strictly against Kubernetes' own schemas (kubernetes-validate, unknown fields fail),
the Kubeflow kinds against the operators' published CRD schemas (tests/data/kubeflow/, closed
to unknown fields as `kubectl apply` is), and the pod templates inside them against the core
PodTemplate; a typo'd manifest fails. Then what the validators cannot see: the port range the
jobs bind is the one the NetworkPolicy opens, the Secret reaches rank 0 and the aggregators as
a file they accept (mode 0400, read-only, not a symbolic link), sizes agree (ranks, aggregator
--workers), the images are the docker/ images the docs name, and the operators' own rules."""
from __future__ import annotations

import copy
import hashlib
import os
import re
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

import hvd_sparse
from hvd_sparse import HvdSparseError
from hvd_sparse.auth import read_secret_file
from hvd_sparse.config import Config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
CRDS = ROOT / "tests" / "data" / "kubeflow"
K8S = "1.37.0"  # the newest Kubernetes whose schemas kubernetes-validate 1.37.0 ships
IMAGE_HOME = "/opt/hvd-sparse"  # the checkout's place in the worker image (docker/Dockerfile)
REGISTRY = "registry.example.com"
FILES = {
    "secret.yaml": ["Secret"],
    "aggregators.yaml": ["Service", "StatefulSet", "PodDisruptionBudget"],
    "networkpolicy.yaml": ["NetworkPolicy", "NetworkPolicy"],
    "mpijob-horovod.yaml": ["MPIJob"],
    "pytorchjob-ddp.yaml": ["PyTorchJob"],
    # one rank per GPU (nvidia.com/gpu); not run on a GPU here
    "mpijob-horovod-gpu.yaml": ["MPIJob"],
    "pytorchjob-ddp-gpu.yaml": ["PyTorchJob"],
}
CORE = {"Secret", "Service", "StatefulSet", "NetworkPolicy", "PodDisruptionBudget"}
JOBS = {name: kinds[0] for name, kinds in FILES.items() if kinds[0] in ("MPIJob", "PyTorchJob")}
# kind -> (CRD file, version, its replica specs' field)
KUBEFLOW = {
    "MPIJob": ("kubeflow.org_mpijobs.yaml", "v2beta1", "mpiReplicaSpecs"),
    "PyTorchJob": ("kubeflow.org_pytorchjobs.yaml", "v1", "pytorchReplicaSpecs"),
}
JOB_LABELS = {"app.kubernetes.io/part-of": "hvd-sparse", "app.kubernetes.io/component": "job"}
AGG_LABELS = {"app.kubernetes.io/part-of": "hvd-sparse",
              "app.kubernetes.io/component": "aggregator"}


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def one(name: str, kind: str) -> dict:
    (doc,) = [d for d in load(name) if d["kind"] == kind]
    return doc


def all_docs() -> list[tuple[str, dict]]:
    return [(n, d) for n in FILES for d in load(n)]


@cache
def crd_schema(kind: str) -> dict:
    """The CRD's openAPIV3Schema for the version the manifests use, closed: every object
    schema with properties and no x-kubernetes-preserve-unknown-fields takes no other field."""
    file, version, _ = KUBEFLOW[kind]
    crd = yaml.safe_load((CRDS / file).read_text())
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert v["served"], f"{kind} {version} is not served by its CRD"
    return close(v["schema"]["openAPIV3Schema"])


def close(schema: dict) -> dict:
    s = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x)
            return
        if not isinstance(node, dict):
            return
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties"):
            for sub in node.get(key, {}).values():
                walk(sub)
        for key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            if key in node:
                walk(node[key])

    walk(s)
    return s


def crd_validate(doc: dict) -> None:
    """Raises jsonschema.ValidationError where ``doc`` does not fit its CRD's schema, and
    where its metadata is no ObjectMeta (the CRD leaves metadata to the API server)."""
    jsonschema.Draft7Validator(crd_schema(doc["kind"])).validate(doc)
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap",
                                  "metadata": doc["metadata"]}, K8S, strict=True)


def templates(doc: dict) -> dict[str, dict]:
    """Pod templates by role: a StatefulSet's, or each replica spec's of a Kubeflow job."""
    if doc["kind"] == "StatefulSet":
        return {"aggregator": doc["spec"]["template"]}
    field = KUBEFLOW[doc["kind"]][2]
    return {role: spec["template"] for role, spec in doc["spec"][field].items()}


def pods() -> list[tuple[str, str, dict]]:
    """(file, role, pod template) for every pod the manifests make."""
    out = []
    for name, doc in all_docs():
        if doc["kind"] in KUBEFLOW or doc["kind"] == "StatefulSet":
            out += [(name, role, t) for role, t in templates(doc).items()]
    return out


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def argv(container: dict) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def secret_key() -> tuple[str, str]:
    secret = one("secret.yaml", "Secret")
    (key,) = secret["stringData"]
    return secret["metadata"]["name"], key


# ------------------------------------------------------------------------------------------
# Against the schemas
# ------------------------------------------------------------------------------------------

def test_the_folder_holds_these_manifests() -> None:
    assert sorted(p.name for p in DEPLOY.glob("*.yaml")) == sorted(FILES)
    for name, kinds in FILES.items():
        assert [d["kind"] for d in load(name)] == kinds, name


@pytest.mark.parametrize("name,i", [(n, i) for n, ks in FILES.items()
                                    for i, k in enumerate(ks) if k in CORE])
def test_core_kinds_validate_strictly(name: str, i: int) -> None:
    doc = load(name)[i]
    assert kubernetes_validate.validate(doc, K8S, strict=True) == K8S.rsplit(".", 1)[0]


@pytest.mark.parametrize("name", sorted(JOBS))
def test_kubeflow_kinds_validate_against_their_crds(name: str) -> None:
    (doc,) = load(name)
    file, version, _ = KUBEFLOW[doc["kind"]]
    assert doc["apiVersion"] == f"kubeflow.org/{version}"
    crd_validate(doc)


@pytest.mark.parametrize("name,role,template", pods(),
                         ids=[f"{n}-{r}" for n, r, _ in pods()])
def test_pod_templates_validate_as_core_pod_templates(name: str, role: str,
                                                      template: dict) -> None:
    """The CRDs copy PodSpec's schema from some Kubernetes release; Kubernetes' own schema of
    the release the validator ships checks the templates too, strictly."""
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
               "metadata": {"name": f"{Path(name).stem}-{role.lower()}"}, "template": template}
    kubernetes_validate.validate(wrapped, K8S, strict=True)


def test_crds_are_the_published_files() -> None:
    """tests/data/kubeflow/README.md says where each came from and its SHA-256."""
    readme = (CRDS / "README.md").read_text()
    for file, *_ in KUBEFLOW.values():
        digest = hashlib.sha256((CRDS / file).read_bytes()).hexdigest()
        assert digest in readme and file in readme, f"{file}: {digest} not in README.md"


def _typo_mpijob(d: dict) -> None:  # slotsPerWorker misspelt
    d["spec"]["slotPerWorker"] = d["spec"].pop("slotsPerWorker")


def _typo_mpijob_pod(d: dict) -> None:  # a container field misspelt, deep in the template
    c = d["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    c["volumeMount"] = c.pop("volumeMounts")


def _typo_pytorchjob(d: dict) -> None:
    d["spec"]["nprocsPerNode"] = d["spec"].pop("nprocPerNode")


def _wrong_type_pytorchjob(d: dict) -> None:
    d["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "three"


def _typo_statefulset(d: dict) -> None:
    d["spec"]["template"]["spec"]["volumes"][0]["secret"]["defaultMod"] = 0o400


def _typo_networkpolicy(d: dict) -> None:
    d["spec"]["ingress"][0]["ports"][1]["endport"] = d["spec"]["ingress"][0]["ports"][1].pop(
        "endPort")


def _typo_service(d: dict) -> None:
    d["spec"]["clusterIp"] = d["spec"].pop("clusterIP")


def _typo_pdb(d: dict) -> None:
    d["spec"]["maxUnavailabe"] = d["spec"].pop("maxUnavailable")


def _typo_security_context(d: dict) -> None:  # the GPU job's pod security, misspelt
    pod = d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    pod["securityContext"]["runAsNonroot"] = pod["securityContext"].pop("runAsNonRoot")


@pytest.mark.parametrize("name,kind,breaks", [
    ("mpijob-horovod.yaml", "MPIJob", _typo_mpijob),
    ("mpijob-horovod.yaml", "MPIJob", _typo_mpijob_pod),
    ("pytorchjob-ddp.yaml", "PyTorchJob", _typo_pytorchjob),
    ("pytorchjob-ddp.yaml", "PyTorchJob", _wrong_type_pytorchjob),
    ("aggregators.yaml", "StatefulSet", _typo_statefulset),
    ("aggregators.yaml", "Service", _typo_service),
    ("aggregators.yaml", "PodDisruptionBudget", _typo_pdb),
    ("pytorchjob-ddp-gpu.yaml", "PyTorchJob", _typo_security_context),
    ("networkpolicy.yaml", "NetworkPolicy", _typo_networkpolicy),
], ids=lambda x: x.__name__.strip("_") if callable(x) else None)
def test_a_broken_manifest_fails(name: str, kind: str, breaks) -> None:
    """The validation has teeth: one misspelt field (or a wrong type) and it fails."""
    doc = copy.deepcopy([d for d in load(name) if d["kind"] == kind][0])
    breaks(doc)
    if kind in KUBEFLOW:
        with pytest.raises(jsonschema.ValidationError):
            crd_validate(doc)
    else:
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, K8S, strict=True)


def test_closing_a_crd_schema_leaves_its_maps_open() -> None:
    """Closing the CRD schema leaves open what the schema leaves open (labels, resource
    maps), so the manifests' real maps still validate and a misspelt key in a map is the API
    server's business, as on a cluster."""
    schema = crd_schema("PyTorchJob")
    tmpl = schema["properties"]["spec"]["properties"]["pytorchReplicaSpecs"][
        "additionalProperties"]["properties"]["template"]
    labels = tmpl["properties"]["metadata"]["properties"]["labels"]
    assert labels["additionalProperties"] == {"type": "string"}
    assert tmpl["additionalProperties"] is False


# ------------------------------------------------------------------------------------------
# What the schemas cannot see
# ------------------------------------------------------------------------------------------

def job_policy_udp() -> list[tuple[int, int]]:
    policy = [d for d in load("networkpolicy.yaml")
              if d["spec"]["podSelector"]["matchLabels"] == JOB_LABELS]
    (policy,) = policy
    return [(p["port"], p.get("endPort", p["port"])) for rule in policy["spec"]["ingress"]
            for p in rule["ports"] if p["protocol"] == "UDP"]


def test_port_range_is_what_the_network_policy_opens() -> None:
    """Every pod that runs ranks binds in HVD_SPARSE_PORTS (MPIJob: the launcher's env goes
    to every rank), a range hvd-sparse accepts, and the job's policy opens exactly it."""
    ranges = set()
    for name, kind in JOBS.items():
        doc = one(name, kind)
        roles = ["Launcher"] if kind == "MPIJob" else ["Master", "Worker"]
        for role, t in templates(doc).items():
            (c,) = t["spec"]["containers"]
            if role in roles:
                ranges.add(env(c)["HVD_SPARSE_PORTS"])
            else:  # an MPIJob worker's env does not reach ranks started over ssh
                assert "HVD_SPARSE_PORTS" not in env(c), f"{name} {role}: set on the launcher"
    (ports,) = ranges
    lo, hi = Config(ports=ports).port_range()
    assert (lo, hi) == (29600, 29699)
    udp = job_policy_udp()
    assert udp and all(r == (lo, hi) for r in udp), udp
    # and the range stays clear of the other ports the jobs use
    assert not lo <= 29500 <= hi and not lo <= 9999 <= hi


def test_network_policy_admits_the_jobs_pods_only() -> None:
    job, agg = load("networkpolicy.yaml")
    assert job["spec"]["podSelector"]["matchLabels"] == JOB_LABELS
    assert agg["spec"]["podSelector"]["matchLabels"] == AGG_LABELS
    for policy in (job, agg):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            # pods of this namespace chosen by label, nothing by address or namespace
            assert all(set(peer) == {"podSelector"} for peer in rule["from"]), rule
            assert rule["ports"], "a rule without ports admits every port"
    tcp = [p for rule in job["spec"]["ingress"] for p in rule["ports"] if p["protocol"] == "TCP"]
    # all TCP (sshd, torchrun's rendezvous, Gloo's ephemeral ports), from the job's pods only
    assert tcp == [{"protocol": "TCP"}]
    (tcp_rule,) = [r for r in job["spec"]["ingress"] if {"protocol": "TCP"} in r["ports"]]
    assert tcp_rule["from"] == [{"podSelector": {"matchLabels": JOB_LABELS}}]
    # every pod carries the labels its policy selects
    for name, role, t in pods():
        want = AGG_LABELS if role == "aggregator" else JOB_LABELS
        assert t["metadata"]["labels"].items() >= want.items(), f"{name} {role}"


def test_aggregators_agree_on_their_port_and_names() -> None:
    svc, sts = one("aggregators.yaml", "Service"), one("aggregators.yaml", "StatefulSet")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    port = int(flag(argv(c), "--bind").rsplit(":", 1)[1])
    (cport,) = c["ports"]
    (sport,) = svc["spec"]["ports"]
    assert cport["containerPort"] == sport["port"] == port
    assert cport["protocol"] == sport["protocol"] == "UDP"
    assert sport["targetPort"] == cport["name"]
    assert svc["spec"]["clusterIP"] == "None", "headless: a DNS name per aggregator"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"] == labels
    (agg_policy,) = [d for d in load("networkpolicy.yaml")
                     if d["spec"]["podSelector"]["matchLabels"] == AGG_LABELS]
    assert [p for r in agg_policy["spec"]["ingress"] for p in r["ports"]] == [
        {"protocol": "UDP", "port": port}]
    # the HVD_SPARSE_AGGREGATORS the files tell a job to use: one name per replica
    names = ",".join(f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{port}"
                     for i in range(sts["spec"]["replicas"]))
    for file in ("aggregators.yaml", "mpijob-horovod.yaml", "pytorchjob-ddp.yaml"):
        text = (DEPLOY / file).read_text()
        shown = re.findall(r"HVD_SPARSE_AGGREGATORS=(\S+)", text) + re.findall(
            r"name: HVD_SPARSE_AGGREGATORS\n\s*#?\s*value: (\S+)", text)
        assert shown and set(shown) == {names}, f"{file}: {shown} vs {names}"
    assert names in (ROOT / "docs" / "kubernetes.md").read_text()


def world_size(name: str) -> int:
    """Ranks of a job manifest: MPIJob workers x slots, PyTorchJob pods x nprocPerNode."""
    doc = one(name, JOBS[name])
    if JOBS[name] == "MPIJob":
        return doc["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] * doc["spec"]["slotsPerWorker"]
    specs = doc["spec"]["pytorchReplicaSpecs"]
    return sum(sp["replicas"] for sp in specs.values()) * int(doc["spec"]["nprocPerNode"])


def gpus(container: dict) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def test_sizes_agree() -> None:
    """horovodrun's -np is the hostfile's slots; the GPU jobs run one rank per GPU; the
    aggregators are held to no size (no --workers: they serve jobs of any size at once)."""
    for name, kind in JOBS.items():
        doc = one(name, kind)
        if kind == "MPIJob":
            (launcher,) = templates(doc)["Launcher"]["spec"]["containers"]
            assert int(flag(argv(launcher), "-np")) == world_size(name), name
        ranks_per_pod = doc["spec"]["slotsPerWorker"] if kind == "MPIJob" \
            else int(doc["spec"]["nprocPerNode"])
        for role, t in templates(doc).items():
            if role == "Launcher":
                continue
            (c,) = t["spec"]["containers"]
            assert gpus(c) == (ranks_per_pod if "-gpu" in name else 0), f"{name} {role}"
    assert {world_size(n) for n in JOBS} == {4, 8}
    (c,) = one("aggregators.yaml", "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert "--workers" not in argv(c)
    assert "any size" in (DEPLOY / "aggregators.yaml").read_text()


def test_aggregators_have_a_disruption_budget() -> None:
    """Voluntary evictions may take no aggregator: a running job would lose its sums."""
    pdb = one("aggregators.yaml", "PodDisruptionBudget")
    sts = one("aggregators.yaml", "StatefulSet")
    assert pdb["spec"]["selector"] == sts["spec"]["selector"]
    assert pdb["spec"] == {"maxUnavailable": 0, "selector": sts["spec"]["selector"]}


def secret_mounts() -> list[tuple[str, str, dict, dict, dict]]:
    """(file, role, container, its mount of the Secret, the volume) wherever it is mounted."""
    name, _ = secret_key()
    out = []
    for file, role, t in pods():
        vols = {v["name"]: v for v in t["spec"].get("volumes", [])
                if v.get("secret", {}).get("secretName") == name}
        for c in t["spec"]["containers"]:
            out += [(file, role, c, m, vols[m["name"]]) for m in c.get("volumeMounts", [])
                    if m["name"] in vols]
    return out


def test_secret_is_mounted_read_only_mode_0400_as_a_file() -> None:
    _, key = secret_key()
    mounts = secret_mounts()
    where = {(f, r) for f, r, *_ in mounts}
    # rank 0's pod (any MPIJob worker; the PyTorchJob's Master) and the aggregators; no other
    assert where == {(n, "Worker" if k == "MPIJob" else "Master") for n, k in JOBS.items()} | {
        ("aggregators.yaml", "aggregator")}, where
    for file, role, _, m, vol in mounts:
        what = f"{file} {role}"
        assert vol["secret"]["defaultMode"] == 0o400, what
        assert m["readOnly"] is True, what
        # the key itself (a Secret volume's keys are symbolic links, which hvd-sparse refuses)
        assert m["subPath"] == key, what
        # the jobs read it only with dedicated aggregators: they start without the Secret
        # (the colocated default); the aggregators always read it
        assert vol["secret"].get("optional", False) is (file != "aggregators.yaml"), what
    # the path each reader is given is the mount
    (agg,) = [(c, m) for f, _, c, m, _ in mounts if f == "aggregators.yaml"]
    assert flag(argv(agg[0]), "--secret-file") == agg[1]["mountPath"]
    for name, kind in JOBS.items():
        if kind == "MPIJob":
            (launcher,) = templates(one(name, kind))["Launcher"]["spec"]["containers"]
            (worker_mount,) = [m for f, r, _, m, _ in mounts if f == name]
            assert env(launcher)["HVD_SPARSE_SECRET_FILE"] == worker_mount["mountPath"]
        else:
            (master,) = [(c, m) for f, _, c, m, _ in mounts if f == name]
            assert env(master[0])["HVD_SPARSE_SECRET_FILE"] == master[1]["mountPath"]


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def test_pods_meet_pod_security_restricted() -> None:
    """Every pod passes Pod Security's "restricted" profile: non-root (a uid the worker image
    runs as), seccomp RuntimeDefault, no privilege escalation, every capability dropped, no
    host namespaces or host paths; and an fsGroup, through which the non-root user reads the
    Secret (a group the image names for no user: docs/security.md)."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile).group(1))
    for file, role, t in pods():
        what, spec = f"{file} {role}", t["spec"]
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert sc["runAsUser"] == sc["runAsGroup"] == uid, what
        assert sc["fsGroup"] not in (0, uid), what
        assert str(sc["fsGroup"]) not in dockerfile, f"{what}: the image names the fsGroup"
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), what
        for v in spec.get("volumes", []):
            assert set(v) - {"name"} <= RESTRICTED_VOLUMES, f"{what}: volume {v}"
        for c in spec["containers"]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, what
            assert csc["capabilities"] == {"drop": ["ALL"]}, what
            assert not csc.get("privileged") and csc.get("runAsUser", uid) != 0, what


def kubelet_secret_volume(root: Path, key: str, data: bytes, mode: int) -> Path:
    """A Secret volume as kubelet writes one: the data in a timestamped folder, `..data`
    linking to it, each key a link through `..data`."""
    stamp = root / "..2026_11_28_00_00_00.000000001"
    stamp.mkdir(parents=True)
    (stamp / key).write_bytes(data)
    os.chmod(stamp / key, mode)
    (root / "..data").symlink_to(stamp.name)
    (root / key).symlink_to(f"..data/{key}")
    return stamp / key


def test_why_the_secret_is_mounted_by_subpath(tmp_path: Path) -> None:
    """hvd-sparse (and the C++ aggregator, with the same O_NOFOLLOW) refuses the key of a
    plain Secret volume mount, a symbolic link; a subPath mount is the file itself, which it
    reads at mode 0400 and refuses when others may read it. (The 0440 an fsGroup gives, read
    by a non-root user: tests/test_secret_file.py.)"""
    _, key = secret_key()
    secret = os.urandom(32).hex().encode()
    real = kubelet_secret_volume(tmp_path / "vol", key, secret + b"\n", 0o400)
    with pytest.raises(HvdSparseError, match="symbolic links"):
        read_secret_file(tmp_path / "vol" / key)
    assert read_secret_file(real) == secret
    os.chmod(real, 0o444)
    with pytest.raises(HvdSparseError, match="readable by others"):
        read_secret_file(real)


def test_secret_template_is_refused_until_replaced(tmp_path: Path) -> None:
    """Applied unchanged, the template's placeholder makes no working secret."""
    _, key = secret_key()
    placeholder = one("secret.yaml", "Secret")["stringData"][key]
    f = tmp_path / "secret"
    f.write_text(placeholder)
    f.chmod(0o400)
    with pytest.raises(HvdSparseError, match="fewer than 16 bytes"):
        read_secret_file(f)
    assert "kubectl create secret generic hvd-sparse-secret --from-file=secret=" in (
        DEPLOY / "secret.yaml").read_text()


def test_operators_rules() -> None:
    """What the operators' webhooks and controllers demand beyond their schemas, and what the
    worker image's non-root sshd needs from the MPIJob."""
    sshd = dict(ln.split(None, 1) for ln in (ROOT / "docker" / "sshd_config").read_text()
                .splitlines() if ln.strip() and not ln.startswith("#"))
    for name, kind in JOBS.items():
        spec = one(name, kind)["spec"]
        if kind == "MPIJob":
            assert spec["mpiReplicaSpecs"]["Launcher"]["replicas"] == 1
            # the operator mounts its per-job key there; the image's sshd reads its host key
            # and authorized keys from it (StrictModes off: a Secret volume's layout)
            assert sshd["HostKey"].startswith(spec["sshAuthMountPath"] + "/")
            assert sshd["AuthorizedKeysFile"].startswith(spec["sshAuthMountPath"] + "/")
            assert sshd["StrictModes"] == "no"
            (worker,) = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
            assert argv(worker)[0] == "/usr/sbin/sshd"
            assert flag(argv(worker), "-f") == f"{IMAGE_HOME}/docker/sshd_config"
            (port,) = worker["ports"]
            (launcher,) = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
            assert argv(launcher)[0] == "horovodrun" and "--gloo" in argv(launcher)
            assert int(flag(argv(launcher), "--ssh-port")) == port["containerPort"] \
                == int(sshd["Port"]) > 1024, name
            assert worker["readinessProbe"]["tcpSocket"]["port"] == port["name"]
            replicas = spec["mpiReplicaSpecs"].values()
        else:
            pt = spec["pytorchReplicaSpecs"]
            assert set(pt) == {"Master", "Worker"} and pt["Master"]["replicas"] == 1
            for rs in pt.values():
                assert "pytorch" in [c["name"] for c in rs["template"]["spec"]["containers"]]
            (master,) = pt["Master"]["template"]["spec"]["containers"]
            (port,) = [p for p in master["ports"] if p["name"] == "pytorchjob-port"]
            assert port["containerPort"] == 29500
            replicas = pt.values()
        for rs in replicas:
            assert rs["restartPolicy"] in ("Never", "OnFailure")


def test_operator_hostfile_is_what_horovodrun_reads(tmp_path: Path) -> None:
    """The hostfile the MPI Operator writes for its OpenMPI implementation (a line "POD.SERVICE
    .NAMESPACE.svc slots=N" per worker), read by horovodrun's own parser, gives -np ranks; the
    Intel implementation's "POD:N" lines are not readable by it (hence OpenMPI, the default)."""
    from horovod.runner.common.util.hosts import parse_host_files

    for name, kind in JOBS.items():
        if kind != "MPIJob":
            continue
        doc = one(name, kind)
        job, spec = doc["metadata"]["name"], doc["spec"]
        assert spec.get("mpiImplementation", "OpenMPI") == "OpenMPI", name
        workers = spec["mpiReplicaSpecs"]["Worker"]["replicas"]
        hostfile = tmp_path / f"{job}.hostfile"
        hostfile.write_text("".join(f"{job}-worker-{i}.{job}.default.svc slots="
                                    f"{spec['slotsPerWorker']}\n" for i in range(workers)))
        hosts = parse_host_files(str(hostfile)).split(",")
        (launcher,) = templates(doc)["Launcher"]["spec"]["containers"]
        assert len(hosts) == workers
        assert sum(int(h.rsplit(":", 1)[1]) for h in hosts) == int(flag(argv(launcher), "-np"))
        hostfile.write_text(f"{job}-worker-0.{job}:{spec['slotsPerWorker']}\n")
        with pytest.raises(IndexError):
            parse_host_files(str(hostfile))


def test_docs_state_the_operators_minimum_versions() -> None:
    """The fields and behaviours the manifests rely on are the operators' since a release the
    docs name: PyTorchJob's nprocPerNode and PET_* variables, MPIJob v2beta1's hostfile with
    "slots=" lines and launcherCreationPolicy."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    m = re.search(r"^\*\*Operator versions\.\*\*(.*?)\n\n", text, re.M | re.S)
    assert m, "docs/kubernetes.md: no Operator versions paragraph"
    para = " ".join(m.group(1).split())
    for word in ("MPI Operator v0.4.0", "slots=", "launcherCreationPolicy",
                 "Training Operator v1.7.0", "PET_NNODES", "nprocPerNode"):
        assert word in para, word


# the image each Dockerfile builds, by the name the docs and manifests push it under
IMAGES = {"docker/Dockerfile": "hvd-sparse-worker",
          "docker/Dockerfile.aggregator": "hvd-sparse-aggregator",
          "docker/Dockerfile.gpu": "hvd-sparse-worker-gpu"}


def dockerfile_of(file: str, role: str) -> str:
    if role == "aggregator":
        return "docker/Dockerfile.aggregator"
    return "docker/Dockerfile.gpu" if "-gpu" in file else "docker/Dockerfile"


def test_images_are_the_docker_images() -> None:
    """Workers, launcher and master run docker/Dockerfile's runtime image (docker/Dockerfile.gpu's
    in the GPU manifests), the aggregators docker/Dockerfile.aggregator's, at the package's
    version; the compose testbed builds the same names (the worker image's dev target as
    NAME-dev); the docs and each manifest build what they run."""
    compose = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())
    for s in compose["services"].values():
        name = IMAGES[s["build"]["dockerfile"]]
        want = f"{name}-{s['build']['target']}" if "target" in s["build"] else name
        assert s["image"] == want, s
    v = hvd_sparse.__version__
    want = {dockerfile: f"{REGISTRY}/{image}:{v}" for dockerfile, image in IMAGES.items()}
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "docker/Dockerfile.gpu" in docs
    for file, role, t in pods():
        (c,) = t["spec"]["containers"]
        dockerfile = dockerfile_of(file, role)
        assert c["image"] == want[dockerfile], f"{file} {role}"
        build = f"docker build -f {dockerfile} -t {want[dockerfile]} ."
        assert build in (DEPLOY / file).read_text(), f"{file}: {build}"
        if dockerfile != "docker/Dockerfile.gpu":  # built with arguments: its header says
            assert build in docs, f"docs/kubernetes.md: {build}"


def test_commands_exist_in_their_images() -> None:
    """The aggregator binary where Dockerfile.aggregator puts it; the job scripts in the
    repository under the path the worker image keeps the checkout at."""
    agg_docker = (ROOT / "docker" / "Dockerfile.aggregator").read_text()
    (c,) = one("aggregators.yaml", "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert re.search(rf"^COPY .* {re.escape(c['command'][0])}$", agg_docker, re.M)
    for rel in job_scripts():
        assert (ROOT / rel).is_file(), rel


def job_scripts() -> set[str]:
    out = set()
    for _, _, t in pods():
        for c in t["spec"]["containers"]:
            out |= {a[len(IMAGE_HOME) + 1:] for a in argv(c) if a.startswith(IMAGE_HOME + "/")}
    return out


def image_copies() -> set[str]:
    """The repository paths docker/Dockerfile copies to the same path under IMAGE_HOME (a
    folder as "name/")."""
    workdir, out = "/", set()
    for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["WORKDIR"]:
            workdir = words[1]
        elif words[:1] == ["COPY"] and workdir == IMAGE_HOME and "--from" not in line:
            *srcs, dest = words[1:]
            for src in srcs:
                to = dest + Path(src).name if dest.endswith("/") and not src.endswith("/") \
                    else dest
                if Path(to).as_posix().lstrip("./") == Path(src).as_posix():
                    out.add(src)
    return out


def test_job_scripts_are_in_the_worker_image() -> None:
    copied = image_copies()
    assert {"scripts/", "hvd_sparse/", "setup.py"} <= copied, copied  # the parser reads it
    for rel in job_scripts():
        assert rel in copied or any(rel.startswith(c) for c in copied if c.endswith("/")), \
            f"{rel} is not in the worker image (docker/Dockerfile copies {sorted(copied)})"


def test_docs_describe_every_manifest() -> None:
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    for name in FILES:
        assert f"`{name}`" in text, name
    assert "kubernetes-validate" in text and "no cluster" in text.lower()
