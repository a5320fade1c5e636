"""The wire contract of cachesvc: everything the server and its clients must agree on.

The cache servers (`cachesvc`) and the client library (`cacheclient`) both
import this package, and nothing here is written anywhere else; the client
never imports `cachesvc`, so the shared definitions live on the client side.

- the generated protobuf and gRPC stubs (`cache_pb2`, `cache_pb2_grpc`,
  `meta_pb2`, `meta_pb2_grpc`; `make proto` writes them to
  `cacheclient/_proto`, and everyone imports them from here);
- size limits (`limits`): keys, inline values, stream chunks, messages;
- the L2 record format in the server's LMDB file (`record`), which a
  co-located client reads directly, and the xxh3-64 `checksum`;
- object naming and checksums in S3 (`s3`), the botocore settings, `parse_s3_uri`;
- range keys (`ranges`): the reserved, read-only keys that name a byte range
  of an object in object storage (`<key>\\x00bytes=START-END`);
- tensor records (`tensors`): named tensors as raw bytes, a checksum each, and
  the dtype codes every stored tensor format uses (model parameters, KV blocks);
- the table between kinds of failure and gRPC status codes (`status`);
- names: node states, tier names, call metadata, the host's boot id (`names`);
- placement: which cache nodes hold a key, ranked (`placement`);
- key digests, the names a client's local index of held keys uses (`digest`);
- which token each RPC needs: the scope table (`scopes`).
"""

from cacheclient._proto import cache_pb2, cache_pb2_grpc, meta_pb2, meta_pb2_grpc
from cacheclient.wire import codec
from cacheclient.wire.digest import DIGEST_BYTES, KEY_DIGEST_ENTRIES, key_digest, pack_digests, unpack_digests
from cacheclient.wire.limits import (
    CHUNK_BYTES,
    INLINE_BYTES,
    MAX_KEY_BYTES,
    MAX_MESSAGE_BYTES,
    META_MAX_MESSAGE_BYTES,
    RESPONSE_BUDGET,
)
from cacheclient.wire.names import (
    AUTH_METADATA,
    LEADER_ADDRESS_METADATA,
    LEADER_ID_METADATA,
    LIMIT_METADATA,
    NODE_STATE_NAMES,
    OWNER_METADATA,
    PLACEMENT_VERSION_METADATA,
    ROUTE_FALLBACK,
    ROUTE_METADATA,
    TIER_NAMES,
    TIER_OF_NAME,
    bearer_metadata,
    boot_id,
    node_state_name,
    node_state_value,
)
from cacheclient.wire.placement import PLACEMENT_SLOTS, placement_slots, rank_nodes, slot_of
from cacheclient.wire.ranges import RANGE_MARK, ByteRange, RangeKeyError, is_range_key, parse_range_key, range_key
from cacheclient.wire.record import (
    FLAG_DIRTY,
    HEADER,
    INLINE_KEY_MAX,
    RECORD_VERSION,
    RecordHeader,
    checksum,
    open_record,
    pack_record,
    record_key,
    record_overhead,
    storage_key,
    unpack_header,
)
from cacheclient.wire.s3 import (
    MAX_OBJECT_NAME_BYTES,
    META_CHECKSUM,
    META_KEY,
    checksum_metadata,
    is_hashed_name,
    key_in_metadata,
    key_matches,
    key_of,
    object_matches,
    object_name,
    parse_s3_uri,
    s3_config,
)
from cacheclient.wire.status import STATUS_CODES, ErrorKind, kind_of, status_code

__all__ = [
    "AUTH_METADATA",
    "CHUNK_BYTES",
    "DIGEST_BYTES",
    "FLAG_DIRTY",
    "HEADER",
    "INLINE_BYTES",
    "INLINE_KEY_MAX",
    "KEY_DIGEST_ENTRIES",
    "LEADER_ADDRESS_METADATA",
    "LEADER_ID_METADATA",
    "LIMIT_METADATA",
    "MAX_KEY_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_OBJECT_NAME_BYTES",
    "META_CHECKSUM",
    "META_KEY",
    "META_MAX_MESSAGE_BYTES",
    "NODE_STATE_NAMES",
    "OWNER_METADATA",
    "PLACEMENT_SLOTS",
    "PLACEMENT_VERSION_METADATA",
    "RANGE_MARK",
    "RECORD_VERSION",
    "RESPONSE_BUDGET",
    "ROUTE_FALLBACK",
    "ROUTE_METADATA",
    "STATUS_CODES",
    "TIER_NAMES",
    "TIER_OF_NAME",
    "ByteRange",
    "ErrorKind",
    "RangeKeyError",
    "RecordHeader",
    "bearer_metadata",
    "boot_id",
    "cache_pb2",
    "cache_pb2_grpc",
    "checksum",
    "checksum_metadata",
    "codec",
    "is_hashed_name",
    "is_range_key",
    "key_digest",
    "key_in_metadata",
    "key_matches",
    "key_of",
    "kind_of",
    "meta_pb2",
    "meta_pb2_grpc",
    "node_state_name",
    "node_state_value",
    "object_matches",
    "object_name",
    "open_record",
    "pack_digests",
    "pack_record",
    "parse_range_key",
    "parse_s3_uri",
    "placement_slots",
    "range_key",
    "rank_nodes",
    "record_key",
    "record_overhead",
    "s3_config",
    "slot_of",
    "status_code",
    "storage_key",
    "unpack_digests",
    "unpack_header",
]
