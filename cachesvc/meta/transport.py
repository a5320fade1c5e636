"""Raft messages over gRPC between the nodes of the metadata shard.

Outbound, each peer has a bounded queue and one sender thread that ships
whatever has queued up as one `RaftBatch` per call, with a deadline. When a
queue is full, or a call fails, messages are dropped: Raft is built to
tolerate lost messages (the leader re-sends on the next heartbeat), while
blocking the node's loop on a slow peer would stall the whole shard.

Inbound, `RaftTransportServicer` decodes a batch and hands it to the node,
which queues it (also bounded, also dropping) for its Raft thread.

`message_to_proto` / `message_from_proto` convert between the core's
`Message` and the wire format.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import grpc

from cacheclient.wire import (
    LIMIT_METADATA,
    META_MAX_MESSAGE_BYTES,
    ErrorKind,
    bearer_metadata,
    meta_pb2_grpc,
    status_code,
)
from cacheclient.wire import meta_pb2 as pb
from cachesvc.meta.raft.messages import (
    Entry,
    EntryKind,
    Message,
    MessageType,
    Snapshot,
    SnapshotMetadata,
)

__all__ = [
    "RaftTransportServicer",
    "Transport",
    "message_from_proto",
    "message_to_proto",
]

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", META_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", META_MAX_MESSAGE_BYTES),
    # Reconnect quickly to a restarted peer: an election must not wait on backoff.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
]
_BATCH_BYTES = 4 << 20


def message_to_proto(m: Message) -> pb.RaftMessage:
    """The wire form of a core message."""
    out = pb.RaftMessage(
        type=int(m.type),
        src=m.src,
        dst=m.dst,
        term=m.term,
        log_term=m.log_term,
        index=m.index,
        entries=[pb.RaftEntry(term=e.term, index=e.index, data=e.data, kind=int(e.kind)) for e in m.entries],
        commit=m.commit,
        # A heartbeat is never refused: its `reject` bit carries the leader's quiescence.
        reject=m.quiesce if m.type is MessageType.HEARTBEAT else m.reject,
        reject_hint=m.reject_hint,
        context=m.context,
    )
    if m.snapshot is not None:
        meta = m.snapshot.metadata
        out.snapshot.CopyFrom(
            pb.RaftSnapshot(index=meta.index, term=meta.term, voters=list(meta.voters), data=m.snapshot.data)
        )
        out.has_snapshot = True
    return out


def message_from_proto(p: pb.RaftMessage) -> Message:
    """The core message a wire message carries.

    Raises:
        ValueError: an unknown message or entry type.
    """
    snapshot = None
    if p.has_snapshot:
        s = p.snapshot
        snapshot = Snapshot(SnapshotMetadata(s.index, s.term, tuple(s.voters)), s.data)
    kind = MessageType(p.type)
    heartbeat = kind is MessageType.HEARTBEAT
    return Message(
        type=kind,
        src=p.src,
        dst=p.dst,
        term=p.term,
        log_term=p.log_term,
        index=p.index,
        entries=tuple(Entry(e.term, e.index, e.data, EntryKind(e.kind)) for e in p.entries),
        commit=p.commit,
        reject=p.reject and not heartbeat,
        reject_hint=p.reject_hint,
        snapshot=snapshot,
        context=p.context,
        quiesce=p.reject and heartbeat,
    )


class _Peer:
    """The outbound queue and sender thread of one peer."""

    def __init__(
        self, node_id: int, address: str, queue_size: int, deadline: float, peer_token: str, tls_ca: bytes | None
    ) -> None:
        self.node_id = node_id
        self._metadata = bearer_metadata(peer_token) if peer_token else None
        self.address = address
        self.deadline = deadline
        self.queue: queue.Queue[pb.RaftMessage | None] = queue.Queue(maxsize=queue_size)
        self.dropped = 0
        self.sent = 0
        self.failures = 0
        self._channel = (
            grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_ca), _CHANNEL_OPTIONS)
            if tls_ca is not None
            else grpc.insecure_channel(address, _CHANNEL_OPTIONS)
        )
        self._stub = meta_pb2_grpc.RaftTransportStub(self._channel)
        self._thread = threading.Thread(target=self._run, name=f"raft-send-{node_id}", daemon=True)
        self._thread.start()

    def offer(self, m: pb.RaftMessage) -> None:
        try:
            self.queue.put_nowait(m)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            batch = [first]
            size = first.ByteSize()
            has_snapshot = first.has_snapshot
            while size < _BATCH_BYTES:
                try:
                    m = self.queue.get_nowait()
                except queue.Empty:
                    break
                if m is None:
                    return
                batch.append(m)
                size += m.ByteSize()
                has_snapshot = has_snapshot or m.has_snapshot
            try:
                self._stub.Send(
                    pb.RaftBatch(messages=batch),
                    timeout=self.deadline * (10 if has_snapshot else 1),
                    metadata=self._metadata,
                )
                self.sent += len(batch)
                self.failures = 0
            except grpc.RpcError as exc:
                self.dropped += len(batch)
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    log.debug("raft send to %d at %s failed: %s", self.node_id, self.address, exc.code())
                # A peer that is down: do not spin; what queues meanwhile is mostly
                # heartbeats that the next ones supersede.
                time.sleep(min(0.05, 0.005 * self.failures))

    def close(self) -> None:
        while True:
            try:
                self.queue.put_nowait(None)
                break
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self.queue.get_nowait()
        self._thread.join(timeout=2.0)
        self._channel.close()


class Transport:
    """Sends core messages to peers, dropping what cannot go out now."""

    def __init__(
        self,
        peers: Mapping[int, str],
        *,
        queue_size: int = 4096,
        deadline: float = 1.0,
        peer_token: str = "",
        tls_ca: bytes | None = None,
    ) -> None:
        """Args:
        peers: Peer id -> "host:port", without this node.
        queue_size: Messages held per peer before new ones are dropped.
        deadline: Seconds a batch may take (ten times that with a snapshot).
        peer_token: The shard's peer secret, presented on every call ("": none).
        tls_ca: PEM roots that sign the peers' certificates: TLS to every peer (None: plaintext).
        """
        self._peers = {i: _Peer(i, a, queue_size, deadline, peer_token, tls_ca) for i, a in peers.items()}

    def send(self, messages: Iterable[Message]) -> None:
        """Queue messages for their destinations; never blocks."""
        for m in messages:
            peer = self._peers.get(m.dst)
            if peer is not None:
                peer.offer(message_to_proto(m))

    def stats(self) -> dict[int, dict[str, int]]:
        """Per peer: messages sent, dropped, and queued now."""
        return {i: {"sent": p.sent, "dropped": p.dropped, "queued": p.queue.qsize()} for i, p in self._peers.items()}

    def close(self) -> None:
        """Stop the sender threads and close the channels."""
        for p in self._peers.values():
            p.close()


class RaftTransportServicer(meta_pb2_grpc.RaftTransportServicer):
    """Receives batches from peers and hands the decoded messages to `deliver`.

    A batch over `max_batch_bytes` is refused (RESOURCE_EXHAUSTED naming the
    limit) before anything in it reaches the node.
    """

    def __init__(self, deliver: Callable[[list[Message]], None], max_batch_bytes: int = META_MAX_MESSAGE_BYTES) -> None:
        self._deliver = deliver
        self._max_batch_bytes = max_batch_bytes

    def Send(self, request: pb.RaftBatch, context: grpc.ServicerContext) -> pb.RaftAck:
        size = request.ByteSize()
        if size > self._max_batch_bytes:
            context.set_trailing_metadata(((LIMIT_METADATA, "max_raft_message_bytes"),))
            context.abort(
                status_code(ErrorKind.LIMIT_EXCEEDED),
                f"raft batch of {size} bytes is over the limit of {self._max_batch_bytes} bytes"
                " (max_raft_message_bytes)",
            )
        try:
            messages = [message_from_proto(m) for m in request.messages]
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad raft message: {exc}")
        self._deliver(messages)
        return pb.RaftAck()
