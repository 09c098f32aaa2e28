"""The client's global state: one small class behind thin public functions.

``pw.init()`` connects to (or starts) a cluster and opens a session with its
coordinator; ``pw.shutdown()`` closes every executor link, releases the session's
slices and stops whatever ``pw.init()`` started.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import math
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Dict, List, Optional, Sequence, Union

import grpc

from ..errors import (ClusterShutdownError, NotInitializedError, PathwaysError,
                      ResourceExhaustedError, ShardingError, WorkerLostError)
from ..rpc import grpc_util
from ..rpc import pathways_pb2 as pb
from ..rpc import pathways_pb2_grpc as pbg
from .cluster import ADDRESS_ENV, LocalCluster
from ..worker.memory import parse_bytes
from .connection import ExecutorConnection
from .rng import SeedStream, drawn_from_torch



_slice_uids = itertools.count(1)
#: How long ``pw.init()`` waits for the coordinator to open a session.
OPEN_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Device:
    """One physical device of the cluster, as the resource manager sees it."""

    island: int
    host: int
    index: int
    kind: str
    state: str = "free"


class Slice:
    """A virtual slice: a device mesh of ``mesh_shape`` mapped onto physical devices.

    Obtain one with ``pw.slice``; give it back with ``release()`` (or ``with``).

    Example::

        s = pw.slice((4, 2), axis_names=("data", "model"))
        print(s.devices[0].host, s.mesh_shape)
        s.release()
    """

    def __init__(self, state: "_State", reply: pb.AllocateSliceReply,
                 mesh_shape: Sequence[int], axis_names: Sequence[str]) -> None:
        self.id = reply.slice_id
        self.uid = next(_slice_uids)        # unique in this process, across clusters
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        self.axis_names = tuple(axis_names)
        self.island = reply.island
        self.host = reply.host
        self.devices = tuple(Device(d.island, d.host, d.index, d.kind, d.state)
                             for d in reply.devices)
        self.data_address = reply.data_address
        self._made_at = ""                  # where the script asked for it (file:line)
        #: Bytes of buffers the slice's executor may hold at once (see pw.init).
        self.memory_budget = reply.memory_budget
        self._state = state
        #: The hosts the slice's devices are on, host-major (one unless it spans hosts).
        self.hosts = tuple(m.host for m in reply.members) or (reply.host,)
        #: Each host's bulk-data socket (the executor's, or each member's).
        self.data_addresses = (tuple(m.data_address for m in reply.members)
                               or (reply.data_address,))
        if len(reply.members) > 1:
            from .members import MembersConnection
            self._conn = MembersConnection(reply, self.mesh_shape, self.axis_names,
                                           state.timeout)
        else:
            self._conn = ExecutorConnection(reply.executor_address,
                                            f"island {reply.island} host {reply.host}",
                                            state.timeout, reply.slice_id, reply.slice_key,
                                            reply.data_address)

    @property
    def spans_hosts(self) -> bool:
        """The slice's devices are on more than one host (one SPMD program over all)."""
        return len(self.hosts) > 1

    @property
    def size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def released(self) -> bool:
        return self._conn.closed

    def axis_size(self, name: str) -> int:
        return self.mesh_shape[self.axis_names.index(name)]

    def release(self) -> None:
        """Free the slice's devices; its Arrays become unusable. A ``pw.Trainer`` on
        the slice first copies its trained values into its module and optimizer (as at
        ``pw.shutdown()``), so the module can train on under a new slice."""
        if self._conn.closed:
            return
        for ref in list(_BEFORE_RELEASE):
            method = ref()
            if method is not None:
                try:
                    method(self)
                except Exception as e:      # released regardless
                    warnings.warn(f"before releasing {self}: {e}", RuntimeWarning,
                                  stacklevel=2)
        self._release()

    def _release(self) -> None:
        """``release`` without the Trainers' copy (their slices replaced after a loss)."""
        if self._conn.closed:
            return
        prof = self._state.profile
        if prof is not None:
            prof._detach(self)          # collect its spans while it still exists
        self._conn.close()
        self._state.release_slice(self)

    def stats(self, sync: bool = True) -> pb.StatsReply:
        """The executor's counters (buffers held, bytes, programs, executions, gang
        order, device time on shared devices), after every op sent to the slice so far
        has been processed; ``sync=False`` reads them at once, without waiting."""
        if sync:
            self._conn.barrier()
        return self._conn.stats()

    def __enter__(self) -> "Slice":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.mesh_shape))
        if self.spans_hosts:
            where = "hosts " + ", ".join(map(str, self.hosts))
        else:
            where = f"host {self.host}"
        return f"Slice({axes}; island {self.island} {where})"


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cluster: Optional[LocalCluster] = None
        self.address = ""
        self.client_id = ""
        self.timeout = 600.0
        self.dispatch = "parallel"
        self.slices: List[Slice] = []
        self._channel = None
        self.stub = None
        self._session = None
        self._session_thread = None
        self.profile = None             # the open pw.profile(), if any
        self.heartbeat_s, self.lost_after_s = 1.0, 10.0
        self._heard = 0.0
        self._beats_stop = threading.Event()
        self.coordinator_lost = ""
        self.seeds = None               # pw.init(seed=) / pw.manual_seed's SeedStream

    @property
    def initialized(self) -> bool:
        return bool(self.client_id)

    def initialize(self, address: Optional[str], islands: int, hosts_per_island: int,
                   devices_per_host: int, timeout: float, name: str, share: float,
                   devices_shared_by: int, memory_budget: Optional[int] = None) -> None:
        if self.initialized:
            raise PathwaysError("pw.init() was already called; call pw.shutdown() first")
        self.timeout = timeout
        address = address or os.environ.get(ADDRESS_ENV)
        if not address:
            self.cluster = LocalCluster(islands, hosts_per_island, devices_per_host,
                                        devices_shared_by=devices_shared_by,
                                        memory_budget=memory_budget)
            address = self.cluster.address
        self.address = address
        try:
            self._channel = grpc_util.channel(address)
            self.stub = pbg.CoordinatorStub(self._channel)
            box: list = []
            self._session = self.stub.OpenSession(self._session_up(
                pb.OpenSessionRequest(name=name, pid=os.getpid(), share=share), box))
            box.append(self._session)
            first = grpc_util.first_event(self._session, OPEN_TIMEOUT_S,
                                          f"the coordinator at {address} to open a session")
            self.client_id = first.client_id
            self.heartbeat_s = first.heartbeat_s or self.heartbeat_s
            self.lost_after_s = first.lost_after_s or self.lost_after_s
        except grpc.RpcError as e:
            self.shutdown()
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise PathwaysError(f"the coordinator at {address} refused this client: "
                                    f"{e.details()}") from None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ResourceExhaustedError(f"the coordinator at {address} refused a "
                                             f"session: {e.details()}") from None
            raise PathwaysError(f"could not reach the coordinator at {address}: "
                                f"{e.details()}") from None
        self._heard = time.monotonic()
        self._session_thread = threading.Thread(target=self._hold_session,
                                                 name="pw-session", daemon=True)
        self._session_thread.start()

    def _session_up(self, request: pb.OpenSessionRequest, box: list):
        """The session's request stream: open, then a heartbeat per interval. A
        coordinator silent past its read deadline ends the session (see lost_reason)."""
        yield pb.SessionUp(open=request)
        stop = self._beats_stop
        beat = 0
        while not stop.wait(grpc_util.until_beat(self.heartbeat_s)):
            if not self.client_id:
                continue
            silent = time.monotonic() - self._heard
            if silent > self.lost_after_s:
                self.coordinator_lost = (f"the coordinator at {self.address} said nothing "
                                         f"for {silent:.1f} s")
                if box:
                    box[0].cancel()
                return
            beat += 1
            yield pb.SessionUp(beat=beat)

    def _hold_session(self) -> None:
        try:
            for ev in self._session:
                self._heard = time.monotonic()
                if ev.lost_slices:
                    self._slices_lost(set(ev.lost_slices), ev.lost_reason)
        except grpc.RpcError:
            pass

    def _slices_lost(self, ids: set, reason: str) -> None:
        with self.lock:
            lost = [s for s in self.slices if s.id in ids]
        for s in lost:
            s._conn.mark_lost(reason)

    def require(self) -> "_State":
        if not self.initialized:
            raise NotInitializedError(
                "pathways_torch is not initialized: call pw.init() first (no arguments "
                "start a local cluster on this machine)")
        return self

    def schedule(self, slice_ids: Sequence[str]):
        """Island positions and slice sequence numbers for one gang submission."""
        if self.coordinator_lost:
            raise PathwaysError(f"{self.coordinator_lost}; the session is over: call "
                                "pw.shutdown() and pw.init() again")
        try:
            rep = self.stub.Schedule(pb.ScheduleRequest(client_id=self.client_id,
                                                        slice_ids=list(slice_ids)),
                                     timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                # a slice this client still holds, unknown to the coordinator: it was
                # lost with its worker (Trainer.fit restarts on this error)
                raise WorkerLostError(f"the gang scheduler refused the graph: "
                                      f"{e.details()}; its worker was lost") from None
            raise PathwaysError(f"the gang scheduler refused the graph: {e.details()}") \
                from None
        return (list(rep.positions), list(rep.slice_seqs),
                [list(h.seqs) for h in rep.host_seqs])

    def devices(self, island: Optional[int] = None) -> List[Device]:
        req = (pb.ListDevicesRequest() if island is None
               else pb.ListDevicesRequest(island=island, has_island=True))
        rep = self.stub.ListDevices(req, timeout=30)
        return [Device(d.island, d.host, d.index, d.kind, d.state) for d in rep.devices]

    def allocate(self, mesh_shape: Sequence[int], axis_names: Sequence[str],
                 island: Optional[int], hosts: Optional[int] = None) -> Slice:
        req = pb.AllocateSliceRequest(client_id=self.client_id, mesh_shape=list(mesh_shape),
                                      axis_names=list(axis_names), island=island or 0,
                                      any_island=island is None, hosts=hosts or 0)
        try:
            rep = self.stub.AllocateSlice(req, timeout=180)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ResourceExhaustedError(e.details() + self._held_text()) from None
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ShardingError(e.details()) from None
            raise PathwaysError(f"pw.slice failed: {e.details()}") from None
        s = Slice(self, rep, mesh_shape, axis_names)
        s._made_at = _caller_line()
        with self.lock:
            self.slices.append(s)
        prof = self.profile
        if prof is not None:
            prof._attach(s)
        return s

    def _held_text(self) -> str:
        """The slices this client holds, for an allocation that found no room: a
        notebook cell run again (``s = pw.slice(...)``) leaves the first slice
        allocated, its variable rebound."""
        with self.lock:
            held = list(self.slices)
        if not held:
            return ""
        return (". This client holds " + "; ".join(
            f"{s!r}{' (made at ' + s._made_at + ')' if s._made_at else ''}"
            for s in held[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "")
            + ": a slice stays allocated until its release() or pw.shutdown(), also "
            "when its variable is rebound (a cell run again)")

    def release_slice(self, s: Slice) -> None:
        with self.lock:
            if s in self.slices:
                self.slices.remove(s)
        if self.stub is not None:
            try:
                self.stub.ReleaseSlice(pb.ReleaseSliceRequest(
                    client_id=self.client_id, slice_id=s.id), timeout=30)
            except grpc.RpcError:
                pass

    def shutdown(self) -> None:
        with self.lock:
            slices, self.slices = self.slices, []
        for s in slices:
            s._conn.close()
        self._beats_stop.set()
        if self._session is not None:
            self._session.cancel()
        if self._channel is not None:
            self._channel.close()
        if self.cluster is not None:
            self.cluster.stop()
        self.__init__()


_state = _State()


def get_state() -> _State:
    return _state.require()


def init(address: Optional[str] = None, *, islands: int = 1, hosts_per_island: int = 1,
         devices_per_host: Optional[int] = None, timeout: float = 600.0,
         name: str = "", dispatch: str = "parallel", share: float = 1.0,
         token: Optional[str] = None, devices_shared_by: int = 1,
         memory_budget: Optional[Union[int, str]] = None, tls_cert: Optional[str] = None,
         tls_key: Optional[str] = None, tls_ca: Optional[str] = None,
         seed: Optional[int] = None) -> None:
    """Connect this process to a Pathways cluster, starting a local one if needed.

    With no ``address`` (and no ``PATHWAYS_ADDRESS`` in the environment, which
    ``pathways-run`` sets), it starts an embedded cluster on this machine: a coordinator
    and ``islands * hosts_per_island`` worker processes with ``devices_per_host``
    devices each (default: ``CPU_NUM_DEVICES`` or 8), all stopped by ``pw.shutdown()``
    or at interpreter exit. ``timeout`` bounds every blocking call, in seconds.
    ``dispatch="sequential"`` makes every call wait until its inputs exist before it is
    dispatched (the paper's baseline in Figure 7); the default ``"parallel"`` dispatches
    at once and lets workers wait for their inputs.

    Several clients may use one cluster at once. ``share`` is this client's weight where
    devices are shared between clients (a cluster started with ``devices_shared_by`` >
    1, or ``pathways-run --coordinator --devices-shared-by N``): over a busy period the
    hosts give each client device time in proportion to its share. ``token`` is the
    cluster's shared secret (default ``PATHWAYS_TOKEN``), required by clusters that
    listen beyond loopback. ``tls_ca`` (the CA that signed the cluster's certificates),
    ``tls_cert`` and ``tls_key`` (this client's, for mutual TLS) are PEM file paths
    (default ``PATHWAYS_TLS_CA`` / ``_CERT`` / ``_KEY``) for a cluster that uses TLS; an
    embedded cluster started here inherits them and serves TLS with ``tls_cert``.

    ``memory_budget`` (bytes, or a string such as ``"6G"``) is each worker's buffer
    budget in an embedded cluster (default: the workers split 80% of the memory
    available). Programs whose outputs do not fit yet wait until dropped Arrays free
    room; a single buffer larger than a device's share fails with ``OutOfMemoryError``.
    ``timeout`` is the default deadline of every blocking call (``Array.torch``,
    ``pw.wait``, ...); each also takes its own ``timeout=``.

    ``seed`` starts the stream of RNG seeds of programs that draw random numbers:
    each call draws new values, and the same seed gives the same values run after
    run. Without it (nor ``pw.manual_seed``) each call's seed is drawn from torch's
    generator, as torch's own random ops draw from it: ``torch.manual_seed``, before or
    after ``pw.init``, sets the calls' numbers as it sets torch's.

    Example::

        pw.init(devices_per_host=8)
        pw.init(address="10.0.0.2:7000", share=4, token=os.environ["MY_TOKEN"])
    """
    if share <= 0:
        raise ValueError(f"share must be positive, not {share}")
    if token is not None:
        grpc_util.set_token(token)
    grpc_util.set_tls(tls_cert, tls_key, tls_ca)
    shaping = {k: v for k, v in (("islands", islands), ("hosts_per_island", hosts_per_island),
                                 ("devices_per_host", devices_per_host))
               if v is not None and v != _EMBEDDED_DEFAULTS.get(k)}
    attaching = address or os.environ.get(ADDRESS_ENV)
    if devices_per_host is None:
        devices_per_host = int(os.environ.get("CPU_NUM_DEVICES", "8"))
    _check_dispatch(dispatch)
    with _state.lock:
        _state.initialize(address, islands, hosts_per_island, devices_per_host, timeout,
                          name or f"pid{os.getpid()}", share, devices_shared_by,
                          parse_bytes(memory_budget) if memory_budget else None)
        _state.dispatch = dispatch
        _state.seeds = None if seed is None else SeedStream(seed)
    if attaching and shaping:
        _warn_ignored(shaping, address)


_EMBEDDED_DEFAULTS = {"islands": 1, "hosts_per_island": 1}


def _warn_ignored(shaping: dict, address: Optional[str]) -> None:
    """pw.init's arguments that shape an embedded cluster, given to a client that
    attaches to a running one of another shape (a script written for ``python
    script.py``, run under ``pathways-run``): said, with the cluster's own shape,
    rather than ignored silently."""
    from ..errors import warn_at_caller
    per_host: Dict[tuple, int] = {}
    for d in _state.devices(None):
        per_host[(d.island, d.host)] = per_host.get((d.island, d.host), 0) + 1
    islands = len({i for i, _ in per_host})
    sizes = sorted(set(per_host.values()))
    actual = {"islands": islands, "hosts_per_island": len(per_host) // max(islands, 1),
              "devices_per_host": sizes[0] if len(sizes) == 1 else None}
    if all(actual[k] == v for k, v in shaping.items()):
        return                      # the cluster is what the script asked for
    given = ", ".join(f"{k}={v!r}" for k, v in shaping.items())
    where = (f"the cluster at {address}" if address else
             f"the cluster at {os.environ.get(ADDRESS_ENV)} ({ADDRESS_ENV}, which "
             "pathways-run sets)")
    warn_at_caller(
        f"pw.init({given}): these shape an embedded cluster, and this client attaches to "
        f"{where}, so they are ignored. That cluster has {len(per_host)} host(s) in "
        f"{islands} island(s), with {'/'.join(map(str, sizes))} device(s) each; give the "
        "shape to pathways-run (--devices-per-host, --islands, ...) instead", UserWarning)


def manual_seed(seed: int) -> None:
    """Restart the stream of RNG seeds of program calls (as ``torch.manual_seed`` does
    for torch's generator): the calls after it draw the same numbers as the calls after
    any other ``pw.manual_seed(seed)`` with the same seed. A ``pw.Trainer`` has its own
    stream (its ``seed=``), which its checkpoints hold.

    Example::

        pw.manual_seed(0); a = noisy(x).torch()
        pw.manual_seed(0); b = noisy(x).torch()     # equal to a
    """
    get_state().seeds = SeedStream(seed)


def next_seed() -> int:
    """The next RNG seed of the session (for a program call that draws random numbers)."""
    state = get_state()
    if state.seeds is None:         # no pw.init(seed=) nor pw.manual_seed: torch's
        return drawn_from_torch()
    return state.seeds()


def _check_dispatch(mode: str) -> None:
    if mode not in ("parallel", "sequential"):
        raise ValueError(f"dispatch must be 'parallel' or 'sequential', not {mode!r}")


@contextlib.contextmanager
def dispatch_mode(mode: str):
    """Temporarily switch between ``"parallel"`` and ``"sequential"`` dispatch.

    Example::

        with pw.dispatch_mode("sequential"):
            y = f(x)          # waits until x exists before dispatching f
    """
    _check_dispatch(mode)
    state = get_state()
    old, state.dispatch = state.dispatch, mode
    try:
        yield
    finally:
        state.dispatch = old


#: run by ``shutdown()`` first, while the cluster still answers: weak references to
#: bound methods (a Trainer copies its trained values back into its module)
_BEFORE_SHUTDOWN: List["weakref.WeakMethod"] = []


def before_shutdown(method) -> None:
    """Have ``shutdown()`` call ``method()`` first (held weakly)."""
    _BEFORE_SHUTDOWN[:] = [r for r in _BEFORE_SHUTDOWN if r() is not None]
    _BEFORE_SHUTDOWN.append(weakref.WeakMethod(method))


#: run by ``Slice.release()`` first, with the slice: weak references to bound methods
_BEFORE_RELEASE: List["weakref.WeakMethod"] = []


def before_release(method) -> None:
    """Have ``Slice.release()`` call ``method(slice)`` first (held weakly)."""
    _BEFORE_RELEASE[:] = [r for r in _BEFORE_RELEASE if r() is not None]
    _BEFORE_RELEASE.append(weakref.WeakMethod(method))


def shutdown() -> None:
    """Release every slice and stop the processes that ``pw.init()`` started.

    Arrays created before become unusable (they raise ``ClusterShutdownError``). A
    ``pw.Trainer`` first copies its trained values into its module and optimizer, as
    ``sync_to()`` does, so the script can save or use them afterwards.
    """
    hooks, _BEFORE_SHUTDOWN[:] = list(_BEFORE_SHUTDOWN), []
    for ref in hooks:
        method = ref()
        if method is not None and _state.initialized:
            try:
                method()
            except Exception as e:          # the cluster is going away regardless
                warnings.warn(f"before shutdown: {e}", RuntimeWarning, stacklevel=2)
    with _state.lock:
        if _state.initialized or _state.cluster is not None:
            _state.shutdown()


def is_initialized() -> bool:
    return _state.initialized


def devices(island: Optional[int] = None) -> List[Device]:
    """Every device of the cluster (or of ``island``): island, host, index on the host,
    kind and state. On a big cluster, asking for one island is the cheaper call.

    Example::

        >>> [d.island for d in pw.devices()]
        >>> sum(d.state == "free" for d in pw.devices(island=1))
    """
    return get_state().devices(island)


def slice(mesh_shape: Sequence[int] | int, axis_names: Optional[Sequence[str]] = None,
          island: Optional[int] = None, hosts: Optional[int] = None) -> Slice:
    """Ask the resource manager for a virtual slice of devices shaped ``mesh_shape``.

    Each virtual device maps one-to-one onto a free physical device. ``island=None``
    lets the resource manager choose (least loaded). A slice bigger than a host spans
    hosts of one island, the same number of devices on each, host-major: the mesh's
    first axis is the one that crosses hosts, so put the axis with the least traffic
    (data parallelism) first. ``hosts=k`` asks for exactly k hosts even when fewer
    would do. Raises ``ResourceExhaustedError`` at once, saying what is free, when the
    request does not fit.

    Example::

        s = pw.slice((4, 2), axis_names=("data", "model"))   # 4 hosts x 2 devices
        s.hosts                                               # (0, 1, 2, 3)
    """
    state = get_state()
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    mesh_shape = tuple(int(m) for m in mesh_shape)
    if axis_names is None:
        defaults = {1: ("data",), 2: ("data", "model")}
        if len(mesh_shape) not in defaults:
            raise ShardingError(f"give axis_names for a {len(mesh_shape)}-D mesh")
        axis_names = defaults[len(mesh_shape)]
    axis_names = tuple(axis_names)
    if len(axis_names) != len(mesh_shape):
        raise ShardingError(f"mesh shape {mesh_shape} has {len(mesh_shape)} axes but "
                            f"axis_names {axis_names} names {len(axis_names)}")
    if len(set(axis_names)) != len(axis_names) or not all(
            isinstance(a, str) and a for a in axis_names):
        raise ShardingError(f"axis_names {axis_names} must be distinct non-empty strings")
    return state.allocate(mesh_shape, axis_names, island, hosts)


def _caller_line() -> str:
    """'file.py:line' of the innermost frame outside pathways_torch, or ''."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(package):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f is not None else ""


@atexit.register
def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception:
        pass


def check_alive(s: Slice) -> None:
    if s.released:
        raise ClusterShutdownError(
            f"{s!r} was released or its cluster shut down; Arrays on it are gone. "
            "Create a new slice and put the data again")
