"""gRPC channel and server settings shared by every process, and the cluster token.

A cluster that listens beyond loopback must be started with a shared token
(``PATHWAYS_TOKEN`` or ``--token``). Every channel then sends it as gRPC metadata and
every server (coordinator, worker agents, executors) refuses calls without it, with
``UNAUTHENTICATED``. Processes started by a launcher inherit it through the environment.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from concurrent import futures
from typing import Optional, Tuple

import grpc

MAX_MESSAGE_BYTES = 64 << 20
TOKEN_ENV = "PATHWAYS_TOKEN"
TOKEN_KEY = "x-pathways-token"

OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

# Servers ping idle peers, so a peer that vanished without closing its connection (a
# host down, a network partition) ends its streams within about 4 s.
SERVER_OPTIONS = OPTIONS + [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

_token: Optional[str] = None


def token() -> str:
    """The cluster token of this process ("" when none): set_token's, or PATHWAYS_TOKEN."""
    return _token if _token is not None else os.environ.get(TOKEN_ENV, "")


def set_token(value: Optional[str]) -> None:
    """Use ``value`` as this process's token (None: fall back to PATHWAYS_TOKEN)."""
    global _token
    _token = value


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def require_token_for(host: str, what: str) -> None:
    """Refuse to listen beyond loopback without a token (anyone could drive the devices)."""
    if not is_loopback(host) and not token():
        raise SystemExit(
            f"{what} binds {host!r}, which other machines can reach: set a shared token "
            f"with --token or {TOKEN_ENV}=... (the same on every node and client)")


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, value: str) -> None:
        self._md = (TOKEN_KEY, value)

    def _details(self, d):
        # grpc hands interceptors a namedtuple of the call's details
        return d._replace(metadata=list(d.metadata or []) + [self._md])

    def intercept_unary_unary(self, cont, d, request):
        return cont(self._details(d), request)

    def intercept_unary_stream(self, cont, d, request):
        return cont(self._details(d), request)

    def intercept_stream_unary(self, cont, d, it):
        return cont(self._details(d), it)

    def intercept_stream_stream(self, cont, d, it):
        return cont(self._details(d), it)


class _CheckToken(grpc.ServerInterceptor):
    def __init__(self, value: str) -> None:
        self._want = value.encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong cluster token: pass the cluster's token with "
                          f"pw.init(token=...), --token or {TOKEN_ENV}")
        self._deny = deny

    def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(got.encode(), self._want):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                lambda it, ctx: self._deny(None, ctx))
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(self._deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                lambda req, ctx: self._deny(req, ctx))
        return grpc.unary_unary_rpc_method_handler(self._deny)


def channel(address: str) -> grpc.Channel:
    ch = grpc.insecure_channel(address, options=OPTIONS)
    t = token()
    return grpc.intercept_channel(ch, _AddToken(t)) if t else ch


def server(max_workers: int = 16) -> grpc.Server:
    t = token()
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       options=SERVER_OPTIONS,
                       interceptors=[_CheckToken(t)] if t else None)


def bind_any_port(srv: grpc.Server, host: str = "127.0.0.1") -> Tuple[str, int]:
    """Bind port 0 on ``host`` and return (address, port)."""
    port = srv.add_insecure_port(f"{host}:0")
    if port == 0:
        raise RuntimeError(f"could not bind a port on {host}")
    return f"{host}:{port}", port
