"""Size limits the master derives from its config, so a flooding or broken peer cannot grow its memory.

The per-key limits (``max_key_bytes``, ``max_object_bytes``) and the batch limit (``max_batch``) are
enforced by MasterState and MasterHandlers with per-key codes (KEY_TOO_LONG, VALUE_TOO_LARGE) and a
whole-call BATCH_TOO_LARGE. This module bounds the bytes of one framed request before it is parsed: the
largest legal request is a full batch of the longest keys, each with a fixed-size field or two.
"""

from __future__ import annotations

from kvpool.master.config import MasterConfig
from kvpool.proto import frames

PER_KEY_OVERHEAD = 32
"""Protobuf bytes around one key of a batch: tag + length of the key, a varint size or checksum, slack."""
SLACK_BYTES = 1 << 20
"""The rest of a request (client id, put config with preferred segments, prefix, flags)."""


def max_request_payload(config: MasterConfig) -> int:
    """Most payload bytes one framed request may announce; more closes the connection (BAD_FRAME)."""
    largest = config.max_batch * (config.max_key_bytes + PER_KEY_OVERHEAD) + SLACK_BYTES
    return min(frames.MAX_RPC_PAYLOAD, largest)
