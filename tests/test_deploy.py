"""The deployment files are checked against the Kubernetes schema and against cachesvc's own config schema.

No container engine or cluster runs here, so what can be checked without one
is: the kustomize base and each overlay, rendered by `kubectl kustomize` (no
cluster needed), give objects that each validate (strict) against the
Kubernetes JSON schema; every config file, flag and `CACHESVC_*` variable
the manifests and the compose file give a server loads and validates as that
server would read it; probes ask the ports and gRPC services the servers
serve; and the image runs as an unprivileged user with runtime dependencies
only.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cachesvc.commands.cachesvc import META_FLAGS, SERVE_FLAGS, _overrides, build_parser
from cachesvc.config import MetaNodeConfig, ServerConfig, env_names, load_config, load_meta_node_config
from cachesvc.meta.service import SERVICE_NAME as META_SERVICE
from cachesvc.server.server import SERVICE_NAME as CACHE_SERVICE

from conftest import self_signed_cert

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.33.0"
VARIANTS = ["base", "overlays/dev", "overlays/prod"]
"""What `kubectl apply -k` is given: the base, and each overlay over it."""
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (its built-in kustomize) renders the manifests")


@functools.cache
def _rendered(variant: str) -> tuple[str, ...]:
    done = subprocess.run(
        [str(KUBECTL), "kustomize", str(K8S / variant)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"kubectl kustomize {variant}: {done.stderr}"
    return tuple(json.dumps(doc) for doc in yaml.safe_load_all(done.stdout) if doc)


def k8s_objects(variant: str) -> list[dict[str, Any]]:
    """Every object `kubectl apply -k deploy/k8s/VARIANT` would send, rendered by kubectl's kustomize."""
    return [json.loads(doc) for doc in _rendered(variant)]


def by_kind(variant: str, kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in k8s_objects(variant) if o["kind"] == kind}


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


@needs_kubectl
def test_the_overlays_are_what_their_names_say() -> None:
    base, dev, prod = (by_kind(v, "StatefulSet") for v in VARIANTS)
    assert {n: s["spec"]["replicas"] for n, s in base.items()} == {"cachesvc-cache": 3, "cachesvc-meta": 3}
    assert {n: s["spec"]["replicas"] for n, s in dev.items()} == {"cachesvc-cache": 1, "cachesvc-meta": 1}
    assert {n: s["spec"]["replicas"] for n, s in prod.items()} == {"cachesvc-cache": 3, "cachesvc-meta": 3}
    assert not by_kind("overlays/dev", "ServiceMonitor") and len(by_kind("overlays/prod", "ServiceMonitor")) == 1

    def volume(statefulsets: dict[str, Any], name: str) -> str:
        (claim,) = statefulsets[name]["spec"]["volumeClaimTemplates"]
        return str(claim["spec"]["resources"]["requests"]["storage"])

    assert [volume(s, "cachesvc-cache") for s in (dev, base, prod)] == ["2Gi", "100Gi", "1Ti"]
    assert [volume(s, "cachesvc-meta") for s in (dev, base, prod)] == ["1Gi", "10Gi", "50Gi"]
    (prod_cache,) = prod["cachesvc-cache"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in prod_cache["env"]}
    assert env["CACHESVC_SECURITY_TLS_CERT"].startswith("/etc/cachesvc-tls/")
    for variant, instance in (("overlays/dev", "cachesvc-dev"), ("overlays/prod", "cachesvc-prod")):
        assert {o["metadata"]["labels"]["app.kubernetes.io/instance"] for o in k8s_objects(variant)} == {instance}


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_kubernetes_object_validates_against_the_schema(variant: str) -> None:
    objects = k8s_objects(variant)
    assert {o["kind"] for o in objects} >= {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget"}
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "cachesvc"
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked below
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    services = by_kind(variant, "Service").values()
    for service in services:
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    for monitor in by_kind(variant, "ServiceMonitor").values():
        wanted = set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])
        assert wanted == {s["metadata"]["labels"]["app.kubernetes.io/name"] for s in services}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
            # The servers run with a token, so /metrics wants it as a bearer: the Secret key the token comes from.
            assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "cachesvc", "key": "token"}}


def _tls_probe(probe: dict[str, Any]) -> tuple[str, int, str, str]:
    """(script, port, service, CA path) of an exec probe that checks gRPC health over TLS."""
    python, flag, script, port, service, ca = probe["exec"]["command"]
    assert (python, flag) == ("python", "-c") and "ssl_channel_credentials" in script
    return script, int(port), service, ca


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_statefulsets_run_valid_configs_with_probes_on_the_served_services(variant: str, tmp_path: Path) -> None:
    (config_map,) = by_kind(variant, "ConfigMap").values()
    files = {}
    for name, text in config_map["data"].items():
        files[f"/etc/cachesvc/{name}"] = tmp_path / name
        (tmp_path / name).write_text(text)
    served = {"cachesvc-cache": (CACHE_SERVICE, ServerConfig), "cachesvc-meta": (META_SERVICE, MetaNodeConfig)}
    statefulsets = by_kind(variant, "StatefulSet")
    assert set(statefulsets) == set(served)
    services = by_kind(variant, "Service")
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
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "/var/lib/cachesvc" in mounts and "/etc/cachesvc" in mounts
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        tls = isinstance(config, ServerConfig) and bool(config.security.tls_cert)
        if tls:
            # The kubelet's gRPC probes speak plaintext: a TLS server is probed over TLS from inside the pod.
            assert isinstance(config, ServerConfig)
            for path in (config.security.tls_cert, config.security.tls_key):
                assert secrets.get(mounts.get(str(Path(path).parent), "")), f"{path} is not on a Secret volume"
            for probe, service in (("readinessProbe", service_name), ("livenessProbe", "")):
                _, port, asked, ca = _tls_probe(container[probe])
                assert (port, asked) == (ports["grpc"], service)
                assert Path(ca).parent == Path(config.security.tls_cert).parent  # ca.crt beside tls.crt
        else:
            assert container["readinessProbe"]["grpc"] == {"port": ports["grpc"], "service": service_name}
            assert container["livenessProbe"]["grpc"] == {"port": ports["grpc"]}  # "": alive, even while draining
        if isinstance(config, MetaNodeConfig):
            assert len(config.node_config().peers) == spec["replicas"]
            assert config.data_dir.startswith("/var/lib/cachesvc/")
        else:
            assert config.l2.path.startswith("/var/lib/cachesvc/") and config.meta.addresses
            metas = statefulsets["cachesvc-meta"]["spec"]["replicas"]
            assert len(config.meta.addresses.split(",")) == metas
            (claim,) = spec["volumeClaimTemplates"]
            assert config.l2.bytes < _quantity(claim["spec"]["resources"]["requests"]["storage"])
            requests = _quantity(container["resources"]["requests"]["memory"])
            assert config.l1.bytes < requests, "the memory request holds L1 and the process"
    budgets = by_kind(variant, "PodDisruptionBudget")
    assert {b["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] for b in budgets.values()} == set(served)


def _quantity(text: str) -> int:
    """A Kubernetes binary quantity ("512Mi", "1Ti") in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


@needs_kubectl
def test_the_tls_probes_pass_against_a_tls_server_and_fail_without_its_ca(cache_server: Any, tmp_path: Path) -> None:
    key, cert = self_signed_cert(tmp_path)
    server = cache_server("--l1-bytes", "16MiB", "--tls-cert", str(cert), "--tls-key", str(key))
    port = server.address.rpartition(":")[2]
    (container,) = by_kind("overlays/prod", "StatefulSet")["cachesvc-cache"]["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        script, _, service, _ = _tls_probe(container[probe])
        ok = subprocess.run([sys.executable, "-c", script, port, service, str(cert)], capture_output=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
    _, other = self_signed_cert(tmp_path, "other", common_name="other")
    script, _, service, _ = _tls_probe(container["readinessProbe"])
    refused = subprocess.run([sys.executable, "-c", script, port, service, str(other)], capture_output=True, timeout=30)
    assert refused.returncode != 0


def test_compose_services_run_valid_configs() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    files = {"/etc/cachesvc/cachesvc.toml": DEPLOY / "cachesvc.toml", "/etc/cachesvc/meta.toml": DEPLOY / "meta.toml"}
    ours = {name: s for name, s in compose["services"].items() if s.get("image") == "cachesvc:latest"}
    assert sorted(ours) == ["cache1", "cache2", "cache3", "meta1", "meta2", "meta3"]
    assert compose["services"]["minio"]["image"].startswith("minio/minio")  # L3 as the deployment has it
    secrets = {"CACHESVC_META_NODE_SECURITY_PEER_TOKEN": "peer-secret"}
    for name, service in ours.items():
        schema = MetaNodeConfig if name.startswith("meta") else ServerConfig
        check_environment(list(service["environment"]), schema)
        env = {k: secrets.get(k, "secret") for k in service["environment"]}
        config = load_server([str(a) for a in service["command"]], env, files)
        assert config.metrics_listen and config.security.token == "secret"
        if isinstance(config, ServerConfig):
            assert config.security.tls_cert and config.meta.addresses and config.s3.bucket
            assert config.s3.endpoint == "http://minio:9000" and "minio-bucket" in service["depends_on"]
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
