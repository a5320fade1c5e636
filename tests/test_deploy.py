"""The deployment files are checked against the Kubernetes schema and against cachesvc's own config schema.

No container engine or cluster runs here, so what can be checked without one
is: every Kubernetes object the kustomization lists validates (strict) against
the Kubernetes JSON schema; every config file, flag and `CACHESVC_*` variable
the manifests and the compose file give a server loads and validates as that
server would read it; probes ask the ports and gRPC services the servers
serve; and the image runs as an unprivileged user with runtime dependencies
only.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cachesvc.commands.cachesvc import META_FLAGS, SERVE_FLAGS, _overrides, build_parser
from cachesvc.config import MetaNodeConfig, ServerConfig, env_names, load_config, load_meta_node_config
from cachesvc.meta.service import SERVICE_NAME as META_SERVICE
from cachesvc.server.server import SERVICE_NAME as CACHE_SERVICE

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.33.0"


def k8s_objects() -> list[dict[str, Any]]:
    """Every object of the kustomization's resources, in order (what `kubectl apply -k` would send)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    labels = {k: v for entry in kustomization.get("labels", []) for k, v in entry["pairs"].items()}
    objects = []
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / resource).read_text()):
            if doc:
                doc.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
                objects.append(doc)
    return objects


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in k8s_objects() if o["kind"] == kind}


def check_environment(names: list[str], schema: type[Any]) -> None:
    known = env_names(schema)
    for name in names:
        if name.startswith("CACHESVC_"):
            assert name in known, f"{name} is not a {schema.__name__} variable"


def load_server(argv: list[str], env: dict[str, str], files: dict[str, Path]) -> ServerConfig | MetaNodeConfig:
    """The config `cachesvc ARGV` would run with, given `env` and the image's files mapped to the repository's."""
    args = build_parser().parse_args(argv)
    config = files.get(args.config, Path(args.config)) if args.config else None
    if args.command == "serve":
        return load_config(config, env=env, overrides=_overrides(args, SERVE_FLAGS))
    assert args.command == "meta", argv
    return load_meta_node_config(config, env=env, overrides=_overrides(args, META_FLAGS))


def test_every_kubernetes_object_validates_against_the_schema() -> None:
    objects = k8s_objects()
    assert {o["kind"] for o in objects} >= {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget"}
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked below
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    (monitor,) = by_kind("ServiceMonitor").values()
    wanted = set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])
    services = by_kind("Service").values()
    assert wanted == {s["metadata"]["labels"]["app.kubernetes.io/name"] for s in services}
    for service in services:
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def test_statefulsets_run_valid_configs_with_probes_on_the_served_services(tmp_path: Path) -> None:
    (config_map,) = by_kind("ConfigMap").values()
    files = {}
    for name, text in config_map["data"].items():
        files[f"/etc/cachesvc/{name}"] = tmp_path / name
        (tmp_path / name).write_text(text)
    served = {"cachesvc-cache": (CACHE_SERVICE, ServerConfig), "cachesvc-meta": (META_SERVICE, MetaNodeConfig)}
    statefulsets = by_kind("StatefulSet")
    assert set(statefulsets) == set(served)
    services = by_kind("Service")
    for name, statefulset in statefulsets.items():
        service_name, schema = served[name]
        spec = statefulset["spec"]
        assert spec["serviceName"] in services and services[spec["serviceName"]]["spec"]["clusterIP"] == "None"
        pod = spec["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        # The process the container runs: args, or the `exec cachesvc ...` of a shell command.
        if container.get("command"):
            script = container["command"][-1]
            argv = shlex.split(re.sub(r"\$\(\(.*?\)\)", "1", script.split("exec cachesvc", 1)[1]))
        else:
            argv = list(container["args"])
        env = {e["name"]: e.get("value", "x") for e in container["env"]}
        check_environment(list(env), schema)
        env["CACHESVC_META_NODE_SECURITY_PEER_TOKEN"] = "y"  # a different secret from the token
        config = load_server(argv, {k: v for k, v in env.items() if k.startswith("CACHESVC_")}, files)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        listen = config.listen.rpartition(":")[2]
        assert int(listen) == ports["grpc"] and int(config.metrics_listen.rpartition(":")[2]) == ports["metrics"]
        assert container["readinessProbe"]["grpc"] == {"port": ports["grpc"], "service": service_name}
        assert container["livenessProbe"]["grpc"] == {"port": ports["grpc"]}  # "": alive, even while draining
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/var/lib/cachesvc" in mounts and "/etc/cachesvc" in mounts
        if isinstance(config, MetaNodeConfig):
            assert len(config.node_config().peers) == spec["replicas"]
            assert config.data_dir.startswith("/var/lib/cachesvc/")
        else:
            assert config.l2.path.startswith("/var/lib/cachesvc/") and config.meta.addresses
    budgets = by_kind("PodDisruptionBudget")
    assert {b["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] for b in budgets.values()} == set(served)


def test_compose_services_run_valid_configs() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    files = {"/etc/cachesvc/cachesvc.toml": DEPLOY / "cachesvc.toml", "/etc/cachesvc/meta.toml": DEPLOY / "meta.toml"}
    ours = {name: s for name, s in compose["services"].items() if s.get("image") == "cachesvc:latest"}
    assert sorted(ours) == ["cache1", "cache2", "cache3", "meta1", "meta2", "meta3"]
    secrets = {"CACHESVC_META_NODE_SECURITY_PEER_TOKEN": "peer-secret"}
    for name, service in ours.items():
        schema = MetaNodeConfig if name.startswith("meta") else ServerConfig
        check_environment(list(service["environment"]), schema)
        env = {k: secrets.get(k, "secret") for k in service["environment"]}
        config = load_server([str(a) for a in service["command"]], env, files)
        assert config.metrics_listen and config.security.token == "secret"
        if isinstance(config, ServerConfig):
            assert config.security.tls_cert and config.meta.addresses and config.s3.bucket
            assert set(config.meta.addresses.split(",")) == {f"meta{i}:7080" for i in (1, 2, 3)}
        else:
            assert config.node_config().peers == {1: "meta1:7080", 2: "meta2:7080", 3: "meta3:7080"}
            assert config.id == int(name[-1])


def test_the_image_runs_unprivileged_with_runtime_dependencies_only() -> None:
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    dockerfile = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    users = re.findall(r"^USER (\S+)", dockerfile, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    installs = re.findall(r"pip install .*", dockerfile)
    assert installs and not [line for line in installs if "[" in line or "torch" in line]  # no extras
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, re.MULTILINE):
        for path in source.split():
            assert (DEPLOY.parent / path).exists(), f"COPY {path}: no such file in the repository"


@pytest.mark.parametrize("name", ["cachesvc.toml", "meta.toml"])
def test_the_image_config_files_load(name: str) -> None:
    if name == "cachesvc.toml":
        load_config(DEPLOY / name, env={})
    else:
        load_meta_node_config(DEPLOY / name, env={})
