"""The deployment files agree with each other and with the config the image runs.

docker-compose.yml, deploy/Dockerfile, deploy/*.yml|yaml and deploy/k8s/*.yaml are parsed
(no Docker, no cluster) and cross-checked against deploy/broker.toml as broker.config parses
it: ports, image names, probe ports and service names, config mount paths, the Redis and
collector host names, the Prometheus scrape target, the non-root user, health checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import json
import os
import posixpath
import shlex
import subprocess
import sys
import tomllib
import urllib.parse
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker import native
from broker.config import BrokerConfig, config_from_dict
from broker.config.health import health_config_from_dict
from broker.config.telemetry import telemetry_config_from_dict
from broker.service.health import LIVENESS_SERVICE, HealthConfig
from broker.service.server import SERVICE_NAME
from broker.service.telemetry import TelemetryConfig
from vllm_integration.events_from_vllm.bridge import offset_endpoint

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
BROKER_TOML = DEPLOY / "broker.toml"

# ---- loading -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Deployed:
    config: BrokerConfig
    telemetry: TelemetryConfig
    health: HealthConfig

    @property
    def grpc_port(self) -> int:
        return int(self.config.listen.rsplit(":", 1)[1])

    @property
    def journal(self) -> urllib.parse.SplitResult:
        return urllib.parse.urlsplit(self.config.journal.url)

    @property
    def otlp(self) -> urllib.parse.SplitResult:
        return urllib.parse.urlsplit(self.telemetry.otlp_endpoint)


@cache
def deployed() -> Deployed:
    """deploy/broker.toml through the project's own parsers. Until config.py carries the
    [telemetry] and [health] tables, they are parsed by their modules and the rest by
    config_from_dict; once it does, the whole file goes through it and must agree."""
    data = tomllib.loads(BROKER_TOML.read_text())
    telemetry = telemetry_config_from_dict(data.get("telemetry", {}))
    health = health_config_from_dict(data.get("health", {}))
    known = {f.name for f in dataclasses.fields(BrokerConfig)}
    config = config_from_dict({k: v for k, v in data.items() if k in known or k not in ("telemetry", "health")})
    if "telemetry" in known:
        assert getattr(config, "telemetry") == telemetry  # noqa: B009
    if "health" in known:
        assert getattr(config, "health") == health  # noqa: B009
    return Deployed(config, telemetry, health)


def load_yaml(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


@cache
def compose() -> dict[str, Any]:
    (doc,) = load_yaml(COMPOSE)
    assert isinstance(doc, dict)
    return doc


@cache
def k8s_objects() -> list[dict[str, Any]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            out.extend(load_yaml(path))
    return out


def k8s(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} under deploy/k8s, found {len(found)}"
    return found[0]


def pod_containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_containers(deployment) if c["name"] == name]
    return found


@dataclasses.dataclass
class Dockerfile:
    instructions: list[tuple[str, str]]

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]

    def last(self, op: str) -> str:
        values = self.all(op)
        assert values, f"no {op} in deploy/Dockerfile"
        return values[-1]

    @property
    def entrypoint(self) -> list[str]:
        value = json.loads(self.last("ENTRYPOINT"))
        assert isinstance(value, list)
        return value

    @property
    def config_path(self) -> str:
        argv = self.entrypoint
        return argv[argv.index("--config") + 1]


@cache
def dockerfile() -> Dockerfile:
    """Instructions with continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        op, _, arg = line.partition(" ")
        instructions.append((op.upper(), arg.strip()))
    return Dockerfile(instructions)


def port_of(endpoint: str) -> int:
    """The port of HOST:PORT or a URL."""
    return int(endpoint.rsplit(":", 1)[1].split("/")[0])


def host_of(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[0].split("://")[-1]


# ---- deploy/broker.toml --------------------------------------------------------------------------


def test_broker_toml_is_a_valid_config_for_a_container() -> None:
    d = deployed()
    assert d.config.listen == "0.0.0.0:50051"  # probes and Prometheus reach the pod IP
    assert d.journal.scheme == "redis" and d.journal.hostname == "redis" and (d.journal.port or 6379) == 6379
    assert d.config.journal.ack_after == "journal"
    assert (d.telemetry.prometheus_host, d.telemetry.prometheus_port) == ("0.0.0.0", 9464)
    assert d.otlp.hostname == "otel-collector" and d.otlp.port == 4317 and d.telemetry.otlp_protocol == "grpc"
    assert d.telemetry.traces and not d.telemetry.otlp_metrics  # Prometheus scrapes; OTLP carries traces
    assert d.telemetry.log_format == "json"
    assert d.health.reflection


# ---- deploy/Dockerfile ----------------------------------------------------------------------------


def test_dockerfile_runs_kvbroker_serve_as_a_non_root_user_with_the_deployed_config() -> None:
    df, d = dockerfile(), deployed()
    assert df.all("FROM") == ["python:3.11-slim"]
    assert df.entrypoint == ["kvbroker", "serve", "--config", "/etc/kvbroker/broker.toml"]
    # The config the image carries is deploy/broker.toml, at the --config path.
    assert f"deploy/broker.toml {df.config_path}" in df.all("COPY")
    # Non-root: the last USER before ENTRYPOINT is a non-zero uid that the image creates.
    ops = [op for op, _ in df.instructions]
    assert ops.index("USER") < ops.index("ENTRYPOINT")
    user = df.last("USER").split(":")[0]
    assert user not in ("root", "0")
    assert any(f"--uid {user}" in run for run in df.all("RUN")), "the USER's uid is created in the image"
    # Ports: gRPC and /metrics as deploy/broker.toml sets them.
    exposed = {int(p.split("/")[0]) for arg in df.all("EXPOSE") for p in arg.split()}
    assert exposed == {d.grpc_port, d.telemetry.prometheus_port}
    # The project is installed with pip from the repository, with the OTLP extra.
    assert any("pip install '.[otlp]'" in run for run in df.all("RUN"))
    # Health check: the gRPC health probe, on the listen port, for the broker service.
    (hc,) = df.all("HEALTHCHECK")
    cmd = json.loads(hc[hc.index("CMD") + 3 :].strip())
    assert cmd[:3] == ["python", "-m", "broker.service.health_probe"]
    assert cmd[cmd.index("--addr") + 1] == f"127.0.0.1:{d.grpc_port}"
    assert cmd[cmd.index("--service") + 1] == SERVICE_NAME


def test_dockerfile_copies_exist_and_are_enough_to_build_the_package(tmp_path: Path) -> None:
    """Build the wheel from exactly what the Dockerfile copies, as `pip install .` in the image does."""
    context = tmp_path / "context"
    for arg in dockerfile().all("COPY"):
        *sources, _dest = shlex.split(arg)
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"COPY {source}: missing from the repository"
            if source.startswith("deploy/"):
                continue  # not part of the package
            target = context / source.rstrip("/")
            if path.is_dir():
                subprocess.run(["cp", "-r", str(path), str(target)], check=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
    for junk in context.rglob("__pycache__"):
        subprocess.run(["rm", "-rf", str(junk)], check=True)
    out = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(context)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out.glob("kvbroker-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
        manifest = json.loads(zf.read(native.MANIFEST)) if native.MANIFEST in names else None
        sources = {module: hashlib.sha256(zf.read(str(native.source(module, Path())))).hexdigest() for module in native.BUILT_MODULES}
    assert {
        "broker/service/health_probe.py",
        "broker/service/health.py",
        "broker/service/telemetry.py",
        "kvbroker/v1/broker_service_pb2.py",
    } <= names
    assert "kvbroker = broker.cli.main:main" in entry_points
    # The image runs the hot path compiled (setup.py), unless this run is the pure Python one.
    compiled = {n.split(".")[0].replace("/", ".") for n in names if n.endswith(".so")}
    if os.environ.get(native.PURE_ENV, "") in ("", "0"):
        assert compiled == {*native.BUILT_MODULES, native.GROUP + "__mypyc"}
        # The build record ships with them and matches the shipped sources: an installed
        # image does not report its own compiled modules as stale.
        assert manifest == {"sources": sources}
    else:
        assert compiled == set()


def test_dockerignore_sends_exactly_what_the_dockerfile_copies() -> None:
    """deploy/Dockerfile.dockerignore (BuildKit reads it for deploy/Dockerfile): everything
    out, then each COPY source back in."""
    rules = [line for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "*"
    included = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    copied = {source.rstrip("/") for arg in dockerfile().all("COPY") for source in shlex.split(arg)[:-1]}
    assert included == copied


# ---- docker-compose.yml ----------------------------------------------------------------------------


def compose_service(name: str) -> dict[str, Any]:
    services = compose()["services"]
    assert name in services, f"docker-compose.yml: no service {name!r} (has {sorted(services)})"
    service: dict[str, Any] = services[name]
    return service


def broker_service_name() -> str:
    (name,) = [n for n, s in compose()["services"].items() if isinstance(s.get("build"), dict)]
    return name


def bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of the service's bind mounts (sources relative to the repository)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            out[target] = source[2:]
    return out


def published(service: dict[str, Any]) -> dict[int, int]:
    """container port -> host port."""
    out = {}
    for mapping in service.get("ports", []):
        parts = str(mapping).split(":")
        out[int(parts[-1])] = int(parts[-2])
    return out


def test_compose_builds_the_broker_from_the_dockerfile_with_the_deployed_config() -> None:
    d, df = deployed(), dockerfile()
    broker = compose_service(broker_service_name())
    assert broker["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}
    assert (ROOT / broker["build"]["context"] / broker["build"]["dockerfile"]).resolve() == DOCKERFILE.resolve()
    # The file mounted at the ENTRYPOINT's --config path is deploy/broker.toml.
    assert bind_mounts(broker)[df.config_path] == "deploy/broker.toml"
    assert "command" not in broker and "entrypoint" not in broker  # the image's ENTRYPOINT runs
    assert published(broker) == {d.grpc_port: d.grpc_port, d.telemetry.prometheus_port: d.telemetry.prometheus_port}
    for source in bind_mounts(broker).values():
        assert (ROOT / source).exists(), source


def test_compose_health_checks_and_start_order() -> None:
    d = deployed()
    broker = compose_service(broker_service_name())
    test = broker["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "broker.service.health_probe"]
    assert test[test.index("--addr") + 1] == f"127.0.0.1:{d.grpc_port}"
    assert test[test.index("--service") + 1] == SERVICE_NAME
    redis = compose_service(d.journal.hostname or "")
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert broker["depends_on"][d.journal.hostname]["condition"] == "service_healthy"
    prometheus = compose_service("prometheus")
    assert "/-/healthy" in " ".join(prometheus["healthcheck"]["test"])
    # The collector image has no shell for a healthcheck; its health_check extension is on.
    collector_config = load_yaml(DEPLOY / "otel-collector.yaml")[0]
    assert "health_check" in collector_config["service"]["extensions"]
    assert port_of(collector_config["extensions"]["health_check"]["endpoint"]) in published(compose_service(d.otlp.hostname or ""))


def test_compose_host_names_match_the_config_urls() -> None:
    d = deployed()
    services = compose()["services"]
    # Redis: the journal URL names the Redis service, and that service runs Redis on the port.
    redis = services[d.journal.hostname]
    assert redis["image"].startswith("redis:")
    assert "--port" not in redis.get("command", []) and (d.journal.port or 6379) == 6379
    # OTLP: the endpoint names the collector service, whose OTLP gRPC receiver has that port.
    collector = services[d.otlp.hostname]
    assert "opentelemetry-collector" in collector["image"]
    config_arg = next(a for a in collector["command"] if a.startswith("--config="))
    assert bind_mounts(collector)[config_arg.split("=", 1)[1]] == "deploy/otel-collector.yaml"
    collector_config = load_yaml(DEPLOY / "otel-collector.yaml")[0]
    assert port_of(collector_config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]) == d.otlp.port


def test_prometheus_scrapes_the_broker_metrics_port_and_the_collector() -> None:
    d = deployed()
    prometheus = compose_service("prometheus")
    assert bind_mounts(prometheus)["/etc/prometheus/prometheus.yml"] == "deploy/prometheus.yml"
    (config,) = load_yaml(DEPLOY / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = [t for sc in jobs["kvbroker"]["static_configs"] for t in sc["targets"]]
    assert targets == [f"{broker_service_name()}:{d.telemetry.prometheus_port}"]
    assert jobs["kvbroker"].get("metrics_path", "/metrics") == "/metrics"
    collector_config = load_yaml(DEPLOY / "otel-collector.yaml")[0]
    exporter_port = port_of(collector_config["exporters"]["prometheus"]["endpoint"])
    assert [t for sc in jobs["otel-collector"]["static_configs"] for t in sc["targets"]] == [f"{d.otlp.hostname}:{exporter_port}"]


def test_collector_pipelines_use_only_defined_components() -> None:
    (config,) = load_yaml(DEPLOY / "otel-collector.yaml")
    for name, pipeline in config["service"]["pipelines"].items():
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section, []):
                assert component in config[section], f"pipeline {name}: {section} {component} is not defined"
    assert set(config["service"]["pipelines"]) >= {"traces"}


# ---- Kubernetes -------------------------------------------------------------------------------------

REQUIRED_SPEC = {
    "Deployment": ("selector", "template"),
    "Service": ("selector", "ports"),
    "PersistentVolumeClaim": ("accessModes", "resources"),
}


def test_k8s_objects_have_the_minimal_schema_and_kustomization_lists_them_all() -> None:
    objects = k8s_objects()
    assert objects
    for obj in objects:
        where = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
        assert {"apiVersion", "kind", "metadata"} <= set(obj), where
        assert obj["metadata"].get("name"), where
        if obj["kind"] == "ConfigMap":
            assert isinstance(obj["data"], dict) and obj["data"], where
        else:
            assert set(REQUIRED_SPEC[obj["kind"]]) <= set(obj["spec"]), where
        if obj["kind"] == "Deployment":
            assert obj["apiVersion"] == "apps/v1", where
            template_labels = obj["spec"]["template"]["metadata"]["labels"]
            assert obj["spec"]["selector"]["matchLabels"].items() <= template_labels.items(), where
            volumes = {v["name"] for v in obj["spec"]["template"]["spec"].get("volumes", [])}
            for c in pod_containers(obj):
                assert c.get("name") and c.get("image"), where
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{where}/{c['name']}: resources.{kind}"
                for mount in c.get("volumeMounts", []):
                    assert mount["name"] in volumes, f"{where}/{c['name']}: mount of unknown volume {mount['name']}"
                for probe in ("readinessProbe", "livenessProbe"):
                    assert probe in c, f"{where}/{c['name']}: no {probe}"
            for volume in obj["spec"]["template"]["spec"].get("volumes", []):
                if "configMap" in volume:
                    k8s("ConfigMap", volume["configMap"]["name"])
                if "persistentVolumeClaim" in volume:
                    k8s("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    (kustomization,) = load_yaml(K8S / "kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    image_names = {c["image"].split(":")[0] for o in objects if o["kind"] == "Deployment" for c in pod_containers(o)}
    assert {i["name"] for i in kustomization.get("images", [])} <= image_names


def test_k8s_services_select_pods_and_target_their_ports() -> None:
    deployments = [o for o in k8s_objects() if o["kind"] == "Deployment"]
    for service in (o for o in k8s_objects() if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        (target,) = [d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        ports = {p.get("name"): p["containerPort"] for c in pod_containers(target) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            target_port = port.get("targetPort", port["port"])
            resolved = ports[target_port] if isinstance(target_port, str) else target_port
            assert resolved in ports.values(), f"Service {service['metadata']['name']}: port {port} has no container port"


def test_k8s_broker_sidecar_runs_the_compose_image_with_probes_on_the_grpc_health_service() -> None:
    d, df = deployed(), dockerfile()
    pod = k8s("Deployment", "inference")
    spec = pod["spec"]["template"]["spec"]
    broker = container(pod, "kvbroker")
    names = {c["name"] for c in pod_containers(pod)}
    assert {"vllm", "kvbroker"} <= names
    if broker in spec.get("initContainers", []):
        assert broker["restartPolicy"] == "Always"  # a native sidecar, not a one-shot init container
    # The image docker compose builds.
    assert broker["image"] == compose_service(broker_service_name())["image"]
    assert "command" not in broker  # the image's ENTRYPOINT (serve --config ...) runs
    # Ports as deploy/broker.toml sets them.
    ports = {p["name"]: p["containerPort"] for p in broker["ports"]}
    assert ports == {"grpc": d.grpc_port, "metrics": d.telemetry.prometheus_port}
    # Native gRPC probes: readiness on the broker service, liveness/startup on "liveness".
    assert broker["readinessProbe"]["grpc"] == {"port": d.grpc_port, "service": SERVICE_NAME}
    assert broker["livenessProbe"]["grpc"] == {"port": d.grpc_port, "service": LIVENESS_SERVICE}
    assert broker["startupProbe"]["grpc"] == {"port": d.grpc_port, "service": LIVENESS_SERVICE}
    # Limits, and the image's non-root uid.
    assert broker["resources"]["limits"]["memory"] and broker["resources"]["limits"]["cpu"]
    assert broker["securityContext"]["runAsNonRoot"] is True
    assert str(broker["securityContext"]["runAsUser"]) == df.last("USER").split(":")[0]
    # Prometheus annotations point at the metrics port.
    annotations = pod["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(d.telemetry.prometheus_port)
    assert annotations["prometheus.io/scrape"] == "true"


def test_k8s_config_map_is_mounted_as_a_directory_at_the_config_path_and_holds_broker_toml() -> None:
    df = dockerfile()
    pod = k8s("Deployment", "inference")
    broker = container(pod, "kvbroker")
    config_dir, config_file = posixpath.split(df.config_path)
    (mount,) = [m for m in broker["volumeMounts"] if m["mountPath"] == config_dir]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates: mount the directory"
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = k8s("ConfigMap", volume["configMap"]["name"])
    assert "items" not in volume["configMap"] or config_file in {i["path"] for i in volume["configMap"]["items"]}
    assert config_map["data"][config_file] == BROKER_TOML.read_text()
    # Writable directories under a read-only root file system.
    if broker["securityContext"].get("readOnlyRootFilesystem"):
        mounted = {m["mountPath"] for m in broker["volumeMounts"]}
        assert {df.last("WORKDIR"), "/tmp"} <= mounted


def test_k8s_journal_override_names_the_redis_service_and_a_stream_per_pod() -> None:
    d = deployed()
    broker = container(k8s("Deployment", "inference"), "kvbroker")
    args = broker.get("args", [])
    url = urllib.parse.urlsplit(args[args.index("--journal") + 1]) if "--journal" in args else d.journal
    assert url.hostname == d.journal.hostname and url.port == d.journal.port
    if "$(POD_NAME)" in url.query:
        env = {e["name"]: e for e in broker["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # The Redis Service has the URL's host name and port, and a Redis pod behind it.
    service = k8s("Service", url.hostname or "")
    assert [p["port"] for p in service["spec"]["ports"]] == [url.port or 6379]
    redis_pod = k8s("Deployment", url.hostname or "")
    redis = container(redis_pod, "redis")
    assert redis["image"] == compose_service(d.journal.hostname or "")["image"]
    assert [p["containerPort"] for p in redis["ports"]] == [url.port or 6379]
    assert "exec" in redis["readinessProbe"] and "redis-cli" in redis["readinessProbe"]["exec"]["command"]


def test_k8s_collector_runs_deploy_otel_collector_yaml_behind_the_otlp_host_name() -> None:
    d = deployed()
    host = d.otlp.hostname or ""
    service = k8s("Service", host)
    assert d.otlp.port in [p["port"] for p in service["spec"]["ports"]]
    pod = k8s("Deployment", host)
    collector = container(pod, host)
    assert collector["image"] == compose_service(host)["image"]
    config_arg = next(a for a in collector["args"] if a.startswith("--config="))
    config_dir, config_file = posixpath.split(config_arg.split("=", 1)[1])
    (mount,) = [m for m in collector["volumeMounts"] if m["mountPath"] == config_dir]
    (volume,) = [v for v in pod["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    inline = yaml.safe_load(k8s("ConfigMap", volume["configMap"]["name"])["data"][config_file])
    assert inline == load_yaml(DEPLOY / "otel-collector.yaml")[0]
    health_port = port_of(inline["extensions"]["health_check"]["endpoint"])
    assert collector["readinessProbe"]["httpGet"]["port"] == health_port


@pytest.mark.parametrize(
    "path", [COMPOSE, *sorted(DEPLOY.rglob("*.yaml")), *sorted(DEPLOY.rglob("*.yml"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_yaml_file_parses(path: Path) -> None:
    docs = load_yaml(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


# ---- the replay RayJob (deploy/k8s/ray) ------------------------------------------------------------

RAY = K8S / "ray"
# The fields of KubeRay's ray.io/v1 RayJob spec, RayClusterSpec, HeadGroupSpec and
# WorkerGroupSpec, as its API reference documents them: a field outside these is a typo the
# operator would reject or silently ignore.
RAYJOB_SPEC = {
    "activeDeadlineSeconds", "backoffLimit", "clusterSelector", "deletionStrategy", "entrypoint", "entrypointNumCpus",
    "entrypointNumGpus", "entrypointResources", "jobId", "managedBy", "metadata", "rayClusterSpec", "runtimeEnvYAML",
    "shutdownAfterJobFinishes", "submissionMode", "submitterConfig", "submitterPodTemplate", "suspend", "ttlSecondsAfterFinished",
}  # fmt: skip
RAYCLUSTER_SPEC = {
    "authOptions", "autoscalerOptions", "enableInTreeAutoscaling", "gcsFaultToleranceOptions", "headGroupSpec",
    "headServiceAnnotations", "managedBy", "rayVersion", "suspend", "upgradeStrategy", "workerGroupSpecs",
}  # fmt: skip
HEAD_GROUP_SPEC = {"enableIngress", "headService", "rayStartParams", "serviceType", "template"}
WORKER_GROUP_SPEC = {
    "groupName", "idleTimeoutSeconds", "maxReplicas", "minReplicas", "numOfHosts", "rayStartParams", "replicas", "scaleStrategy",
    "suspend", "template",
}  # fmt: skip
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}


@cache
def rayjob() -> dict[str, Any]:
    (doc,) = load_yaml(RAY / "replay-sweep.yaml")
    assert isinstance(doc, dict)
    return doc


def test_the_rayjob_uses_only_fields_of_kuberays_documented_spec() -> None:
    job = rayjob()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    spec = job["spec"]
    assert {"entrypoint", "rayClusterSpec"} <= set(spec) <= RAYJOB_SPEC, set(spec) - RAYJOB_SPEC
    assert spec.get("submissionMode", "K8sJobMode") in SUBMISSION_MODES
    assert isinstance(spec.get("shutdownAfterJobFinishes", False), bool)
    for key in ("ttlSecondsAfterFinished", "activeDeadlineSeconds"):
        assert key not in spec or (isinstance(spec[key], int) and spec[key] > 0), key
    cluster = spec["rayClusterSpec"]
    assert {"headGroupSpec"} <= set(cluster) <= RAYCLUSTER_SPEC, set(cluster) - RAYCLUSTER_SPEC
    head = cluster["headGroupSpec"]
    assert {"rayStartParams", "template"} <= set(head) <= HEAD_GROUP_SPEC
    groups = cluster.get("workerGroupSpecs", [])
    assert groups, "the replays run on workers"
    for group in groups:
        assert {"groupName", "rayStartParams", "template"} <= set(group) <= WORKER_GROUP_SPEC, group.get("groupName")
        assert group.get("minReplicas", 0) <= group.get("replicas", 0) <= group.get("maxReplicas", 2**31)
    for group in (head, *groups):
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), "rayStartParams values are strings"
        for c in group["template"]["spec"]["containers"]:
            assert c["name"] and c["image"], c
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{c['name']}: resources.{kind}"
    # Ray in the image is the version the cluster says it runs, and no older than the [ray] extra.
    version = tuple(int(p) for p in cluster["rayVersion"].split("."))
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    (floor,) = [r.split(">=")[1] for r in extra if r.startswith("ray")]
    assert version >= tuple(int(p) for p in floor.split("."))


def test_the_rayjob_entrypoint_is_a_valid_kvbroker_replay_over_the_fleets_journals() -> None:
    from broker.cli.main import build_parser

    argv = shlex.split(rayjob()["spec"]["entrypoint"])
    assert argv[:2] == ["kvbroker", "replay"]
    parser = build_parser()
    # Exactly its flags (argparse would also take an abbreviation).
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = set(verbs.choices["replay"]._option_string_actions)
    used = {a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")}
    assert used <= flags, f"not flags of kvbroker replay: {used - flags}"
    args = parser.parse_args(argv[1:])  # exits (fails the test) on a bad value
    assert args.ray == "auto", "--ray auto: join the Ray cluster the job runs in"
    from broker.replay.grid import parse_params
    from broker.replay.sweep import parse_capacity

    policies = [p for v in args.policy for p in v.split(",")]
    assert parse_params(args.param, policies), "the --param values are valid for their policies"
    assert all(parse_capacity(v, 1, "--hbm") > 0 for v in args.hbm.split(","))
    # The journals: the Redis Service of deploy/k8s, every stream the inference pods write.
    (journal,) = args.journal
    url = urllib.parse.urlsplit(journal)
    service = k8s("Service", url.hostname or "")
    assert [p["port"] for p in service["spec"]["ports"]] == [url.port]
    pattern = dict(urllib.parse.parse_qsl(url.query))["stream"]
    broker = container(k8s("Deployment", "inference"), "kvbroker")
    pod_stream = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(broker["args"][broker["args"].index("--journal") + 1]).query))["stream"]
    assert fnmatch.fnmatchcase(pod_stream.replace("$(POD_NAME)", "inference-7d9f-abcde"), pattern)


def test_the_rayjob_image_is_the_broker_image_with_ray() -> None:
    text = (RAY / "Dockerfile").read_text()
    broker_image = container(k8s("Deployment", "inference"), "kvbroker")["image"]
    assert f"ARG BASE={broker_image}" in text and "FROM ${BASE}" in text
    assert "pip install 'ray[default]>=2.9'" in text
    images = {
        c["image"]
        for g in (rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"], *rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"])
        for c in g["template"]["spec"]["containers"]
    }
    assert images == {f"kvbroker-ray:{broker_image.split(':')[1]}"}
    assert f"-t kvbroker-ray:{broker_image.split(':')[1]}" in text


# ---- the vLLM events bridge ------------------------------------------------------------------


def vllm_rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM 0.33's own rule (ZmqEventPublisher.offset_endpoint_port): tcp port + rank."""
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}" if rank else endpoint


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def test_k8s_vllm_bridge_reads_the_endpoints_vllm_publishes() -> None:
    # Fails on main: the pod ran no bridge, and vLLM had no replay endpoint.
    import argparse

    from clients import kvsize
    from vllm_integration.events_from_vllm import bridge_cli

    pod = k8s("Deployment", "inference")
    spec = pod["spec"]["template"]["spec"]
    vllm, bridge, broker = container(pod, "vllm"), container(pod, "vllm-bridge"), container(pod, "kvbroker")
    # A native sidecar beside the broker, started after it, from the broker's image.
    init = [c["name"] for c in spec.get("initContainers", [])]
    assert "vllm-bridge" in init and init.index("kvbroker") < init.index("vllm-bridge")
    assert bridge["restartPolicy"] == "Always" and bridge["image"] == broker["image"]
    assert bridge["command"] == ["kvbroker", "vllm-bridge"]
    parser = argparse.ArgumentParser(prog="kvbroker")
    bridge_cli.add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(["vllm-bridge", *bridge["args"]])
    # vLLM's side: its --kv-events-config, --model, --data-parallel-size.
    vargs = [str(a) for a in vllm["args"]]
    events = json.loads(flag(vargs, "--kv-events-config") or "{}")
    assert events["enable_kv_cache_events"] is True and events.get("publisher", "zmq") == "zmq"
    dp_size = int(flag(vargs, "--data-parallel-size", "1") or 1)
    assert args.dp_size == dp_size and args.dp_start_rank == 0
    assert args.topic == events.get("topic", "")
    assert args.model == flag(vargs, "--model") and kvsize.resolve_shape(args.model)
    for name, theirs, ours in (
        ("endpoint", events.get("endpoint"), args.events),
        ("replay_endpoint", events.get("replay_endpoint"), args.replay),
    ):
        # vLLM binds (and so the bridge can connect) only a wildcard, ipc or inproc endpoint.
        assert theirs and "*" in theirs, f"vLLM's {name} {theirs!r} must be a bind endpoint (tcp://*:PORT)"
        assert ours and host_of(ours) in ("127.0.0.1", "localhost"), f"the bridge reads vLLM in its own pod, not {ours!r}"
        for rank in range(dp_size):
            assert port_of(offset_endpoint(ours, rank)) == port_of(vllm_rank_endpoint(theirs, rank))
    # Every rank's events and replay ports are distinct (a replay range that starts one port
    # after the events range collides at rank 1: "Address already in use").
    ports = [port_of(vllm_rank_endpoint(e, r)) for e in (events["endpoint"], events["replay_endpoint"]) for r in range(dp_size)]
    assert len(set(ports)) == len(ports)
    declared = {p["containerPort"] for p in vllm["ports"]}
    assert {port_of(events["endpoint"]), port_of(events["replay_endpoint"])} <= declared
    # The bridge talks to this pod's broker.
    assert host_of(args.broker) in ("127.0.0.1", "localhost") and port_of(args.broker) == deployed().grpc_port
    # A pinned vLLM with these events (0.33 or later), never a floating tag.
    image, _, tag = vllm["image"].rpartition(":")
    assert image == "vllm/vllm-openai" and tag.startswith("v")
    assert tuple(int(part) for part in tag[1:].split(".")[:2]) >= (0, 33), tag
    # Its probes read the stats file the bridge writes, on a writable volume.
    stats_dir = posixpath.dirname(args.stats_file)
    assert stats_dir in {m["mountPath"] for m in bridge["volumeMounts"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert args.stats_file in " ".join(bridge[probe]["exec"]["command"]), probe
    assert args.stats_interval and all(
        args.stats_interval < int(bridge[p]["exec"]["command"][-1].rsplit(">", 1)[1].strip(" )"))
        for p in ("readinessProbe", "livenessProbe")
    )


def test_compose_leaves_the_hosts_own_redis_port_alone() -> None:
    """`docker compose up` next to a host Redis on 6379 (the one the tests use) must not
    fail on a taken port, nor take it: compose's Redis is published on 16379 instead, and
    the broker still reaches it as redis:6379 on the compose network."""
    d = deployed()
    host_ports = [host for service in compose()["services"].values() for host in published(service).values()]
    assert 6379 not in host_ports, host_ports
    assert len(host_ports) == len(set(host_ports)), host_ports
    assert published(compose_service(d.journal.hostname or "")) == {6379: 16379}
    assert "16379" in COMPOSE.read_text().split("services:")[0]  # the header says how to reach it


def test_the_readme_says_what_compose_starts_and_on_which_ports() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docker compose up" in readme
    services = compose()["services"]
    for name, service in services.items():
        assert f"`{name}`" in readme, f"README: the compose service {name} is not named"
        for host in published(service).values():
            assert str(host) in readme, f"README: the port {host} of {name} is not named"
