"""A cache server as a real process, through the real client, with a real S3 server behind it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import grpc
import lmdb
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cacheclient import AuthError, CacheClient, InvalidRequestError, LimitExceededError, UnavailableError
from cacheclient.wire import cache_pb2, object_name

from conftest import CacheServer, s3_args, self_signed_cert, start_seaweed


def test_round_trips_from_empty_to_streamed(cache_server: Any, s3: Any, s3_prefix: str) -> None:
    server = cache_server("--l1-bytes", "256MiB", *s3_args(s3, s3_prefix))
    client = server.client()
    for size in (0, 1, 4096, 1 << 20, 64 << 20):
        value = os.urandom(size)
        key = f"size/{size}"
        client.put(key, value)
        assert client.get(key) == value, size
    # The 64 MiB value went through S3 (write-through) as well.
    head = s3.client().head_object(Bucket=s3.bucket, Key=object_name(s3_prefix, b"size/67108864"))
    assert head["ContentLength"] == 64 << 20
    assert client.get("never-put") is None
    items = {f"many/{i}": os.urandom(i * 1000) for i in range(40)}
    client.put_many(items)
    assert client.get_many([*items, "never-put"]) == [*items.values(), None]
    assert client.contains("many/3") and not client.contains("never-put")
    assert client.delete("many/3") is True and client.get("many/3") is None
    stats = client.stats()
    assert stats["counters"]["puts"] >= 45 and {t["name"] for t in stats["tiers"]} == {"l1", "l3"}


def test_bad_input_gets_clear_status_and_server_keeps_serving(cache_server: Any) -> None:
    server = cache_server("--l1-bytes", "64MiB", "--max-value-bytes", "5MiB")
    client = server.client()
    with pytest.raises(InvalidRequestError, match=r"1\.\.1024 bytes"):
        client.put(b"", b"v")
    with pytest.raises(InvalidRequestError, match="got 1025"):
        client.get(b"k" * 1025)
    limit = 5 << 20
    with pytest.raises(LimitExceededError, match=f"max_value_bytes={limit}"):
        client.put("too-big", b"x" * (limit + 1))  # streamed: over the message limit
    with pytest.raises(InvalidRequestError):
        client.put_many([("ok", b"1"), (b"", b"2")])
    assert client.get("ok") is None  # the batch was validated before anything was written
    client.put("exactly", b"x" * limit)
    assert client.get("exactly") == b"x" * limit
    # Raw gRPC with a wrong checksum: refused, nothing stored.
    from cacheclient.wire import cache_pb2 as pb
    from cacheclient.wire import cache_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(pb.PutRequest(key=b"k", value=b"abc", checksum=12345), timeout=10)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert client.get("k") is None


def test_restart_after_sigkill_serves_l2(cache_server: Any, tmp_path: Path) -> None:
    args = ["--l1-bytes", "1MiB", "--l2-path", str(tmp_path / "l2"), "--l2-bytes", "64MiB"]
    server = cache_server(*args)
    values = {f"r/{i}": os.urandom(20_000) for i in range(100)}  # 2 MB: most spill from L1 into L2
    server.client().put_many(values)
    l2_before = {t["name"]: t for t in server.client().stats()["tiers"]}["l2"]["entries"]
    assert l2_before >= 40  # L1 (1 MiB) cannot hold 2 MB: the rest spilled into L2
    server.kill()
    restarted = cache_server(*args)
    client = restarted.client()
    # No L3 here: every value L2 held before the kill is served from L2 after it, byte for byte.
    served = {k: client.get_with_tier(k) for k in values}
    from_l2 = {k for k, hit in served.items() if hit is not None and hit[1] == "l2"}
    assert len(from_l2) == l2_before
    assert all(served[k][0] == values[k] for k in from_l2)


def test_flipped_bytes_in_l2_are_never_served(cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    args = ["--l1-bytes", "0", "--l2-path", str(l2), "--l2-bytes", "64MiB", *s3_args(s3, s3_prefix)]
    server = cache_server(*args)
    values = {f"c/{i}": os.urandom(10_000) for i in range(10)}
    server.client().put_many(values)
    assert server.stop() == 0
    env = lmdb.open(str(l2), map_size=64 << 20)
    with env.begin(write=True) as txn:
        for key in values:
            record = bytearray(txn.get(b"k" + key.encode()))
            record[len(record) // 2] ^= 0x5A
            txn.put(b"k" + key.encode(), bytes(record))
    env.close()
    client = cache_server(*args).client()
    for key, value in values.items():
        assert client.get_with_tier(key) == (value, "l3")  # refilled from S3, not the corrupt copy
        assert client.get_with_tier(key) == (value, "l2")  # and the good copy is back in L2
    assert client.stats()["counters"]["checksum_failures"] == len(values)


def test_object_storage_down_hits_served_misses_fail_fast(cache_server: Any, tmp_path: Path) -> None:
    weed = start_seaweed(tmp_path / "own-s3", bucket="own")
    try:
        server = cache_server("--l1-bytes", "64MiB", "--s3-endpoint", weed.endpoint, "--s3-bucket", "own")
        client = server.client()
        client.put("cached", b"hot value")
    finally:
        weed.stop(grace=5.0)
    assert client.get("cached") == b"hot value"
    began = time.monotonic()
    with pytest.raises(UnavailableError, match="unreachable"):
        client.get("not-cached")
    assert time.monotonic() - began < 15
    with pytest.raises(UnavailableError):
        client.put("new", b"v")  # write-through cannot be acknowledged without S3
    assert client.get("cached") == b"hot value"


def test_write_back_namespace_is_uploaded_on_sigterm(
    cache_server: Any, s3: Any, s3_prefix: str, tmp_path: Path
) -> None:
    config = tmp_path / "cachesvc.toml"
    config.write_text('[[namespaces]]\nprefix = "wb/"\nwrite_mode = "write-back"\n')
    server = cache_server("--config", str(config), "--l1-bytes", "64MiB", *s3_args(s3, s3_prefix))
    values = {f"wb/{i}": os.urandom(3000) for i in range(200)}
    server.client().put_many(values)
    assert server.stop() == 0
    raw = s3.client()
    for key, value in values.items():
        assert raw.get_object(Bucket=s3.bucket, Key=s3_prefix + key)["Body"].read() == value


def test_client_survives_fork(cache_server: Any) -> None:
    server = cache_server("--l1-bytes", "64MiB")
    client = server.client()
    client.put("parent", b"from parent")
    assert client.get("parent") == b"from parent"
    children = []
    for i in range(3):
        pid = os.fork()
        if pid == 0:  # child: use the parent's client object
            code = 1
            try:
                client.put(f"child/{i}", b"from child %d" % i)
                code = 0 if client.get("parent") == b"from parent" else 2
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        children.append(pid)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    assert client.get_many([f"child/{i}" for i in range(3)]) == [b"from child %d" % i for i in range(3)]


def _call_every_rpc(address: str, service: Any, metadata: tuple[tuple[str, str], ...] | None) -> dict[str, Any]:
    """Calls each RPC of `service` once with an empty request; {method name: status code, or OK}."""
    codes: dict[str, Any] = {}
    with grpc.insecure_channel(address) as channel:
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            request = getattr(cache_pb2, method.input_type.name)()
            serialize = type(request).SerializeToString
            deserialize = getattr(cache_pb2, method.output_type.name).FromString
            kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                    (True, False): channel.stream_unary, (True, True): channel.stream_stream}  # fmt: skip
            call = kind[method.client_streaming, method.server_streaming](path, serialize, deserialize)
            argument = iter([request]) if method.client_streaming else request
            try:
                answer = call(argument, timeout=10, metadata=metadata)
                if method.server_streaming:
                    list(answer)
                codes[method.name] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                codes[method.name] = exc.code()
    return codes


def test_token_auth_guards_every_rpc(cache_server: Any) -> None:
    """Every RPC of CacheService, a new one included, refuses a missing or wrong token and takes the right one.

    (MetaService has no token auth yet.)
    """
    server = cache_server("--l1-bytes", "16MiB", env={"CACHESVC_SECURITY_TOKEN": "s3cret-token"})
    service = cache_pb2.DESCRIPTOR.services_by_name["CacheService"]
    assert len(service.methods) >= 15
    for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", "s3cret-token"),)):
        codes = _call_every_rpc(server.address, service, metadata)
        refused = {name: code for name, code in codes.items() if code == grpc.StatusCode.UNAUTHENTICATED}
        assert refused == codes, f"with {metadata}: not refused: {set(codes) - set(refused)}"
    codes = _call_every_rpc(server.address, service, (("authorization", "Bearer s3cret-token"),))
    assert set(codes) == {m.name for m in service.methods}
    assert grpc.StatusCode.UNAUTHENTICATED not in codes.values(), codes
    assert codes["Stats"] == codes["Info"] == grpc.StatusCode.OK

    with pytest.raises(AuthError):
        server.client().get("k")
    with pytest.raises(AuthError):
        server.client(token="wrong").get("k")
    good = server.client(token="s3cret-token")
    good.put("k", b"v")
    assert good.get("k") == b"v"
    with grpc.insecure_channel(server.address) as channel:  # health checks need no token
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "s3cret-token" not in server.log()


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[l1]\nbytez = 5\n")
    result = subprocess.run(
        [sys.executable, "-m", "cachesvc", "serve", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "unknown config key l1.bytez" in result.stderr
    env = dict(os.environ, CACHESVC_L1_BYTEZ="5")
    result = subprocess.run(
        [sys.executable, "-m", "cachesvc", "serve"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 2 and "CACHESVC_L1_BYTEZ" in result.stderr


def test_port_in_use_is_a_clear_error(cache_server: Any) -> None:
    server = cache_server("--l1-bytes", "16MiB")
    result = subprocess.run(
        [sys.executable, "-m", "cachesvc", "serve", "--listen", server.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and f"cannot listen on {server.address}" in result.stderr


def test_sigterm_stops_gracefully(cache_server: Any) -> None:
    server: CacheServer = cache_server("--l1-bytes", "16MiB")
    server.client().put("k", b"v")
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGTERM)
    assert server.process.proc.wait(20) == 0
    with pytest.raises(UnavailableError):
        CacheClient(server.address, timeout=2).get("k")


def test_tls_with_a_token(cache_server: Any, tmp_path: Path) -> None:
    key, cert = self_signed_cert(tmp_path)
    server = cache_server(
        "--l1-bytes", "16MiB", "--tls-cert", str(cert), "--tls-key", str(key), env={"CACHESVC_SECURITY_TOKEN": "t0k"}
    )
    client = CacheClient(server.address, tls_ca=str(cert), token="t0k", timeout=10)
    client.put("secure", b"over TLS")
    assert client.get("secure") == b"over TLS"
    with pytest.raises(UnavailableError):
        CacheClient(server.address, timeout=3).get("secure")  # plaintext to a TLS port fails


def test_streamed_batches_and_batched_contains(cache_server: Any) -> None:
    client = cache_server("--l1-bytes", "128MiB").client()
    values = {"s/empty": b"", "s/small": b"x" * 100, "s/big": os.urandom(5 << 20), "s/mid": os.urandom(1 << 20)}
    client.put_many(values)
    keys = ["s/big", "s/missing", "s/empty", "s/mid", "s/small"]
    got = list(client.iter_many(keys))
    assert [k for k, _ in got] == [k.encode() for k in keys]
    assert [v for _, v in got] == [values["s/big"], None, b"", values["s/mid"], values["s/small"]]
    assert client.contains_many(keys) == [True, False, True, True, True]


# -- one engine read per logical get; bounded batches (issue 9) ------------


def _counters(client: CacheClient) -> dict[str, int]:
    return dict(client.stats()["counters"])


def _grew(before: dict[str, int], after: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


def test_a_large_get_reads_the_engine_once_and_releases_its_lease_once(cache_server: Any) -> None:
    client = cache_server("--l1-bytes", "128MiB").client()
    big = os.urandom(5 << 20)  # over INLINE_BYTES: the answer is streamed
    client.put("big", big, lease=60)
    client.put("big", big, lease=60)  # a second holder: one release must leave it pinned
    before = _counters(client)
    assert client.get("big", release=True) == big
    after = _counters(client)
    assert _grew(before, after, "gets") == 1
    assert _grew(before, after, "leases_released") == 1
    assert client.get_with_tier("big") == (big, "l1")
    assert _grew(after, _counters(client), "gets") == 1


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([64 << 10] * 200, id="200x64KiB"),
        pytest.param([1 << 20] * 20, id="20x1MiB"),
        pytest.param([1 << 20] * 100, id="100x1MiB-past-GET_MANY_READ_BYTES"),
        pytest.param([5 << 20, 0, 100, 3 << 20, (3 << 20) + 1, 2 << 20, 7 << 20, 10, 1 << 20] * 3, id="mixed"),
    ],
)
def test_get_many_across_the_response_budget_reads_each_value_once(cache_server: Any, sizes: list[int]) -> None:
    client = cache_server("--l1-bytes", "512MiB").client()
    values = {f"m/{i}": os.urandom(size) for i, size in enumerate(sizes)}
    client.put_many(values)
    leased = f"m/{len(sizes) - 2}"  # late in the batch: past the first response's budget
    client.put(leased, values[leased], lease=60)
    client.put(leased, values[leased], lease=60)
    keys = [*values, "m/missing"]
    before = _counters(client)
    assert client.get_many(keys, release=True) == [*values.values(), None]
    after = _counters(client)
    assert _grew(before, after, "gets") == len(keys)
    assert _grew(before, after, "leases_released") == 1


def test_a_handoff_that_expired_is_read_again(cache_server: Any) -> None:
    server = cache_server("--l1-bytes", "128MiB", env={"CACHESVC_HANDOFF_SECONDS": "0.2"})
    client = server.client()
    big = os.urandom(5 << 20)
    client.put("slow", big)
    small = {f"slow/{i}": os.urandom(64 << 10) for i in range(100)}  # 6.4 MB: past one answer's budget
    client.put_many(small)
    connection = client.cluster.node(server.address)._connection.get()  # the one node's channel
    stream, get_many = connection.get_many_stream, connection.stub.GetMany

    def late(call: Any) -> Any:
        def call_late(request: Any, **kwargs: Any) -> Any:
            if request.handoff:
                time.sleep(0.6)  # past the server's hand-off time: it no longer holds the bytes
            return call(request, **kwargs)

        return call_late

    connection.get_many_stream, connection.stub.GetMany = late(stream), late(get_many)
    before = _counters(client)
    assert client.get("slow") == big
    after = _counters(client)
    assert _grew(before, after, "gets") == 2 and _grew(before, after, "handoff_misses") == 1
    assert client.get_many(list(small)) == list(small.values())
    again = _grew(after, _counters(client), "handoff_misses")
    assert again > 0 and _grew(after, _counters(client), "gets") == len(small) + again


def test_every_batch_is_bounded_and_the_client_splits_its_own(cache_server: Any) -> None:
    from cacheclient.wire import cache_pb2 as pb
    from cacheclient.wire import cache_pb2_grpc
    from cacheclient.wire.limits import MAX_BATCH_KEYS, PUT_MANY_BYTES

    server = cache_server("--l1-bytes", "64MiB")
    too_many = [b"k%d" % i for i in range(MAX_BATCH_KEYS + 1)]
    with grpc.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        for call, request in (
            (stub.GetMany, pb.GetManyRequest(keys=too_many)),
            (stub.ContainsMany, pb.ContainsManyRequest(keys=too_many)),
            (stub.PutMany, pb.PutManyRequest(items=[pb.PutRequest(key=k, value=b"v") for k in too_many])),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"MAX_BATCH_KEYS={MAX_BATCH_KEYS}" in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.GetManyStream(pb.GetManyRequest(keys=too_many), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        half = PUT_MANY_BYTES // 2 + 1
        items = [pb.PutRequest(key=b"a", value=b"x" * half), pb.PutRequest(key=b"b", value=b"y" * half)]
        with pytest.raises(grpc.RpcError) as info:
            stub.PutMany(pb.PutManyRequest(items=items), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"PUT_MANY_BYTES={PUT_MANY_BYTES}" in (info.value.details() or "")
    client = server.client()
    values = {f"b/{i}": b"%d" % i for i in range(2 * MAX_BATCH_KEYS + 5)}
    client.put_many(values)
    assert client.get_many(list(values)) == list(values.values())
    assert all(client.contains_many(list(values)))
    assert [v for _, v in client.iter_many(list(values))] == list(values.values())


def test_get_stream_serves_the_handoff_once_then_reads_again(cache_server: Any) -> None:
    from cacheclient.wire import cache_pb2 as pb
    from cacheclient.wire import cache_pb2_grpc

    server = cache_server("--l1-bytes", "64MiB")
    client = server.client()
    big = os.urandom((5 << 20) + 3)
    client.put("raw", big)
    with grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 8 << 20)]) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        before = _counters(client)
        answer = stub.Get(pb.GetRequest(key=b"raw"), timeout=30)
        assert answer.found and answer.streamed and answer.handoff and not answer.value
        request = pb.GetRequest(key=b"raw", handoff=answer.handoff)
        chunks = list(stub.GetStream(request, timeout=30))
        assert b"".join(c.data for c in chunks) == big and chunks[0].size == len(big)
        assert _grew(before, _counters(client), "gets") == 1
        again = list(stub.GetStream(request, timeout=30))  # a token serves once; then the key is read
        assert b"".join(c.data for c in again) == big
        after = _counters(client)
        assert _grew(before, after, "gets") == 2 and _grew(before, after, "handoff_misses") == 1
