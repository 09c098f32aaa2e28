"""gRPC channel and server settings shared by every process."""

from __future__ import annotations

from concurrent import futures
from typing import Tuple

import grpc

MAX_MESSAGE_BYTES = 64 << 20

OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=OPTIONS)


def server(max_workers: int = 16) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=OPTIONS)


def bind_any_port(srv: grpc.Server, host: str = "127.0.0.1") -> Tuple[str, int]:
    """Bind port 0 on ``host`` and return (address, port)."""
    port = srv.add_insecure_port(f"{host}:0")
    if port == 0:
        raise RuntimeError(f"could not bind a port on {host}")
    return f"{host}:{port}", port
