"""gRPC channel and server settings shared by every process, and the cluster token.

A cluster that listens beyond loopback must be started with a shared token
(``PATHWAYS_TOKEN`` or ``--token``). Every channel then sends it as gRPC metadata and
every server (coordinator, worker agents, executors) refuses calls without it, with
``UNAUTHENTICATED``. Processes started by a launcher inherit it through the environment.

TLS is on when ``PATHWAYS_TLS_CERT`` / ``PATHWAYS_TLS_KEY`` / ``PATHWAYS_TLS_CA`` (PEM
file paths) are set, by the launchers' ``--tls-*`` flags or ``set_tls``, and, like the
token, inherited by every process a launcher or worker starts. Every server then binds
with ``ssl_server_credentials`` through ``add_port`` (client certificates required when a
CA is given: mutual TLS) and every ``channel`` uses ``ssl_channel_credentials``; the data
plane (``worker/dataplane.py``) wraps its sockets with the same files.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import socket
from concurrent import futures
from functools import lru_cache
from typing import NamedTuple, Optional, Tuple

import grpc

from ..errors import PathwaysError

#: The largest gRPC message any server or channel takes or sends (set explicitly on both
#: sides below): a bigger one fails with RESOURCE_EXHAUSTED before any handler sees it.
#: Tensors travel in codec.CHUNK_BYTES pieces, far below it (tests/test_validation.py).
MAX_MESSAGE_BYTES = 64 << 20
TOKEN_ENV = "PATHWAYS_TOKEN"
TOKEN_FILE_ENV = "PATHWAYS_TOKEN_FILE"
TOKEN_KEY = "x-pathways-token"
TLS_CERT_ENV = "PATHWAYS_TLS_CERT"
TLS_KEY_ENV = "PATHWAYS_TLS_KEY"
TLS_CA_ENV = "PATHWAYS_TLS_CA"
#: The name every server's certificate is checked against instead of the host dialled
#: (one certificate shared by all nodes; gRPC's ssl_target_name_override).
TLS_NAME_ENV = "PATHWAYS_TLS_SERVER_NAME"
_TLS_ENVS = (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV, TLS_NAME_ENV)

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
    """The cluster token of this process ("" when none): set_token's, PATHWAYS_TOKEN, or
    the first line of the file PATHWAYS_TOKEN_FILE names (a mounted secret: the token
    itself never appears in a job's description or environment)."""
    if _token is not None:
        return _token
    value = os.environ.get(TOKEN_ENV, "")
    path = os.environ.get(TOKEN_FILE_ENV, "")
    return value if value or not path else token_from_file(path)


@lru_cache(maxsize=4)
def token_from_file(path: str) -> str:
    """The token in ``path`` (its first line, stripped); a clear error when unreadable."""
    try:
        with open(path) as f:
            value = f.readline().strip()
    except OSError as e:
        raise PathwaysError(f"cannot read the cluster token file {path!r} "
                            f"({TOKEN_FILE_ENV}, --token-file): {e.strerror}") from None
    if not value:
        raise PathwaysError(f"the cluster token file {path!r} is empty: write the token "
                            "on its first line")
    return value


def set_token(value: Optional[str]) -> None:
    """Use ``value`` as this process's token (None: fall back to PATHWAYS_TOKEN)."""
    global _token
    _token = value


class TLSFiles(NamedTuple):
    """This process's TLS settings: PEM file paths ("" where unset), the name to expect."""

    cert: str
    key: str
    ca: str
    server_name: str


def tls() -> Optional[TLSFiles]:
    """The TLS settings of this process, from PATHWAYS_TLS_* (None: plain text)."""
    cert, key, ca, name = (os.environ.get(n, "") for n in _TLS_ENVS)
    if not (cert or key or ca):
        return None
    return TLSFiles(cert, key, ca, name)


def set_tls(cert: Optional[str] = None, key: Optional[str] = None,
            ca: Optional[str] = None, server_name: Optional[str] = None) -> None:
    """Use TLS in this process and in every process it starts from now on.

    ``cert``/``key``: this process's certificate chain and private key (PEM files); a
    server must have them, a client presents them for mutual TLS. ``ca``: the CA that
    signed the peers' certificates (default: the system's roots); a server given one
    requires client certificates signed by it (mutual TLS). ``server_name``: check every
    server's certificate against this name instead of the host dialled.

    The settings live in ``os.environ`` (PATHWAYS_TLS_*), not in this module, so that an
    embedded cluster, executors and a launcher's script inherit the same ones. ``None``
    leaves a setting as it is, ``""`` clears it; clearing all turns TLS off.
    """
    new = {}
    for name, value in zip(_TLS_ENVS, (cert, key, ca, server_name), strict=True):
        if value and name != TLS_NAME_ENV:
            if not os.path.isfile(value):
                raise PathwaysError(f"TLS file {value!r} does not exist")
            value = os.path.abspath(value)
        new[name] = os.environ.get(name, "") if value is None else value
    if bool(new[TLS_CERT_ENV]) != bool(new[TLS_KEY_ENV]):
        raise PathwaysError("TLS needs a certificate and its private key together: give "
                            f"both --tls-cert and --tls-key ({TLS_CERT_ENV}, {TLS_KEY_ENV})")
    for name, value in new.items():
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)


def add_tls_arguments(ap: argparse.ArgumentParser) -> None:
    """Add ``--tls-cert``, ``--tls-key``, ``--tls-ca`` to a command's argument parser."""
    ap.add_argument("--tls-cert", default=None,
                    help=f"this node's certificate chain, PEM (default: {TLS_CERT_ENV}); "
                    "turns on TLS for gRPC and the data plane")
    ap.add_argument("--tls-key", default=None,
                    help=f"the private key of --tls-cert, PEM (default: {TLS_KEY_ENV})")
    ap.add_argument("--tls-ca", default=None,
                    help=f"the CA that signed the cluster's certificates, PEM (default: "
                    f"{TLS_CA_ENV}); servers given one require client certificates "
                    "(mutual TLS)")


def apply_tls_arguments(args: argparse.Namespace) -> None:
    """``set_tls`` from ``add_tls_arguments``' flags (absent flags leave the env as is)."""
    set_tls(getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
            getattr(args, "tls_ca", None))


@lru_cache(maxsize=16)
def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise PathwaysError(f"cannot read TLS file {path!r}: {e.strerror}") from None


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


def advertised_host(bind_host: str, toward: str) -> str:
    """The host other machines should dial to reach a server bound to ``bind_host``.

    A wildcard bind ("0.0.0.0", "::", "") is not an address anyone can dial: use the
    address of this machine's interface that routes toward ``toward`` (``host:port``,
    the coordinator), found by connecting a UDP socket (nothing is sent).
    """
    if bind_host not in ("0.0.0.0", "::", "", "[::]"):
        return bind_host
    host, _, port = toward.rpartition(":")
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port or 1)))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


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


class _ExplainedError(grpc.RpcError):
    """A failed call's error with a message that says what to check."""

    def __init__(self, err: grpc.RpcError, details: str, code=None) -> None:
        super().__init__(details)
        self._err, self._details, self._code = err, details, code

    def code(self):
        return self._code or self._err.code()

    def details(self) -> str:
        return self._details

    def __getattr__(self, name):
        return getattr(self._err, name)

    def __str__(self) -> str:
        return f"{self.code()}: {self._details}"


class _ExplainedStream:
    """A server-streaming call whose first failure, if it never connected, is explained."""

    def __init__(self, call, explain) -> None:
        self._call, self._explain = call, explain

    def __iter__(self):
        return self

    def __next__(self):
        explain = self._explain
        if explain is None:
            return next(self._call)
        try:
            item = next(self._call)
        except grpc.RpcError as e:
            better = explain(e)
            if better is None:
                raise
            raise better from None
        self._explain = None
        return item

    def __getattr__(self, name):
        return getattr(self._call, name)


class _ExplainRefusal(grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Turn a failed TLS handshake into an error that says so.

    A first contact (a client's ``OpenSession``, a worker's ``RegisterWorker``) is a
    streaming call; when its connection fails, gRPC only says "Socket closed" or quotes
    an OpenSSL code. Only streaming calls are intercepted, so unary ones cost nothing.
    """

    def __init__(self, address: str, tls_on: bool) -> None:
        self._address, self._tls_on = address, tls_on

    def _explain(self, e: grpc.RpcError):
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        d = e.details() or ""
        low = d.lower()
        where = self._address
        if "wrong_version_number" in low:
            return _ExplainedError(e, (
                f"{where} does not speak TLS ({d}): drop the --tls-* settings "
                f"({TLS_CERT_ENV}, {TLS_KEY_ENV}, {TLS_CA_ENV}) for a cluster without TLS, "
                "or start the cluster with them"))
        if "ssl" in low or "handshake" in low or "certificate" in low or "tsi_" in low:
            if not self._tls_on:
                return None
            return _ExplainedError(e, (
                f"the TLS handshake with {where} failed ({d}): check that --tls-ca "
                f"({TLS_CA_ENV}) is the CA that signed the cluster's certificates and "
                f"that their names cover {where.rsplit(':', 1)[0]} (or set "
                f"{TLS_NAME_ENV})"))
        if "socket closed" not in low and "connection reset" not in low:
            return None
        if self._tls_on:
            return _ExplainedError(e, (
                f"{where} closed the connection during the TLS handshake ({d}): a cluster "
                f"with mutual TLS needs this process's certificate, signed by its CA "
                f"(--tls-cert/--tls-key, {TLS_CERT_ENV}/{TLS_KEY_ENV}); a cluster "
                "without TLS needs no --tls-* settings"))
        return _ExplainedError(e, (
            f"{where} closed the connection ({d}); if the cluster uses TLS, give this "
            f"process its certificate settings: --tls-ca (and --tls-cert/--tls-key for "
            f"mutual TLS), {TLS_CA_ENV}=..., or pw.init(tls_ca=...)"))

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return _ExplainedStream(continuation(client_call_details, request), self._explain)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return _ExplainedStream(continuation(client_call_details, request_iterator),
                                self._explain)


def _tls_channel_args(cfg: TLSFiles) -> tuple:
    """(credentials, options) of a TLS channel with this process's files."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(cfg.ca) if cfg.ca else None,
        private_key=_read(cfg.key) if cfg.key else None,
        certificate_chain=_read(cfg.cert) if cfg.cert else None)
    options = OPTIONS
    if cfg.server_name:
        options = OPTIONS + [("grpc.ssl_target_name_override", cfg.server_name)]
    return creds, options


def channel(address: str) -> grpc.Channel:
    """A channel to ``address`` with this process's TLS settings and token."""
    cfg = tls()
    if cfg is None:
        ch = grpc.insecure_channel(address, options=OPTIONS)
    else:
        ch = grpc.secure_channel(address, *_tls_channel_args(cfg))
    ch = grpc.intercept_channel(ch, _ExplainRefusal(address, cfg is not None))
    t = token()
    return grpc.intercept_channel(ch, _AddToken(t)) if t else ch


def server(max_workers: int = 16) -> grpc.Server:
    t = token()
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       options=SERVER_OPTIONS,
                       interceptors=[_CheckToken(t)] if t else None)


class _AioCheckToken(grpc.aio.ServerInterceptor):
    """``_CheckToken`` for asyncio servers (the coordinator)."""

    def __init__(self, value: str) -> None:
        self._want = value.encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong cluster token: pass the cluster's token "
                                f"with pw.init(token=...), --token or {TOKEN_ENV}")
        self._deny = deny

    async def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(got.encode(), self._want):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(self._deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(self._deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._deny)
        return grpc.unary_unary_rpc_method_handler(self._deny)


def aio_server(max_concurrent_rpcs: Optional[int] = None) -> "grpc.aio.Server":
    """An asyncio server: streams hold no thread, so thousands cost little.

    ``max_concurrent_rpcs`` bounds the calls in flight (streams included); past it gRPC
    answers RESOURCE_EXHAUSTED at once instead of queueing. No keepalive pings: its
    session streams carry heartbeats with read deadlines, and pings to thousands of idle
    connections cost more CPU than the beats (Decision 15).
    """
    t = token()
    return grpc.aio.server(options=OPTIONS + [("grpc.keepalive_permit_without_calls", 1),
                                              ("grpc.http2.max_pings_without_data", 0)],
                           interceptors=[_AioCheckToken(t)] if t else None,
                           maximum_concurrent_rpcs=max_concurrent_rpcs)


def aio_channel(address: str) -> "grpc.aio.Channel":
    """An asyncio channel with this process's TLS settings; calls on it must pass
    ``metadata=call_metadata()`` (the token) themselves."""
    cfg = tls()
    if cfg is None:
        return grpc.aio.insecure_channel(address, options=OPTIONS)
    return grpc.aio.secure_channel(address, *_tls_channel_args(cfg))


def call_metadata() -> Optional[tuple]:
    """The metadata every call must carry (the cluster token), or None."""
    t = token()
    return ((TOKEN_KEY, t),) if t else None


def until_beat(period: float, phase: float = 0.0) -> float:
    """Seconds until the next multiple of ``period`` (plus ``phase``) on the wall clock.

    Clients and workers beating on their streams send there: hosts' clocks agree (NTP),
    so a coordinator receives those beats in one burst a period, which costs it less CPU
    than the same beats spread evenly (measured: docs/architecture.md, Decision 15).
    Datagram beats are spread by their ``phase`` instead (Decision 16).
    """
    import time
    return period - ((time.time() - phase) % period)


def first_event(call, timeout: float, what: str):
    """The first message of a server-streaming ``call``, or cancel it after ``timeout``
    seconds; raises ``grpc.RpcError`` (DEADLINE_EXCEEDED, details naming ``what``)."""
    import threading
    got = threading.Event()

    def expire() -> None:
        if not got.is_set():
            call.cancel()

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        return next(call)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and not got.is_set():
            raise _ExplainedError(e, f"no answer within {timeout:g} s while waiting for "
                                  f"{what}", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        raise
    finally:
        got.set()
        timer.cancel()


def add_port(srv: grpc.Server, address: str) -> int:
    """Bind ``address`` (``host:port``, port 0: any free one) and return the port.

    With TLS configured the port takes TLS only, and with a CA it requires client
    certificates signed by it (mutual TLS); without, it is plain text. Every server of
    the cluster binds through here.
    """
    cfg = tls()
    if cfg is None:
        port = srv.add_insecure_port(address)
    else:
        if not (cfg.cert and cfg.key):
            raise PathwaysError(
                f"serving TLS on {address} needs a certificate and key: give --tls-cert and "
                f"--tls-key ({TLS_CERT_ENV}, {TLS_KEY_ENV})")
        creds = grpc.ssl_server_credentials(
            [(_read(cfg.key), _read(cfg.cert))],
            root_certificates=_read(cfg.ca) if cfg.ca else None,
            require_client_auth=bool(cfg.ca))
        port = srv.add_secure_port(address, creds)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    return port


def bind_any_port(srv: grpc.Server, host: str = "127.0.0.1") -> Tuple[str, int]:
    """Bind port 0 on ``host`` and return (address, port)."""
    port = add_port(srv, f"{host}:0")
    return f"{host}:{port}", port

