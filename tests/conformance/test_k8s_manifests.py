"""docker/k8s: the Kubernetes manifests render, validate against the Kubernetes schemas (offline,
``kubernetes-validate`` ships them) and hang together.

Rendering: the overlays use only ``resources``, ``components`` and ``namespace``, which
:func:`render` implements; when a ``kubectl`` with kustomize is on PATH its output must equal
ours. CRDs (RabbitmqCluster, ServiceMonitor, PodMonitor) have no schema in the package: they are
checked against the subset of their schema this repository relies on (``CRD_SCHEMAS``), an
explicit allow-list; any other kind without a schema fails.

Cross-references: Service selectors and target ports, Secrets and ConfigMaps (the Secrets
against ``secrets.example.yaml`` and the README's ``kubectl create secret`` lines), probe and
scrape ports, ``$(VAR)`` references, every ``QLM_*`` variable against the settings classes,
every ``qlm`` flag against the CLI, and the broker node list against the RabbitMQ cluster.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer.main
import yaml

from qlm.cli import app
from qlm.config import Settings
from qlm.gateway.app import GatewaySettings

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "docker" / "k8s"
OVERLAYS = ["operator", "statefulset", "operator-monitoring"]
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are meant for

# Kinds from CRDs, with the part of their schema the manifests rely on (the upstream CRDs are
# large and not on PyPI). additionalProperties: false where we know the full set of fields we
# may use, so a typo fails.
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {
    "type": "object",
    "properties": {"matchLabels": _LABELS},
    "required": ["matchLabels"],
}
_ENDPOINT = {
    "type": "object",
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": {"type": "string", "pattern": r"^\d+[smh]$"},
    },
    "required": ["port"],
    "additionalProperties": False,
}


def _crd(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "labels": _LABELS},
                "required": ["name"],
            },
            "spec": spec,
        },
        "required": ["apiVersion", "kind", "metadata", "spec"],
    }


CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("rabbitmq.com/v1beta1", "RabbitmqCluster"): _crd(
        "rabbitmq.com/v1beta1",
        "RabbitmqCluster",
        {
            "type": "object",
            "properties": {
                "replicas": {"type": "integer", "minimum": 1},
                "image": {"type": "string"},
                "rabbitmq": {
                    "type": "object",
                    "properties": {
                        "additionalPlugins": {"type": "array", "items": {"type": "string"}},
                        "additionalConfig": {"type": "string"},
                    },
                    "additionalProperties": False,
                },
                "resources": {"type": "object"},
                "persistence": {
                    "type": "object",
                    "properties": {"storage": {"type": "string"}},
                    "additionalProperties": False,
                },
                "affinity": {"type": "object"},
            },
            "additionalProperties": False,
        },
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _crd(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        {
            "type": "object",
            "properties": {
                "selector": _SELECTOR,
                "endpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
            },
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
        },
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _crd(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        {
            "type": "object",
            "properties": {
                "selector": _SELECTOR,
                "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
            },
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
        },
    ),
}

# Flags of the interface being written in parallel (issue 19): `qlm agent --backend http
# --server MODEL=URL`. Remove an entry once the CLI has it.
PENDING_FLAGS: dict[str, set[str]] = {}  # flags the manifests use before the CLI has them
# Read with os.environ by the CLI rather than through a settings class.
CLI_ENV = {"QLM_ADMIN_URL", "QLM_ADMIN_CA", "QLM_MIGRATIONS_DIR"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}


# --- rendering ---------------------------------------------------------------------------------


def _load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def render(directory: Path) -> list[dict[str, Any]]:
    """``kustomize build`` for the subset the overlays use."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - {"apiVersion", "kind", "namespace", "resources", "components"}
    assert not unknown, f"{directory}: keep kustomizations simple (unsupported: {unknown})"
    objects: list[dict[str, Any]] = []
    for entry in [*kust.get("resources", []), *kust.get("components", [])]:
        path = (directory / entry).resolve()
        assert path.is_relative_to(K8S), f"{directory}: {entry} is outside docker/k8s"
        objects += render(path) if path.is_dir() else _load_docs(path)
    if "namespace" in kust:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = kust["namespace"]
    return objects


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def secrets_example() -> dict[str, dict[str, str]]:
    return {
        d["metadata"]["name"]: d["stringData"]
        for d in _load_docs(K8S / "base" / "secrets.example.yaml")
    }


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def workloads(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    return (o for o in objects if o["kind"] in WORKLOADS)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(K8S / "overlays" / request.param)


# --- rendering and schemas ---------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl (kustomize) on PATH")
@pytest.mark.parametrize("name", OVERLAYS)
def test_kubectl_kustomize_renders_what_we_render(name: str) -> None:
    proc = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / name)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    theirs = {key(d): d for d in yaml.safe_load_all(proc.stdout) if d}
    ours = {key(d): d for d in render(K8S / "overlays" / name)}
    assert theirs == ours


def test_every_object_validates(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    assert len({key(o) for o in objects}) == len(objects), f"{name}: duplicate objects"
    for obj in objects:
        crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if crd is not None:
            jsonschema.validate(obj, crd)
            continue
        try:  # strict: an unknown field is an error, not ignored
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {key(obj)}: {exc.message}")


def test_the_validator_catches_a_misspelt_field() -> None:
    """The check above can fail: a typo in a container is refused, also offline."""
    (deployment,) = [
        o for o in render(K8S / "base") if o["kind"] == "Deployment" and "gateway" in key(o)[2]
    ]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_both_overlays_give_the_broker_the_same_names() -> None:
    """base/ does not know which broker overlay it runs with."""
    operator = render(K8S / "overlays" / "operator")
    (cluster,) = [o for o in operator if o["kind"] == "RabbitmqCluster"]
    assert cluster["spec"]["replicas"] == 3
    statefulset = render(K8S / "overlays" / "statefulset")
    (sts,) = [o for o in statefulset if key(o)[2] == f"{cluster['metadata']['name']}-server"]
    assert sts["kind"] == "StatefulSet"
    assert sts["spec"]["replicas"] == 3
    # the operator's naming: <name>-server-N pods, <name>-nodes headless, <name> client Service
    assert sts["spec"]["serviceName"] == f"{cluster['metadata']['name']}-nodes"
    services = {key(o)[2]: o for o in statefulset if o["kind"] == "Service"}
    assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    assert cluster["metadata"]["name"] in services


# --- cross-references ----------------------------------------------------------------------


def broker_hosts(objects: list[dict[str, Any]]) -> set[str]:
    """The DNS names of the broker's nodes, as the RabbitMQ resource of this overlay names them."""
    for obj in objects:
        if obj["kind"] == "RabbitmqCluster":
            name, replicas = obj["metadata"]["name"], obj["spec"]["replicas"]
            return {f"{name}-server-{i}.{name}-nodes" for i in range(replicas)}
        if obj["kind"] == "StatefulSet" and "rabbitmq" in obj["metadata"]["name"]:
            spec = obj["spec"]
            return {
                f"{obj['metadata']['name']}-{i}.{spec['serviceName']}"
                for i in range(spec["replicas"])
            }
    raise AssertionError("no RabbitMQ in this overlay")


def test_services_select_pods_and_their_ports(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    pods = [
        (o["spec"]["template"]["metadata"]["labels"], c)
        for o in workloads(objects)
        for c in containers(o)
    ]
    operator_pods = any(o["kind"] == "RabbitmqCluster" for o in objects)
    for svc in (o for o in objects if o["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        matched = [c for labels, c in pods if selector.items() <= labels.items()]
        assert matched, f"{name}: Service {key(svc)} selects no pod"
        ports = {p.get("name") for c in matched for p in c.get("ports", [])} | {
            p["containerPort"] for c in matched for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in ports, f"{name}: {key(svc)} {port}"
    for monitor in (o for o in objects if o["kind"] in ("ServiceMonitor", "PodMonitor")):
        selector = monitor["spec"]["selector"]["matchLabels"]
        if monitor["kind"] == "ServiceMonitor":
            if selector.get("app.kubernetes.io/name") == "qlm-rabbitmq" and operator_pods:
                continue  # the operator's Service, labelled like ours, exposes "prometheus"
            targets = [
                p["name"]
                for s in objects
                if s["kind"] == "Service" and selector.items() <= s["metadata"]["labels"].items()
                for p in s["spec"]["ports"]
            ]
            endpoints = monitor["spec"]["endpoints"]
        else:
            targets = [
                p["name"]
                for labels, c in pods
                if selector.items() <= labels.items()
                for p in c.get("ports", [])
            ]
            endpoints = monitor["spec"]["podMetricsEndpoints"]
        for endpoint in endpoints:
            assert endpoint["port"] in targets, f"{name}: {key(monitor)} {endpoint}"


def test_secrets_and_config_maps_exist(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    maps = {key(o)[2]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    secrets = secrets_example()
    if any(o["kind"] == "RabbitmqCluster" for o in objects):
        secrets.pop("qlm-rabbitmq-erlang-cookie")  # the operator makes its own
    used: set[str] = set()

    def secret(ref: str, item: str | None, optional: bool = False) -> None:
        used.add(ref)
        if optional and ref not in secrets:
            return
        assert ref in secrets, f"{name}: Secret {ref} is not in secrets.example.yaml"
        assert item is None or item in secrets[ref], f"{name}: Secret {ref} has no key {item}"

    for obj in workloads(objects):
        spec = obj["spec"]["template"]["spec"]
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                for item in volume["secret"].get("items", [{"key": None}]):
                    secret(volume["secret"]["secretName"], item["key"])
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps, f"{name}: {volume}"
                for item in volume["configMap"].get("items", []):
                    assert item["key"] in maps[volume["configMap"]["name"]]
        for c in containers(obj):
            for source in c.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in maps, f"{name}: {source}"
                if "secretRef" in source:
                    secret(source["secretRef"]["name"], None)
            for env in c.get("env", []):
                ref = env.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    s = ref["secretKeyRef"]
                    secret(s["name"], s["key"], s.get("optional", False))
                if "configMapKeyRef" in ref:
                    assert ref["configMapKeyRef"]["key"] in maps[ref["configMapKeyRef"]["name"]]
            for mount in c.get("volumeMounts", []):
                volumes = {v["name"]: v for v in spec.get("volumes", [])}
                templates = {
                    t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])
                }
                assert mount["name"] in volumes or mount["name"] in templates, f"{name}: {mount}"
                if "subPath" in mount and "configMap" in volumes.get(mount["name"], {}):
                    cm = volumes[mount["name"]]["configMap"]["name"]
                    assert mount["subPath"] in maps[cm], f"{name}: {mount}"
    # The operator creates its user's Secret; every other documented one is used.
    assert set(secrets) <= used, f"{name}: unused Secrets {set(secrets) - used}"


def test_every_container_has_probes_resources_and_declared_ports(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objects = overlay
    for obj in workloads(objects):
        annotations = obj["spec"]["template"]["metadata"].get("annotations", {})
        all_ports = {p["containerPort"] for c in containers(obj) for p in c.get("ports", [])}
        if annotations.get("prometheus.io/scrape") == "true":
            assert int(annotations["prometheus.io/port"]) in all_ports, f"{name}: {key(obj)}"
        for c in containers(obj):
            where = f"{name}: {key(obj)} container {c['name']}"
            ports = {p["name"] for p in c.get("ports", [])} | {
                p["containerPort"] for p in c.get("ports", [])
            }
            assert "livenessProbe" in c and "readinessProbe" in c, where
            for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
                probe = c.get(kind, {})
                for handler in ("httpGet", "tcpSocket"):
                    if handler in probe:
                        assert probe[handler]["port"] in ports, f"{where}: {kind}"
            resources = c.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
            assert "memory" in resources.get("limits", {}), where


def _settings_env() -> set[str]:
    names = {f"QLM_{field.upper()}" for field in Settings.model_fields}
    names |= {f"QLM_GATEWAY_{field.upper()}" for field in GatewaySettings.model_fields}
    return names | CLI_ENV


def test_env_names_and_references(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """Every QLM_* variable is one qlm reads; every $(VAR) names an earlier variable (Kubernetes
    leaves an unknown reference as literal text, so a typo would reach the URL)."""
    name, objects = overlay
    known = _settings_env()
    maps = {key(o)[2]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    for var in maps.get("qlm-config", {}):
        assert var in known, f"{name}: qlm-config sets unknown {var}"
    for obj in workloads(objects):
        for c in containers(obj):
            defined: set[str] = set()
            for env in c.get("env", []):
                if env["name"].startswith("QLM_"):
                    assert env["name"] in known, f"{name}: {c['name']} sets unknown {env['name']}"
                for ref in re.findall(r"\$\((\w+)\)", env.get("value", "")):
                    assert ref in defined, f"{name}: {c['name']}: {env['name']} uses $({ref})"
                defined.add(env["name"])
            for arg in c.get("args", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in defined, f"{name}: {c['name']} argument uses $({ref})"


def _flags(command: str) -> set[str]:
    group = typer.main.get_command(app)
    cmd = group.commands[command]  # type: ignore[attr-defined]
    return {opt for param in cmd.params for opt in param.opts}


def test_qlm_commands_and_flags_exist(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    seen = set()
    for obj in workloads(objects):
        for c in containers(obj):
            if not str(c["image"]).startswith("qlm:"):
                continue
            command, *flags = c["args"]
            seen.add(command)
            known = _flags(command) | PENDING_FLAGS.get(command, set())
            for flag in flags:
                assert flag.split("=")[0] in known, f"{name}: qlm {command} has no {flag}"
    assert seen == {"coordinator", "gateway", "agent"}


def test_every_qlm_process_gets_the_whole_broker_node_list(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objects = overlay
    hosts = broker_hosts(objects)
    orders = []
    for obj in workloads(objects):
        for c in containers(obj):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if not str(c["image"]).startswith("qlm:"):
                continue
            url = env["QLM_AMQP_URL"]
            assert url is not None
            urls = url.split(",")
            assert {re.sub(r"^amqp://[^@]+@|:5672/$", "", u) for u in urls} == hosts, name
            orders.append(tuple(urls))
            # what qlm makes of it, with the Secret's values in place
            resolved = url.replace("$(BROKER_USER)", "qlm").replace("$(BROKER_PASSWORD)", "pw")
            assert len(Settings(amqp_url=resolved).amqp_url.split(",")) == len(hosts)
    assert len(set(orders)) == len(orders), f"{name}: give each process another order"


def test_the_coordinator_runs_with_a_standby() -> None:
    (coord,) = [
        o
        for o in render(K8S / "base")
        if key(o)[2] == "qlm-coordinator" and o["kind"] == "Deployment"
    ]
    assert coord["spec"]["replicas"] == 2
    # never both down in a rollout
    assert coord["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 1


def test_the_statefulset_broker_config_follows_docker_rabbitmq_conf() -> None:
    objects = render(K8S / "overlays" / "statefulset")
    (cm,) = [o for o in objects if key(o)[2] == "qlm-rabbitmq-config"]
    settings = [
        line.strip()
        for line in (REPO / "docker" / "rabbitmq.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert settings and all(line in cm["data"]["20-qlm.conf"] for line in settings)
    assert "consumer_timeout" not in "".join(cm["data"].values())
    plugins = set(re.findall(r"[a-z_]+", (REPO / "docker" / "enabled_plugins").read_text()))
    assert plugins <= set(re.findall(r"[a-z_]+", cm["data"]["enabled_plugins"]))
    assert "rabbitmq_peer_discovery_k8s" in cm["data"]["enabled_plugins"]
    (cluster,) = [
        o for o in render(K8S / "overlays" / "operator") if o["kind"] == "RabbitmqCluster"
    ]
    assert plugins - {"rabbitmq_management"} <= set(
        cluster["spec"]["rabbitmq"]["additionalPlugins"]
    )
    assert all(line in cluster["spec"]["rabbitmq"]["additionalConfig"] for line in settings)


def test_the_repo_holds_placeholders_only() -> None:
    for secret, data in secrets_example().items():
        for item, value in data.items():
            if item == "username":
                continue
            assert "CHANGE-ME" in value, f"{secret}/{item} is not a placeholder"
    for path in K8S.rglob("*.yaml"):
        for doc in _load_docs(path):
            if doc.get("kind") == "Secret":
                assert path.name == "secrets.example.yaml", f"{path}: a Secret outside the example"


def test_the_readme_creates_the_documented_secrets() -> None:
    """docker/README.md's `kubectl create secret generic NAME --from-...=KEY=...` lines create
    exactly the Secrets and keys of secrets.example.yaml."""
    text = (REPO / "docker" / "README.md").read_text().replace("\\\n", " ")  # join continued lines
    created: dict[str, set[str]] = {}
    for command in re.findall(r"kubectl -n qlm create secret generic [^\n]*", text):
        secret_name = command.split()[6]
        keys = set(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", command))
        created[secret_name] = keys
    expected = {k: set(v) for k, v in secrets_example().items()}
    assert created == expected
