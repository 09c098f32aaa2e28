"""The bulk-data path between executors (the DCN): raw TCP sockets, negotiated over gRPC.

The control plane (gRPC) only carries ``SendOp``/``RecvOp`` with a transfer id and the
destination's data address. The bytes then go executor to executor on a plain socket:
the sender writes straight from the tensor's CPU memory, the receiver reads straight
into a preallocated buffer of the announced size (no protobuf, no per-chunk copies),
and TCP does the flow control. Between executors of one host the bytes go through a
file in /dev/shm and only the header crosses the socket.

Frame: ``MAGIC, transfer_id, flags, nbytes, aux_len`` (little-endian), then ``aux``
(an error's BufferError bytes, or the shm path), then ``nbytes`` of payload unless
the frame is an error or shm frame.

The client uses the same sockets for its bulk bytes (``listen=False``: it only dials).
A put is a frame like any transfer's. A fetch is a *pull*: the client sends a
``FLAG_PULL`` frame whose aux is a ``FetchRequest`` (with the slice key), and the
receiver's ``on_pull`` answers on the same connection with a frame whose aux is a
``FetchChunk`` (the tensor's meta, or its error) followed by the payload. So a client
needs no listening port (it may sit behind NAT), and one connection serves one pull at
a time.

Authentication (only when the cluster has a token): before any frame, the receiver sends
``AUTH_MAGIC, nonce_s``; the sender answers ``AUTH_MAGIC, nonce_c, HMAC(token, "client"
nonce_s nonce_c)`` and the receiver, if that is right, ``HMAC(token, "server" nonce_s
nonce_c)``, which the sender checks in turn. A connection that fails is closed and
logged before a header is read, so nothing it sent can reach a transfer. The token never
crosses the wire and an answer cannot be replayed (fresh nonces); it costs one round
trip per connection, and connections are reused. With TLS configured
(``grpc_util.tls()``) the sockets are wrapped with ``ssl`` first, with the files gRPC
uses; the /dev/shm path is unchanged (only headers cross the socket).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import mmap
import os
import socket
import ssl
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Optional, Tuple

from .._proc import pid_gone
from ..errors import PathwaysError
from ..rpc import grpc_util

MAGIC = b"PWXFER01"
HEADER = struct.Struct("<8sQQQI")
FLAG_ERROR, FLAG_SHM, FLAG_PULL = 1, 2, 4
MAX_BYTES = 1 << 40
MAX_AUX = 1 << 20
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
AUTH_MAGIC = b"PWAUTH01"
CHALLENGE = struct.Struct("<8s32s")          # magic, receiver's nonce
RESPONSE = struct.Struct("<8s32s32s")        # magic, sender's nonce, sender's MAC
PROOF = 32                                   # receiver's MAC
AUTH_TIMEOUT = 10.0                          # seconds a new connection has to prove itself

log = logging.getLogger("pathways.dataplane")


def _mac(token: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(token, b"pathways data plane v1 " + role + nonce_s + nonce_c,
                    hashlib.sha256).digest()


def tls_contexts(cfg: Optional[grpc_util.TLSFiles]
                 ) -> Tuple[Optional[ssl.SSLContext], Optional[ssl.SSLContext]]:
    """(server, client) SSL contexts for data-plane sockets; (None, None) without TLS.

    Same policy as gRPC's: the client verifies the server's certificate and name (against
    the CA, or the system's roots), the server requires a client certificate when it has
    a CA (mutual TLS).
    """
    if cfg is None:
        return None, None
    if not (cfg.cert and cfg.key):
        raise PathwaysError(
            "the data plane serves TLS and needs a certificate and key: give --tls-cert "
            f"and --tls-key ({grpc_util.TLS_CERT_ENV}, {grpc_util.TLS_KEY_ENV})")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cfg.cert, cfg.key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(cfg.cert, cfg.key)
    if cfg.ca:
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_verify_locations(cafile=cfg.ca)
        client.load_verify_locations(cafile=cfg.ca)
    else:
        client.load_default_certs()
    return server, client


class Arrival:
    """What arrived for one transfer: payload bytes (or an mmap), or an error."""

    __slots__ = ("payload", "error", "nbytes", "seconds")

    def __init__(self, payload=None, error: Optional[bytes] = None, nbytes: int = 0,
                 seconds: float = 0.0) -> None:
        self.payload = payload
        self.error = error
        self.nbytes = nbytes
        self.seconds = seconds      # first header byte to last payload byte


def listening(address: str) -> bool:
    """Whether something accepts connections at ``address`` (host:port): a receiver
    waiting for a transfer asks this of its sender to notice a dead one in seconds."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2.0).close()
        return True
    except (OSError, ValueError):
        return False


def read_pull(service, raw: bytes):
    """A pull's ``FetchRequest`` for an executor or member ``service``, checked (its
    timeout, and the slice key against the service's): (request, None), or (None, the
    FetchChunk that refuses it)."""
    from ..rpc import pathways_pb2 as pb
    from ..rpc import validate
    req = pb.FetchRequest()
    try:
        req.ParseFromString(raw)
        validate.check_timeout(req.timeout_s)
    except Exception as e:      # noqa: BLE001 (anything undecodable or out of range)
        return None, pb.FetchChunk(has_error=True, error=service._err(
            "input", f"a bad pull request: {e}"))
    key = service._key
    if key and not hmac.compare_digest(req.slice_key.encode(), key.encode()):
        return None, pb.FetchChunk(has_error=True, error=service._err(
            "permission", f"slice {service.slice_id} on {service.where} belongs to another "
            "client (or the pull lacks the slice key)"))
    return req, None


def is_loopback(address: str) -> bool:
    """Whether ``address`` (host:port) is on this machine's loopback interface: then the
    two ends share /dev/shm and bulk bytes may skip the socket."""
    host = address.rpartition(":")[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def shm_allowed() -> bool:
    """/dev/shm exists and PATHWAYS_SHM is not 0 (a switch for benchmarks and odd mounts)."""
    return SHM_DIR is not None and os.environ.get("PATHWAYS_SHM", "1") != "0"


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 8 << 20))
        if k == 0:
            raise ConnectionError("peer closed mid-frame")
        got += k


class _Stale(Exception):
    """A pooled connection that the peer closed while it sat idle."""


def _close_payload(arrival: "Arrival") -> None:
    if hasattr(arrival.payload, "close"):
        arrival.payload.close()


def remove_orphan_shm(older_than_s: float = 60.0) -> int:
    """Unlink /dev/shm files of the data plane whose writer died before their reader
    mapped them (a process killed mid-transfer): a reader maps its file as it arrives,
    so a file older than ``older_than_s`` whose writer pid is gone is nobody's. Each
    holds a whole payload (a 64 MiB put is 64 MiB of memory until unlinked). Returns
    how many were removed. Called when a host agent starts."""
    if SHM_DIR is None:
        return 0
    removed, now = 0, time.time()
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith("pw-")]
    except OSError:
        return 0
    for name in names:
        pid = name.split("-")[1]
        path = os.path.join(SHM_DIR, name)
        try:
            if pid.isdigit() and now - os.stat(path).st_mtime >= older_than_s and \
                    pid_gone(int(pid)):
                os.unlink(path)
                removed += 1
        except OSError:
            pass
    return removed


class DataPlane:
    """Listens for incoming transfers and sends outgoing ones (a small thread pool)."""

    def __init__(self, bind_host: str, recorder=None, token: Optional[str] = None,
                 tls: Optional[grpc_util.TLSFiles] = None,
                 advertise_host: str = "", listen: bool = True) -> None:
        """``token``/``tls``: default to the process's (grpc_util.token(), .tls()).
        ``advertise_host``: the host others dial (default ``bind_host``).
        ``listen=False``: a client's plane, which only sends and pulls."""
        self.rec = recorder             # a tracing.Recorder (spans while profiling)
        t = grpc_util.token() if token is None else token
        self._token = t.encode() if t else b""
        cfg = grpc_util.tls() if tls is None else tls
        self._tls_server, self._tls_client = tls_contexts(cfg)
        self._tls_name = cfg.server_name if cfg is not None else ""
        self.refused = 0                # connections closed for failing authentication
        # Answers a pull: FetchRequest bytes -> (FetchChunk, payload view or None).
        self.on_pull = None
        self._idle_pulls: Dict[str, list] = {}   # address -> connections free for a pull
        self._cond = threading.Condition()
        self._arrived: Dict[int, Arrival] = {}
        self._discarded: set = set()    # transfers whose bytes are dropped on arrival
        self._conns: Dict[str, Tuple[socket.socket, threading.Lock]] = {}
        self._conns_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pw-send")
        self.bytes_received = 0
        self.bytes_sent = 0
        self.recv_seconds = 0.0
        self._inflight = 0              # send_async jobs queued or running
        self._idle = threading.Condition()
        self._closed = False
        self._sock = None
        self.address = ""
        if listen:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((bind_host, 0))
            self._sock.listen(64)
            self.address = f"{advertise_host or bind_host}:{self._sock.getsockname()[1]}"
            threading.Thread(target=self._accept, name="pw-data-accept",
                             daemon=True).start()

    # ------------------------------------------------------------------ receive
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # one thread per connection, named after it (a lane of its own in a profile)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="pw-data-recv %s:%d" % peer[:2]).start()

    def _admit(self, conn: socket.socket) -> Optional[socket.socket]:
        """TLS handshake and token check of a new connection; None once it is refused."""
        try:
            peer = "%s:%d" % conn.getpeername()[:2]
        except OSError:
            peer = "?"
        try:
            conn.settimeout(AUTH_TIMEOUT)
            if self._tls_server is not None:
                conn = self._tls_server.wrap_socket(conn, server_side=True,
                                                    do_handshake_on_connect=False)
                try:
                    conn.do_handshake()
                except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                    conn.close()            # connected and closed: a liveness probe
                    return None
            if self._token:
                nonce_s = os.urandom(32)
                got = bytearray(RESPONSE.size)
                view = memoryview(got)
                try:
                    conn.sendall(CHALLENGE.pack(AUTH_MAGIC, nonce_s))
                    k = conn.recv_into(view)
                except (BrokenPipeError, ConnectionResetError):
                    k = 0
                if k == 0:
                    conn.close()            # a liveness probe (executor._listening)
                    return None
                _recv_exact(conn, view[k:])
                magic, nonce_c, mac = RESPONSE.unpack(got)
                if magic != AUTH_MAGIC or not hmac.compare_digest(
                        mac, _mac(self._token, b"client", nonce_s, nonce_c)):
                    raise PermissionError("missing or wrong cluster token")
                conn.sendall(_mac(self._token, b"server", nonce_s, nonce_c))
            conn.settimeout(None)
            return conn
        except (OSError, ValueError) as e:
            self.refused += 1
            log.warning("data plane %s refused a connection from %s: %s", self.address,
                        peer, e)
            conn.close()
            return None

    def _serve(self, conn: socket.socket) -> None:
        if self._token or self._tls_server is not None:
            conn = self._admit(conn)
            if conn is None:
                return
        head = bytearray(HEADER.size)
        rec = self.rec
        try:
            peer = "%s:%d" % conn.getpeername()[:2]
        except OSError:
            peer = ""
        try:
            while True:
                try:
                    _recv_exact(conn, memoryview(head))
                except ConnectionError:
                    return
                t0 = time.perf_counter()
                magic, tid, flags, nbytes, aux_len = HEADER.unpack(head)
                if magic != MAGIC or nbytes > MAX_BYTES or aux_len > MAX_AUX:
                    return                      # not our protocol: drop the connection
                aux = bytearray(aux_len)
                _recv_exact(conn, memoryview(aux))
                if flags & FLAG_PULL:
                    self._answer_pull(conn, tid, bytes(aux))
                    continue
                if flags & FLAG_ERROR:
                    arrival = Arrival(error=bytes(aux))
                elif flags & FLAG_SHM:
                    arrival = Arrival(payload=self._open_shm(aux.decode(), nbytes),
                                      nbytes=nbytes)
                else:
                    payload = bytearray(nbytes)
                    _recv_exact(conn, memoryview(payload))
                    arrival = Arrival(payload=payload, nbytes=nbytes)
                arrival.seconds = time.perf_counter() - t0
                if rec is not None and rec.on:
                    end = rec.now()
                    rec.add("transfer", "recv", end - int(arrival.seconds * 1e9), end,
                            nbytes=nbytes, peer=peer, transfer_id=tid,
                            detail="error frame" if flags & FLAG_ERROR else
                            "shared memory" if flags & FLAG_SHM else "socket")
                with self._cond:
                    self.bytes_received += nbytes
                    self.recv_seconds += arrival.seconds
                    if tid in self._discarded:
                        self._discarded.discard(tid)
                        _close_payload(arrival)
                    else:
                        self._arrived[tid] = arrival
                        self._cond.notify_all()
        except OSError:
            return
        finally:
            conn.close()

    def _answer_pull(self, conn: socket.socket, tid: int, request: bytes) -> None:
        """Serve one pull on its own connection: the reply frame, then the payload."""
        from ..rpc import pathways_pb2 as pb
        rec = self.rec
        t0 = rec.now() if rec is not None and rec.on else 0
        release = None
        if self.on_pull is None:
            reply, views, same_host = pb.FetchChunk(has_error=True, error=pb.BufferError(
                kind="input", message="this data plane serves no pulls")), None, False
        else:
            try:
                reply, views, same_host, release = self.on_pull(request)
            except Exception as e:      # noqa: BLE001 (answer it; never drop the peer)
                log.exception("data plane %s: a pull failed", self.address)
                reply, views, same_host = pb.FetchChunk(has_error=True, error=pb.BufferError(
                    kind="internal", message=f"serving a pull failed: "
                    f"{type(e).__name__}: {e}")), None, False
        try:
            views = views or []
            nbytes = sum(len(v) for v in views)
            flags = 0
            if same_host and nbytes and shm_allowed():
                path = self._try_shm(tid, views)
                if path:
                    reply.shm_path, flags = path, FLAG_SHM
            reply.nbytes = nbytes
            aux = reply.SerializeToString()
            # counted before the puller can have them: a Stats call after the fetch
            # returns sees them (counted after, a test that asked at once raced it)
            self.bytes_sent += nbytes
            conn.sendall(HEADER.pack(MAGIC, tid, flags, nbytes, len(aux)) + aux)
            if not flags:
                for v in views:
                    conn.sendall(v)
        finally:
            if release is not None:
                release()
        if t0:
            rec.add("transfer", "pull", t0, nbytes=nbytes, transfer_id=tid,
                    detail="shared memory" if flags else "socket")

    @classmethod
    def _try_shm(cls, tid: int, views: list) -> str:
        """``_write_shm``, or "" when /dev/shm cannot take the bytes (a container's
        64 MiB default fills up): the caller sends them on the socket instead."""
        try:
            return cls._write_shm(tid, views)
        except OSError as e:
            log.warning("/dev/shm refused %d bytes (%s); they go on the socket",
                        sum(len(v) for v in views), e.strerror)
            return ""

    @staticmethod
    def _write_shm(tid: int, views: list) -> str:
        """Write ``views`` (buffers, one after the other) to a fresh /dev/shm file."""
        path = os.path.join(SHM_DIR, f"pw-{os.getpid()}-{tid}-{os.urandom(4).hex()}")
        try:
            with open(path, "wb") as f:
                for v in views:
                    f.write(v)
        except OSError:
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        return path

    @staticmethod
    def _open_shm(path: str, nbytes: int, private: bool = False):
        """Map (and unlink) a /dev/shm file a peer wrote; ``private``: a writable
        copy-on-write mapping, for a tensor that keeps it."""
        if SHM_DIR is None or os.path.dirname(path) != SHM_DIR:
            raise OSError(f"bad shm path {path!r}")
        fd = os.open(path, os.O_RDONLY)
        try:
            os.unlink(path)
            if nbytes == 0:
                return bytearray()
            if os.fstat(fd).st_size < nbytes:
                raise OSError(f"shm file {path!r} holds fewer than {nbytes} bytes")
            if private:
                return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
            return mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def take(self, transfer_id: int, timeout: float) -> Optional[Arrival]:
        """Wait for a transfer's arrival and hand it over (None past the timeout)."""
        with self._cond:
            if not self._cond.wait_for(lambda: transfer_id in self._arrived, timeout):
                return None
            return self._arrived.pop(transfer_id)

    def discard(self, transfer_id: int) -> None:
        """Drop a transfer's bytes, now if they arrived, else when they do."""
        with self._cond:
            arrival = self._arrived.pop(transfer_id, None)
            if arrival is None:
                self._discarded.add(transfer_id)
            else:
                _close_payload(arrival)

    # ------------------------------------------------------------------ send
    def send_async(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the sender pool (it waits for its producer there)."""
        with self._idle:
            self._inflight += 1
        try:
            self._pool.submit(self._run_send, fn, args)
        except RuntimeError:        # the pool is shut down
            self._done_send()
            raise

    def _run_send(self, fn, args) -> None:
        try:
            fn(*args)
        finally:
            self._done_send()

    def _done_send(self) -> None:
        with self._idle:
            self._inflight -= 1
            if not self._inflight:
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no send is queued or running (at most ``timeout`` s)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout)

    def _conn(self, address: str) -> Tuple[socket.socket, threading.Lock]:
        with self._conns_lock:
            c = self._conns.get(address)
            if c is None:
                s = self._dial(address)
                s.settimeout(None)
                c = self._conns[address] = (s, threading.Lock())
            return c

    def _dial(self, address: str) -> socket.socket:
        """A new connection to the data plane at ``address``, proven (token, TLS)."""
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._token or self._tls_client is not None:
            s = self._prove(s, address, host)
        return s

    def _prove(self, s: socket.socket, address: str, host: str) -> socket.socket:
        """TLS handshake and the token exchange on a new outgoing connection."""
        try:
            if self._tls_client is not None:
                s = self._tls_client.wrap_socket(s, server_hostname=self._tls_name or host)
            if self._token:
                got = bytearray(CHALLENGE.size)
                try:
                    _recv_exact(s, memoryview(got))
                except (socket.timeout, ConnectionError):
                    raise ConnectionError(
                        f"the data plane at {address} did not ask for the cluster token: "
                        "are both ends configured with the same token and TLS "
                        "settings?") from None
                magic, nonce_s = CHALLENGE.unpack(got)
                if magic != AUTH_MAGIC:
                    raise ConnectionError(f"the data plane at {address} answered with a "
                                          "wrong greeting")
                nonce_c = os.urandom(32)
                s.sendall(RESPONSE.pack(AUTH_MAGIC, nonce_c,
                                        _mac(self._token, b"client", nonce_s, nonce_c)))
                proof = bytearray(PROOF)
                try:
                    _recv_exact(s, memoryview(proof))
                except ConnectionError:
                    raise PermissionError(f"the data plane at {address} refused this "
                                          "process's cluster token") from None
                if not hmac.compare_digest(bytes(proof),
                                           _mac(self._token, b"server", nonce_s, nonce_c)):
                    raise PermissionError(f"the data plane at {address} does not know the "
                                          "cluster token")
        except BaseException:
            s.close()
            raise
        return s

    def send(self, address: str, transfer_id: int, payload,
             error: Optional[bytes] = None, same_host: bool = False) -> None:
        """Send one frame; ``payload`` is the raw bytes, one buffer or a list whose
        bytes follow each other (None with ``error``)."""
        rec = self.rec
        t0 = rec.now() if rec is not None and rec.on else 0
        if error is not None:
            frames = [HEADER.pack(MAGIC, transfer_id, FLAG_ERROR, 0, len(error)), error]
            nbytes, how = 0, "error frame"
        else:
            views = payload if isinstance(payload, list) else [payload]
            nbytes = sum(len(v) for v in views)
            path = self._try_shm(transfer_id, views) if same_host and nbytes and \
                shm_allowed() else ""
            if path:
                aux = path.encode()
                frames = [HEADER.pack(MAGIC, transfer_id, FLAG_SHM, nbytes, len(aux)), aux]
                how = "shared memory"
            else:
                frames = [HEADER.pack(MAGIC, transfer_id, 0, nbytes, 0)] + views
                how = "socket"
        sock, lock = self._conn(address)
        try:
            with lock:
                for fr in frames:
                    sock.sendall(fr)
        except OSError:
            with self._conns_lock:
                self._conns.pop(address, None)
            sock.close()
            raise
        self.bytes_sent += nbytes
        if t0:
            rec.add("transfer", "send", t0, nbytes=nbytes, peer=address,
                    transfer_id=transfer_id, detail=how)

    def pull(self, address: str, request: bytes, timeout: float, call=None):
        """Ask the data plane at ``address`` for a buffer (``request``: FetchRequest
        bytes); returns (FetchChunk, payload), the payload a fresh uint8 CPU tensor that
        owns its bytes (None for an error). Each pull holds a connection of its own;
        ``call.sock`` is set to it, so another thread can shut it to cancel the pull."""
        with self._conns_lock:
            idle = self._idle_pulls.get(address)
            sock = idle.pop() if idle else None
        if sock is not None:
            try:
                return self._pull_on(sock, address, request, timeout, call, reused=True)
            except _Stale:
                pass        # the peer closed it while idle: ask again on a fresh one
        return self._pull_on(self._dial(address), address, request, timeout, call)

    def _pull_on(self, sock: socket.socket, address: str, request: bytes, timeout: float,
                 call, reused: bool = False):
        """``pull`` on ``sock``; raises _Stale when a ``reused`` connection turns out
        closed before any byte of the answer (a pull is a read: asking again is safe)."""
        import torch
        from ..rpc import pathways_pb2 as pb
        if call is not None:
            call.sock = sock
        ok = False
        try:
            tid = int.from_bytes(os.urandom(8), "little") >> 1 | 1
            sock.settimeout(timeout)
            head = bytearray(HEADER.size)
            try:
                sock.sendall(HEADER.pack(MAGIC, tid, FLAG_PULL, 0, len(request)) + request)
                k = sock.recv_into(head)
            except (BrokenPipeError, ConnectionResetError):
                k = 0
            if k == 0:
                if reused:
                    raise _Stale()
                raise ConnectionError("peer closed before answering")
            _recv_exact(sock, memoryview(head)[k:])
            magic, got_tid, flags, nbytes, aux_len = HEADER.unpack(head)
            if magic != MAGIC or got_tid != tid or aux_len > MAX_AUX or nbytes > MAX_BYTES:
                raise ConnectionError(f"the data plane at {address} answered a pull with "
                                      "a wrong frame")
            aux = bytearray(aux_len)
            _recv_exact(sock, memoryview(aux))
            reply = pb.FetchChunk()
            reply.ParseFromString(bytes(aux))
            if flags & FLAG_SHM:
                # the tensor maps the file (copy-on-write): no copy on this side
                payload = torch.frombuffer(self._open_shm(reply.shm_path, nbytes,
                                                          private=True), dtype=torch.uint8)
            else:
                payload = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    _recv_exact(sock, memoryview(payload.numpy()))
            self.bytes_received += nbytes
            ok = True
            return reply, (None if reply.has_error else payload)
        finally:
            if ok and not self._closed:
                sock.settimeout(None)
                with self._conns_lock:
                    self._idle_pulls.setdefault(address, []).append(sock)
            else:
                sock.close()

    def forget(self, address: str) -> None:
        """Close the connections to ``address`` (a peer that is gone: a released
        slice's executor). A new peer may later listen on the same port."""
        with self._conns_lock:
            c = self._conns.pop(address, None)
            socks = self._idle_pulls.pop(address, [])
        if c is not None:
            with c[1]:
                c[0].close()
        for s in socks:
            s.close()

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._conns_lock:
            for s, _ in self._conns.values():
                s.close()
            self._conns.clear()
            for socks in self._idle_pulls.values():
                for s in socks:
                    s.close()
            self._idle_pulls.clear()
