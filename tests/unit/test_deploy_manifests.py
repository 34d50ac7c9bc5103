"""The Kubernetes manifests in deploy/k8s agree with the API, with each other and with the server.

No cluster is needed: every resource is checked against the Kubernetes API's
own schemas (``kubernetes-validate``, strict: an unknown or misspelt field
fails), and then the parts that must agree are compared: the probes, the
container ports, the Services and the listen addresses in the settings; the
pods' labels and every selector; the termination grace period and the drain;
the settings themselves, built into the server's own ``Settings`` class, and
the token file, parsed by the server's own parser.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from leasekeeper_server.observability.health import LIVENESS
from leasekeeper_server.rpc.service import SERVICE_NAME
from leasekeeper_server.security.mode import auth_enabled
from leasekeeper_server.security.tokens import parse_token_file
from leasekeeper_server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
# The oldest Kubernetes the manifests are written for (gRPC probes are GA since
# 1.27, unhealthyPodEvictionPolicy since 1.31 GA, beta and on by default before),
# and the newest the schema package knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
ENV_PREFIX = "LEASEKEEPER_"


def load_resources() -> list[dict[str, Any]]:
    """Every resource the kustomization lists, in its order."""
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    resources = []
    for name in kustomization["resources"]:
        resources.extend(d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d)
    return resources


RESOURCES = load_resources()


def one(kind: str) -> dict[str, Any]:
    found = [r for r in RESOURCES if r["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} resources"
    return found[0]


def by_name(kind: str, name: str) -> dict[str, Any]:
    return next(r for r in RESOURCES if r["kind"] == kind and r["metadata"]["name"] == name)


DEPLOYMENT = one("Deployment")
POD = DEPLOYMENT["spec"]["template"]
CONTAINER = POD["spec"]["containers"][0]
CONFIG = one("ConfigMap")
SECRET = one("Secret")


def container_port(name: str) -> int:
    return next(p["containerPort"] for p in CONTAINER["ports"] if p["name"] == name)


def listen_port(variable: str) -> int:
    return int(CONFIG["data"][variable].rpartition(":")[2])


def secret_value(key: str) -> str:
    return SECRET["stringData"][key]


def manifest_settings() -> Settings:
    """The server's settings as the pods get them: the ConfigMap plus the Secret's URL."""
    env = dict(CONFIG["data"])
    for variable in CONTAINER["env"]:
        if variable["name"].startswith(ENV_PREFIX):
            env[variable["name"]] = secret_value(variable["valueFrom"]["secretKeyRef"]["key"])
    values = {name.removeprefix(ENV_PREFIX).lower(): value for name, value in env.items()}
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


def test_kustomization_lists_every_manifest_in_the_folder():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(on_disk)
    assert kustomization["namespace"] == one("Namespace")["metadata"]["name"]
    assert [i["name"] for i in kustomization["images"]] == [CONTAINER["image"]]


def test_manifests_have_every_kind_once_and_two_services():
    kinds = sorted(r["kind"] for r in RESOURCES)
    expected = ["ConfigMap", "Deployment", "Namespace", "PodDisruptionBudget", "Secret"]
    assert kinds == sorted([*expected, "Service", "Service"])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "resource", RESOURCES, ids=[f"{r['kind']}-{r['metadata']['name']}" for r in RESOURCES]
)
def test_manifest_valid_against_kubernetes_schema(resource, version):
    problem = None
    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as error:  # the message, not the whole schema
        problem = f"at {'/'.join(str(part) for part in error.path)}: {error.message}"
    assert problem is None, problem


def test_probes_use_the_health_port_named_in_container_and_settings():
    grpc_port = container_port("grpc")
    assert grpc_port == listen_port("LEASEKEEPER_LISTEN")
    assert manifest_settings().listen.endswith(f":{grpc_port}")
    # The kubelet's gRPC probes cannot speak TLS: they use the plaintext
    # health-only port (LEASEKEEPER_HEALTH_LISTEN).
    health_port = container_port("health")
    assert health_port == listen_port("LEASEKEEPER_HEALTH_LISTEN")
    assert manifest_settings().health_listen.endswith(f":{health_port}")
    readiness, startup = CONTAINER["readinessProbe"], CONTAINER["startupProbe"]
    liveness = CONTAINER["livenessProbe"]
    # Kubernetes' gRPC probe takes a port number only; it calls grpc.health.v1.
    assert readiness["grpc"]["port"] == startup["grpc"]["port"] == health_port
    assert liveness["grpc"]["port"] == health_port
    # The server registers health for "", the lease service (readiness: it
    # follows the database) and leasekeeper.liveness (it does not): health.py.
    assert readiness["grpc"]["service"] == SERVICE_NAME
    assert startup["grpc"].get("service", "") in ("", SERVICE_NAME)
    assert liveness["grpc"]["service"] == LIVENESS


def test_startup_probe_outlasts_the_servers_startup_wait():
    startup = CONTAINER["startupProbe"]
    allowed_s = startup["periodSeconds"] * startup["failureThreshold"]
    assert allowed_s > manifest_settings().startup_wait_s


def test_metrics_port_matches_settings_annotations_and_service():
    metrics_port = container_port("metrics")
    assert metrics_port == listen_port("LEASEKEEPER_METRICS_LISTEN")
    annotations = POD["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"
    ports = {p["name"]: p for p in by_name("Service", "leasekeeper")["spec"]["ports"]}
    assert ports["metrics"]["targetPort"] == "metrics"


def test_termination_grace_covers_prestop_pause_and_shutdown_grace():
    command = CONTAINER["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause_s = float(command[1])
    grace_s = manifest_settings().shutdown_grace_s
    assert pause_s > 0
    assert POD["spec"]["terminationGracePeriodSeconds"] > pause_s + grace_s


def test_selectors_match_the_pods():
    labels = POD["metadata"]["labels"]
    selector = DEPLOYMENT["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    pdb = one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    for service in (r for r in RESOURCES if r["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= labels.items(), service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in {p["name"] for p in CONTAINER["ports"]}
    spread = POD["spec"]["topologySpreadConstraints"]
    anti = POD["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    for term in [*spread, *(t["podAffinityTerm"] for t in anti)]:
        assert term["labelSelector"]["matchLabels"] == selector


def test_replicas_survive_one_disruption_and_headless_service_lists_ready_pods():
    replicas = DEPLOYMENT["spec"]["replicas"]
    pdb = one("PodDisruptionBudget")["spec"]
    assert replicas >= 3
    assert pdb.get("maxUnavailable") == 1 or pdb.get("minAvailable", 0) >= replicas - 1
    assert DEPLOYMENT["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    headless = by_name("Service", "leasekeeper-headless")["spec"]
    assert headless["clusterIP"] == "None"
    assert headless.get("publishNotReadyAddresses", False) is False
    assert [p["port"] for p in headless["ports"]] == [container_port("grpc")]


def test_settings_from_manifests_validate_and_require_tokens():
    settings = manifest_settings()
    # Every variable names a setting: a misspelt one would be silently ignored.
    unknown = {
        name
        for name in CONFIG["data"]
        if name.removeprefix(ENV_PREFIX).lower() not in Settings.model_fields
    }
    assert not unknown
    assert all(name.startswith(ENV_PREFIX) for name in CONFIG["data"])
    assert settings.database_url and settings.database_url.startswith("postgresql://")
    assert auth_enabled(settings)  # a non-loopback listen address
    assert settings.log_format == "json"


def test_tokens_file_setting_points_at_the_mounted_secret_and_parses():
    tokens_file = manifest_settings().tokens_file
    assert tokens_file is not None
    mount = next(m for m in CONTAINER["volumeMounts"] if m["name"] == "tokens")
    volume = next(v for v in POD["spec"]["volumes"] if v["name"] == "tokens")
    assert volume["secret"]["secretName"] == SECRET["metadata"]["name"]
    items = {i["path"]: i["key"] for i in volume["secret"]["items"]}
    assert tokens_file.parent == Path(mount["mountPath"])
    grants = parse_token_file(secret_value(items[tokens_file.name]))
    assert grants  # the placeholder: a well-formed entry whose digest matches no token


def test_pod_runs_as_the_images_non_root_user_with_a_read_only_root():
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile)[1])  # type: ignore[index]
    gid = int(re.search(r"groupadd .*--gid (\d+)", dockerfile)[1])  # type: ignore[index]
    security = POD["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid)
    container = CONTAINER["securityContext"]
    assert container["readOnlyRootFilesystem"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"]["drop"] == ["ALL"]
    # With a database URL the server writes nothing but to /tmp (an emptyDir).
    assert {m["mountPath"] for m in CONTAINER["volumeMounts"] if not m.get("readOnly")} == {"/tmp"}
