"""The cache's checksum, re-exported from the wire contract for the engine.

The checksum and the record format live in `cacheclient.wire.record`; import
them from `cacheclient.wire`. This module remains only because
`cachesvc.engine` still imports `checksum` from here; it goes once the engine
imports it from the wire contract.
"""

from __future__ import annotations

from cacheclient.wire.record import checksum

__all__ = ["checksum"]
