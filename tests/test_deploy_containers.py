"""The container deployment, built and run: deploy/Dockerfile's image and deploy/docker-compose.yml under podman.

tests/test_deploy.py checks the deployment files statically; this test builds
and runs them. With no container registry and no package index inside a build,
everything is made here: a Debian base image with python3 (debootstrap, then
`podman import`; deploy/local/base-image.sh, once), a wheelhouse of cachesvc's
dependencies (`pip wheel` on the host into deploy/wheelhouse/), the cachesvc
image from deploy/Dockerfile on that base, and an S3 stand-in image holding
SeaweedFS's `weed` (deploy/local/s3.Dockerfile). The compose file then runs
with deploy/local/docker-compose.local.yml over it (SeaweedFS in MinIO's
place; the cache servers' TLS and tokens as the file has them; every port
published on 127.0.0.1), and from the host, through the published ports only:
`cachesvc demo` reads a dataset cold and warm through the cluster, `cachectl
status` sees the shard and three cache nodes up, each `/metrics` answers the
token (and refuses a scrape without it), and after `podman kill` of one cache
container every key still reads. Everything is torn down at the end, always.

Slow (minutes): `make deploy-test` runs it, `make test` does not. Skipped only
where podman is absent; building the base image needs debootstrap and root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachesvc.devcluster.procs import free_port, weed_binary

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
LOCAL = DEPLOY / "local"
PODMAN = shutil.which("podman")
BASE_IMAGE = "localhost/cachesvc-base:bookworm"
IMAGE = "localhost/cachesvc:latest"  # what deploy/docker-compose.yml runs (`cachesvc:latest`)
S3_IMAGE = "localhost/cachesvc-s3:local"
BUCKET = "training"  # deploy/docker-compose.yml's
SERVICES = ["minio", "minio-bucket", "meta1", "meta2", "meta3", "cache-net", "cache1", "cache2", "cache3"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(PODMAN is None, reason="podman is not installed (apt-get install podman runc)"),
]

# `cachesvc demo` with the client the compose file asks for: its token and CA (the demo itself takes neither).
DEMO = """
import sys
from cacheclient import CacheClient
from cachesvc.commands import cachesvc, demo

token, ca = sys.argv[1], sys.argv[2]

def client(self, timeout):
    return CacheClient(meta=self.meta, timeout=timeout, token=token, tls_ca=ca)

if __name__ == "__main__":  # not again in the DataLoader's forkserver
    demo.Cluster.client = client
    sys.exit(cachesvc.main(["demo", *sys.argv[3:]]))
"""


class Timings:
    """Seconds per step, printed at the end (the README quotes a run of them)."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.steps[name] = round(time.monotonic() - began, 1)
            print(f"deploy-test: {name} {self.steps[name]:.1f}s", flush=True)


def run(argv: list[str], env: dict[str, str], timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def podman_env() -> dict[str, str]:
    env = dict(os.environ)
    if "CONTAINERS_CONF" not in env and shutil.which("runc"):
        # runc and explicit ulimits: crun, and the host's ulimits passed through, fail on hybrid cgroups.
        env["CONTAINERS_CONF"] = str(LOCAL / "containers.conf")
    return env


def podman_compose() -> list[str]:
    try:
        import podman_compose  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        found = shutil.which("podman-compose")
        if found is None:
            pytest.fail("podman-compose is not installed: pip install podman-compose (`make deploy-test` does)")
        return [found]
    return [sys.executable, "-m", "podman_compose"]


def build_images(env: dict[str, str], timings: Timings) -> None:
    if run([str(PODMAN), "image", "exists", BASE_IMAGE], env, 60, check=False).returncode != 0:
        with timings.step("base image (debootstrap + import)"):
            run([str(LOCAL / "base-image.sh"), BASE_IMAGE], env, 900)
    with timings.step("wheelhouse (pip wheel on the host)"):
        wheelhouse = DEPLOY / "wheelhouse"
        run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheelhouse), str(ROOT),
             "setuptools>=77"], env, 600)  # fmt: skip
        for ours in wheelhouse.glob("cachesvc-*.whl"):
            ours.unlink()  # the image builds cachesvc from the source it copies
    with timings.step("image build (deploy/Dockerfile)"):
        run([str(PODMAN), "build", "--file", str(DEPLOY / "Dockerfile"), "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
             "--build-arg", "PIP_NO_INDEX=1", "--tag", IMAGE, str(ROOT)], env, 900)  # fmt: skip
    with timings.step("S3 stand-in image build"), tempfile.TemporaryDirectory(prefix="cachesvc-s3-image-") as context:
        shutil.copy(weed_binary(), Path(context) / "weed")
        run([str(PODMAN), "build", "--file", str(LOCAL / "s3.Dockerfile"), "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
             "--tag", S3_IMAGE, context], env, 600)  # fmt: skip


def cachectl(env: dict[str, str], meta: str, ca: Path, *args: str, timeout: float = 60) -> Any:
    argv = [str(Path(sys.executable).parent / "cachectl"), "--meta", meta, "--tls-ca", str(ca), *args]
    return run(argv, env, timeout, check=False)


def cluster_status(env: dict[str, str], meta: str, ca: Path) -> dict[str, Any] | None:
    done = cachectl(env, meta, ca, "status", "--json")
    try:
        status: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        return None
    return status


def node_states(status: dict[str, Any] | None) -> dict[str, str]:
    return {n["address"]: n["state"] for n in (status or {}).get("nodes", [])}


def scrape(port: int, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def counter(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} "))


def reads_on(port: int, token: str) -> float:
    """Keys a cache server was asked to read: found (in a tier, object storage included) or missed."""
    text = scrape(port, token)[1]
    return counter(text, "cachesvc_gets_total") + counter(text, "cachesvc_misses_total")


def test_the_compose_stack_builds_runs_the_demo_and_survives_a_killed_cache_container(tmp_path: Path) -> None:
    from cacheclient import CacheClient

    env = podman_env()
    compose_cmd = podman_compose()
    timings = Timings()
    build_images(env, timings)

    certs = tmp_path / "certs"
    run(["sh", str(DEPLOY / "gen-certs.sh"), str(certs)], env, 60)
    certs.chmod(0o755)  # read by the containers' unprivileged user
    ca = certs / "ca.crt"
    ports = {name: free_port() for name in ("meta", "meta_metrics", "s3", *(f"cache{i}" for i in (1, 2, 3)))}
    ports.update({f"cache{i}_metrics": free_port() for i in (1, 2, 3)})
    token, s3_user, s3_password = "deploy-test-token", "deploy-test-root", "deploy-test-secret"
    env.update(
        CACHESVC_TOKEN=token,
        CACHECTL_TOKEN=token,
        CACHESVC_PEER_TOKEN="deploy-test-peer-secret",
        MINIO_ROOT_USER=s3_user,
        MINIO_ROOT_PASSWORD=s3_password,
        CACHESVC_META_PORT=str(ports["meta"]),
        CACHESVC_LOCAL_META_METRICS_PORT=str(ports["meta_metrics"]),
        CACHESVC_LOCAL_S3_PORT=str(ports["s3"]),
        CACHESVC_LOCAL_CERTS=str(certs),
    )
    for i in (1, 2, 3):
        env[f"CACHESVC_LOCAL_CACHE{i}_PORT"] = str(ports[f"cache{i}"])
        env[f"CACHESVC_LOCAL_CACHE{i}_METRICS_PORT"] = str(ports[f"cache{i}_metrics"])
    project = f"cachesvc-deploy-test-{os.getpid()}"
    compose = [*compose_cmd, "--project-name", project, "--file", str(DEPLOY / "docker-compose.yml"),
               "--file", str(LOCAL / "docker-compose.local.yml")]  # fmt: skip
    meta = f"127.0.0.1:{ports['meta']}"
    caches = [f"127.0.0.1:{ports[f'cache{i}']}" for i in (1, 2, 3)]
    killed = caches[1]
    try:
        with timings.step("up (podman-compose up -d)"):
            run([*compose, "up", "--detach", "--no-build"], env, 600)
        with timings.step("ready (cachectl status: 3 nodes up)"):
            deadline = time.monotonic() + 180
            while node_states(status := cluster_status(env, meta, ca)) != dict.fromkeys(caches, "up"):
                assert time.monotonic() < deadline, f"the cluster did not come up: {status}"
                time.sleep(2)

        state = tmp_path / "state"
        state.mkdir()
        # What `cachesvc up` writes for `cachesvc demo`, naming the published ports.
        s3_endpoint = f"http://127.0.0.1:{ports['s3']}"
        cluster = {"cache": caches, "meta": [meta], "s3_endpoint": s3_endpoint, "bucket": BUCKET}
        cluster.update(access_key=s3_user, secret_key=s3_password)
        (state / "cluster.json").write_text(json.dumps(cluster))
        with timings.step("demo (cachesvc demo, 600 x 64 KiB)"):
            demo = run([sys.executable, "-c", DEMO, token, str(ca), "--state-dir", str(state), "--samples", "600"],
                       env, 600)  # fmt: skip
        print(demo.stdout, flush=True)
        assert "cachesvc, warm epoch" in demo.stdout and f"using the cluster in {state}" in demo.stdout

        status = cluster_status(env, meta, ca)
        assert status is not None and node_states(status) == dict.fromkeys(caches, "up"), status
        text = cachectl(env, meta, ca, "status").stdout
        assert "3 cache nodes: 3 up" in text and f"bucket {BUCKET}: reachable from 3 of 3 nodes" in text, text

        for name in ("meta_metrics", "cache1_metrics", "cache2_metrics", "cache3_metrics"):
            assert scrape(ports[name], None)[0] == 401, f"{name}: /metrics without the token"
            code, text = scrape(ports[name], token)
            assert code == 200 and "cachesvc_" in text, name
        served = [counter(scrape(ports[f"cache{i}_metrics"], token)[1], "cachesvc_gets_total") for i in (1, 2, 3)]
        assert all(n > 0 for n in served), f"every node served the demo's reads: {served}"

        client = CacheClient(meta=meta, token=token, tls_ca=str(ca), timeout=30.0)
        try:
            values = {f"deploy-test/{i:03d}": os.urandom(4096) for i in range(60)}
            client.put_many(list(values.items()))
            before = counter(scrape(ports["cache2_metrics"], token)[1], "cachesvc_gets_total")
            assert client.get_many(list(values)) == list(values.values())
            after = counter(scrape(ports["cache2_metrics"], token)[1], "cachesvc_gets_total")
            assert after > before, "cache2 owns some of the keys"
            before_kill = reads_on(ports["cache1_metrics"], token) + reads_on(ports["cache3_metrics"], token)
            with timings.step("kill cache2, every key read again"):
                run([str(PODMAN), "kill", f"{project}_cache2_1"], env, 60)
                assert client.get_many(list(values)) == list(values.values())
            survivors = reads_on(ports["cache1_metrics"], token) + reads_on(ports["cache3_metrics"], token)
            assert survivors - before_kill >= len(values), "cache1 and cache3 served every key, cache2's too"
            with timings.step("cachectl status shows cache2 down"):
                deadline = time.monotonic() + 60
                while node_states(status := cluster_status(env, meta, ca)).get(killed) == "up":
                    assert time.monotonic() < deadline, f"{killed} still up after its container was killed: {status}"
                    time.sleep(1)
            print(f"deploy-test: after the kill: {node_states(status)}", flush=True)
            assert client.get_many(list(values)) == list(values.values())
            for key in values:
                client.delete(key)
        finally:
            client.close()
    except BaseException:
        for service in SERVICES:
            logs = run([str(PODMAN), "logs", "--tail", "25", f"{project}_{service}_1"], env, 60, check=False)
            print(f"--- {service}\n{logs.stdout}{logs.stderr}", flush=True)
        raise
    finally:
        with timings.step("teardown (podman-compose down -v)"):
            run([*compose, "down", "--volumes"], env, 300, check=False)
        left = run([str(PODMAN), "ps", "--all", "--quiet", "--filter", f"name={project}"], env, 60, check=False)
        print(f"deploy-test: timings {json.dumps(timings.steps)}", flush=True)
        assert not left.stdout.strip(), f"containers left behind: {left.stdout}"
