"""Process plumbing shared by the coordinator, worker and executor processes (Linux)."""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import sys
import time
from typing import Callable, Optional

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` when our parent dies; exit now if it already has."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig))
    except OSError:
        pass
    if parent_pid and os.getppid() != parent_pid:
        os._exit(0)


def pid_gone(pid: int) -> bool:
    """No process has id ``pid`` (one we may not signal, another user's, exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def remove_orphan_folders(root: str, prefix: str) -> None:
    """Remove the folders ``<root>/<prefix><pid>-*`` of processes that are gone: killed
    processes cannot remove their own temporary folders."""
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and pid_gone(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def exit_when_gone(pid: int, poll_s: float = 0.5) -> None:
    """Block until process ``pid`` (not our parent) has ended, then exit at once."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):    # an old kernel: poll its existence
        while not pid_gone(pid):
            time.sleep(poll_s)
        os._exit(1)
    select.select([fd], [], [])
    os._exit(1)


def kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` but multiprocessing's resource trackers.

    A tracker ignores SIGTERM and outlives the processes it serves on purpose: when the
    last of them has died it unlinks the named semaphores (``/dev/shm/sem.mp-*``) they
    registered, which a DataLoader's queues leave behind under a fork server. Killed
    with them, it left about 11 such files per loader. It exits by itself once nothing
    else of the group holds its pipe. Without /proc, the whole group is killed."""
    try:
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        pids = None
    if pids is None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[2]) != pgid:
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"multiprocessing.resource_tracker" in f.read():
                    continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass                        # gone meanwhile, or not ours to signal


def serve_until_signal(server, until: Optional[Callable[[], bool]] = None) -> None:
    """Block until SIGTERM or SIGINT (or ``until()`` is true), then stop the server."""
    # The handler must take no lock: Event.set() from a handler that interrupted the
    # main thread inside Event.wait() (holding the event's lock) deadlocked forever, and
    # a coordinator whose parent died never exited (seen with gdb).
    stop: list = []

    def handler(signum, frame):
        stop.append(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not stop and not (until is not None and until()):
        time.sleep(0.2)
    server.stop(grace=0.5).wait(5)


def remove_torch_tempdir() -> None:
    """Remove the folder torch.distributed.nn makes in TMPDIR at import: it goes at
    interpreter exit, which ``os._exit`` skips (one folder left per worker otherwise)."""
    mod = sys.modules.get("torch.distributed.nn.jit.instantiator")
    if mod is not None:
        try:
            mod._TEMP_DIR.cleanup()
        except Exception:               # private to torch: never fail an exit over it
            pass
