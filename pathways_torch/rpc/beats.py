"""Heartbeat datagrams: a worker's beats and the coordinator's answers over UDP.

Why not the registration stream: at 2,048 hosts a beat read from a gRPC stream costs the
coordinator about 140 µs of CPU (grpc.aio's poller thread wakes the event loop once per
message), 0.15 of a core in all; a datagram drained with its neighbours costs a few µs
(Decision 16 in docs/architecture.md). The stream still carries the registration, the
events and the "connection closed" that makes a killed host lost at once; the datagrams
carry only liveness, both ways.

A datagram is 32 bytes: a magic (``BEAT`` or ``ANSWER``), the registration's id, the
beat's sequence number, and a keyed BLAKE2b-128 MAC of those 16 bytes. The key is a
secret of one registration, sent on its (authenticated, perhaps TLS) stream, so nobody
else can keep a dead host alive; a sequence number at or below the last one seen is a
replay and is dropped.

Example::

    key = new_key()
    data = pack(BEAT, 7, 1, key)
    assert unpack(data, {7: key}.get) == (BEAT, 7, 1)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Callable, Optional, Tuple

BEAT = b"PWB1"
ANSWER = b"PWA1"
_HEAD = struct.Struct("<4sIQ")
_MAC = 16
SIZE = _HEAD.size + _MAC
KEY_BYTES = 16
#: The receive buffer the coordinator asks for: a burst of every host's beat at once.
RCVBUF = 4 << 20


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def _mac(head: bytes, key: bytes) -> bytes:
    return hashlib.blake2b(head, key=key, digest_size=_MAC).digest()


def pack(magic: bytes, beat_id: int, seq: int, key: bytes) -> bytes:
    """One datagram: ``magic`` (BEAT or ANSWER) for registration ``beat_id``, beat ``seq``."""
    head = _HEAD.pack(magic, beat_id, seq)
    return head + _mac(head, key)


def unpack(data: bytes, key_of: Callable[[int], Optional[bytes]]
           ) -> Optional[Tuple[bytes, int, int]]:
    """``(magic, beat_id, seq)`` of a datagram whose MAC checks under ``key_of(beat_id)``;
    None for anything else (a wrong size, an unknown id, a forged or damaged datagram)."""
    if len(data) != SIZE:
        return None
    magic, beat_id, seq = _HEAD.unpack_from(data)
    key = key_of(beat_id)
    if key is None or not hmac.compare_digest(_mac(data[:_HEAD.size], key),
                                              data[_HEAD.size:]):
        return None
    return magic, beat_id, seq


def phase(beat_id: int, period: float) -> float:
    """Where in each period registration ``beat_id`` beats: consecutive ids land far
    apart (the golden ratio's multiples mod 1), so a cluster's beats spread evenly and
    no burst overflows the coordinator's receive buffer (often 208 KiB: net.core.rmem_max
    caps SO_RCVBUF)."""
    return (beat_id * 0.6180339887498949) % 1.0 * period


def host_of(address: str) -> str:
    """The host part of ``host:port`` (``[v6]:port`` too), where the beats go."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
