"""The Kubernetes manifests in deploy/k8s agree with the API, with each other and with the server.

No cluster is needed: every resource is checked against the Kubernetes API's
own schemas (``kubernetes-validate``, strict: an unknown or misspelt field
fails), the database's CloudNativePG ``Cluster`` against the operator's own CRD
schema (vendored in tests/unit/data, made strict the same way; its CEL rules,
``x-kubernetes-validations``, are not evaluated: the ones that matter here are
asserted directly), and then the parts that must agree are compared: the
probes, the container ports, the Services and the listen addresses in the
settings; the pods' labels and every selector; the termination grace period and
the drain; the database URL, resolved as the kubelet would from the Secret the
operator makes, its TLS and the connections it needs; the settings themselves,
built into the server's own ``Settings`` class, and the token file, parsed by
the server's own parser.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import re
import shutil
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from leasekeeper_server.observability.health import LIVENESS
from leasekeeper_server.rpc.service import SERVICE_NAME
from leasekeeper_server.security.mode import auth_enabled
from leasekeeper_server.security.tokens import parse_token_file
from leasekeeper_server.settings import Settings, database_url_problem

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
# The oldest Kubernetes the manifests are written for (gRPC probes are GA since
# 1.27, unhealthyPodEvictionPolicy since 1.31 GA, beta and on by default before),
# and the newest the schema package knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
ENV_PREFIX = "LEASEKEEPER_"
# CloudNativePG's Cluster CRD, as released (its header names the source and the release).
CNPG_CRD = ROOT / "tests" / "unit" / "data" / "cnpg-v1.30.0-clusters-crd.yaml"
CNPG_API_VERSION = "postgresql.cnpg.io/v1"
# The password in the stand-in of the Secret CloudNativePG makes (never a real one).
STAND_IN_PASSWORD = "stand-in-password"


def load_resources() -> list[dict[str, Any]]:
    """Every resource the kustomization lists, in its order."""
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    resources = []
    for name in kustomization["resources"]:
        resources.extend(d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d)
    return resources


RESOURCES = load_resources()
# The resources of the Kubernetes API itself; the operator's Cluster is checked apart.
CORE_RESOURCES = [r for r in RESOURCES if r["apiVersion"] != CNPG_API_VERSION]


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
CLUSTER = one("Cluster")
NAMESPACE = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())["namespace"]


def container_port(name: str) -> int:
    return next(p["containerPort"] for p in CONTAINER["ports"] if p["name"] == name)


def listen_port(variable: str) -> int:
    return int(CONFIG["data"][variable].rpartition(":")[2])


def secret_value(key: str) -> str:
    return SECRET["stringData"][key]


def cnpg_app_secret() -> dict[str, str]:
    """The Secret CloudNativePG makes for the Cluster's owner role, but for its password.

    As the operator's ``pkg/specs/secrets.go`` (CreateSecret) builds it: the host is
    the primary's read-write Service (``<cluster>-rw``), ``uri`` names it with the
    namespace, on port 5432.
    """
    initdb = CLUSTER["spec"]["bootstrap"]["initdb"]
    user, database = initdb["owner"], initdb["database"]
    host = f"{CLUSTER['metadata']['name']}-rw"
    return {
        "username": user,
        "password": STAND_IN_PASSWORD,
        "dbname": database,
        "host": host,
        "port": "5432",
        "uri": f"postgresql://{user}:{STAND_IN_PASSWORD}@{host}.{NAMESPACE}:5432/{database}",
    }


def secret_data(name: str) -> dict[str, str]:
    """A Secret the pods read: the manifests' own, or the one the operator makes."""
    if name == SECRET["metadata"]["name"]:
        return dict(SECRET["stringData"])
    if name == f"{CLUSTER['metadata']['name']}-app":
        return cnpg_app_secret()
    raise AssertionError(f"the pods read Secret {name}, which nothing here makes")


def container_env() -> dict[str, str]:
    """The container's variables as the kubelet sets them.

    envFrom first, then env in order: a secretKeyRef is read, and ``$(NAME)`` is
    replaced by a variable defined before it (``$$`` stands for ``$``). A reference
    to a variable not defined before is an error here; Kubernetes would pass it on
    as it is, silently.
    """
    env = dict(CONFIG["data"])
    for variable in CONTAINER["env"]:
        name = variable["name"]
        if "valueFrom" in variable:
            ref = variable["valueFrom"]["secretKeyRef"]
            env[name] = secret_data(ref["name"])[ref["key"]]
            continue

        def expand(match: re.Match[str], name: str = name) -> str:
            if match[0] == "$$":
                return "$"
            assert match[1] in env, f"{name} refers to $({match[1]}), not defined before it"
            return env[match[1]]

        env[name] = re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", expand, variable["value"])
    return env


def mount_path(volume: str) -> Path:
    return Path(next(m["mountPath"] for m in CONTAINER["volumeMounts"] if m["name"] == volume))


@functools.cache
def stand_in_db_ca() -> Path:
    """A folder with a CA certificate (``ca.crt``), standing in for the mounted db-ca Secret.

    asyncpg reads ``sslrootcert`` as it parses a verify-full URL, so the settings
    need a real certificate where the pod has the operator's.
    """
    folder = Path(tempfile.mkdtemp(prefix="leasekeeper-db-ca-"))
    atexit.register(shutil.rmtree, folder, True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stand-in database CA")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (folder / "ca.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return folder


def manifest_settings() -> Settings:
    """The server's settings as the pods get them: the ConfigMap, the env, the operator's URL.

    The database's CA, mounted in the pod, is read from a stand-in (stand_in_db_ca).
    """
    env = {k: v for k, v in container_env().items() if k.startswith(ENV_PREFIX)}
    pod_ca = f"sslrootcert={mount_path('db-ca')}/"
    env["LEASEKEEPER_DATABASE_URL"] = env["LEASEKEEPER_DATABASE_URL"].replace(
        pod_ca, f"sslrootcert={stand_in_db_ca()}/"
    )
    values = {name.removeprefix(ENV_PREFIX).lower(): value for name, value in env.items()}
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


def strict_schema(schema: Any) -> Any:
    """An OpenAPI schema of a CRD that refuses unknown fields, as the API server prunes them.

    Every object schema that lists its properties, and neither declares
    ``additionalProperties`` nor preserves unknown fields, gets
    ``additionalProperties: false``: a misspelt field fails instead of vanishing.
    """
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: strict_schema(value) for key, value in schema.items()}
    if (
        strict.get("type") == "object"
        and isinstance(strict.get("properties"), dict)
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


@functools.cache
def cnpg_crd() -> dict[str, Any]:
    """The vendored CRD, after checking it is the released file its header names."""
    text = CNPG_CRD.read_text()
    header, marker, rest = text.partition("\n---\n")
    upstream = "---\n" + rest
    named = re.search(r"sha256 of the upstream file: ([0-9a-f]{64})", header)
    assert marker and named, f"{CNPG_CRD.name}: no header naming the upstream file's sha256"
    assert hashlib.sha256(upstream.encode()).hexdigest() == named[1], f"{CNPG_CRD.name} changed"
    crd: dict[str, Any] = yaml.safe_load(upstream)
    return crd


def cnpg_cluster_errors(cluster: dict[str, Any]) -> list[str]:
    """What the operator's CRD schema (strict) finds wrong with ``cluster``: one line each."""
    crd = cnpg_crd()
    group, version = cluster["apiVersion"].split("/")
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, cluster["kind"])
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    assert served["served"] and served["storage"]
    # OpenAPI 3.0's schema object is JSON Schema draft 4 with extensions (x-kubernetes-*,
    # ignored here as unknown keywords).
    validator = jsonschema.Draft4Validator(strict_schema(served["schema"]["openAPIV3Schema"]))
    return [
        f"at {'/'.join(str(part) for part in error.absolute_path)}: {error.message}"
        for error in validator.iter_errors(cluster)
    ]


def test_kustomization_lists_every_manifest_in_the_folder():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(on_disk)
    assert kustomization["namespace"] == one("Namespace")["metadata"]["name"]
    assert [i["name"] for i in kustomization["images"]] == [CONTAINER["image"]]


def test_manifests_have_every_kind_once_and_two_services():
    kinds = sorted(r["kind"] for r in RESOURCES)
    expected = ["Cluster", "ConfigMap", "Deployment", "Namespace", "PodDisruptionBudget", "Secret"]
    assert kinds == sorted([*expected, "Service", "Service"])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "resource",
    CORE_RESOURCES,
    ids=[f"{r['kind']}-{r['metadata']['name']}" for r in CORE_RESOURCES],
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


def test_database_cluster_valid_against_the_operators_schema():
    problems = cnpg_cluster_errors(CLUSTER)
    assert not problems, problems


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda spec: spec["postgresql"]["synchronous"].update(numbr=1), "'numbr' was unexpected"),
        (lambda spec: spec.update(instance=3), "'instance' was unexpected"),
        (lambda spec: spec["postgresql"]["synchronous"].update(method="all"), "'all' is not one"),
        (lambda spec: spec.update(instances="3"), "'3' is not of type 'integer'"),
    ],
    ids=["misspelt-nested-field", "misspelt-field", "unknown-enum-value", "wrong-type"],
)
def test_operators_schema_refuses_what_the_api_server_would(change, expected):
    # The check above can fail: a copy of the Cluster, spoilt one way, is refused.
    spoilt = yaml.safe_load(yaml.safe_dump(CLUSTER))
    change(spoilt["spec"])
    problems = cnpg_cluster_errors(spoilt)
    assert any(expected in problem for problem in problems), problems


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_database_cluster_metadata_is_object_meta(version):
    # The CRD leaves metadata to the API server, which checks it as every object's
    # ObjectMeta: checked here as a ConfigMap's.
    stand_in = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": CLUSTER["metadata"]}
    kubernetes_validate.validate(stand_in, version, strict=True)


def test_database_commits_wait_for_a_standby_and_failover_loses_none():
    spec = CLUSTER["spec"]
    synchronous = spec["postgresql"]["synchronous"]
    assert spec["instances"] == 3
    # ANY 1 of the two standbys: one may be lost or restarted and commits go on.
    assert synchronous["method"] == "any"
    assert 1 <= synchronous["number"] <= spec["instances"] - 2
    # "preferred" would go on unreplicated with no standby; the CRD's default is
    # "required", set here so that a change of default cannot reach us silently.
    assert synchronous["dataDurability"] == "required"
    # Promote only a standby known to hold every acknowledged commit.
    assert synchronous["failoverQuorum"] is True
    # The deprecated settings of the same thing are not mixed in.
    assert "minSyncReplicas" not in spec and "maxSyncReplicas" not in spec
    parameters = spec["postgresql"].get("parameters", {})
    assert parameters.get("synchronous_commit", "on") in ("on", "remote_apply")


def test_database_url_is_the_operators_app_secret_over_verified_tls():
    name = CLUSTER["metadata"]["name"]
    refs = [v["valueFrom"]["secretKeyRef"] for v in CONTAINER["env"] if "valueFrom" in v]
    assert {"name": f"{name}-app", "key": "uri"} in refs
    url = container_env()["LEASEKEEPER_DATABASE_URL"]
    parts = urlsplit(url)
    initdb = CLUSTER["spec"]["bootstrap"]["initdb"]
    # The primary's read-write Service, which the operator moves on a failover.
    assert (parts.hostname, parts.port) == (f"{name}-rw.{NAMESPACE}", 5432)
    assert (parts.username, parts.path) == (initdb["owner"], f"/{initdb['database']}")
    # TLS, the server's certificate checked against the operator's CA, mounted from
    # its <cluster>-ca Secret (the certificate alone, not the CA's key).
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    assert query["sslmode"] == "verify-full"
    ca = Path(query["sslrootcert"])
    assert ca.parent == mount_path("db-ca")
    volume = next(v for v in POD["spec"]["volumes"] if v["name"] == "db-ca")
    assert volume["secret"]["secretName"] == f"{name}-ca"
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": ca.name}]
    # asyncpg's own parser takes the URL, with a real certificate where the pod has one.
    local = url.replace(f"sslrootcert={ca.parent}/", f"sslrootcert={stand_in_db_ca()}/")
    assert database_url_problem(local) is None
    assert manifest_settings().database_url == local


def test_database_connections_cover_every_replica_and_the_surge():
    settings = manifest_settings()
    # Each replica: its pool, 5 for batched statements, 1 listening for notifications, 1
    # for the sweeper's election (docs/operations/deployment.md, "Connections").
    per_replica = settings.pool_max_size + 7
    replicas = DEPLOYMENT["spec"]["replicas"]
    surge = DEPLOYMENT["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    needed = (replicas + surge) * per_replica
    max_connections = int(CLUSTER["spec"]["postgresql"]["parameters"]["max_connections"])
    # PostgreSQL keeps superuser_reserved_connections (3) of them for the operator.
    assert max_connections - 3 >= needed + 10, (max_connections, needed)
