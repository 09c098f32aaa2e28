"""Helpers to look at processes through /proc (Linux), for teardown tests."""

import os
import socket
import sys
import time

# Run first in the new process, a fresh interpreter: ask for SIGTERM when the parent
# dies, exit if it already has, then exec the command. Not a preexec_fn: that runs
# Python in a fork of the (multi-threaded) test process, where a lock another thread
# held at the fork never comes free; ctypes.CDLL's dlopen hung there for 300 s in a
# CI run (the client never started).
_WATCH = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 15); "
          "os.getppid() == int(sys.argv[1]) or os._exit(0); "
          "os.execv(sys.argv[2], sys.argv[2:])")


def watched(cmd: list) -> list:
    """``cmd`` (its first item an absolute path) so that it dies with this process."""
    return [sys.executable, "-c", _WATCH, str(os.getpid()), *cmd]


def _stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def parent(pid: int) -> int:
    """The parent of a live process (0 when it is gone)."""
    try:
        return int(_stat(pid)[1])
    except OSError:
        return 0


def descendants(pid: int) -> list:
    """Every live process below ``pid``."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = _stat(entry)
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def with_cmdline(text: str) -> list:
    """Live processes whose command line contains ``text``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd and alive(int(entry)):
                out.append(int(entry))
    return out


def wait_gone(pids, timeout: float = 15.0) -> list:
    """Wait until none of ``pids`` lives; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


def port_closed(address: str, timeout: float = 15.0) -> bool:
    """True once nothing accepts connections at ``address`` (host:port)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def topmost(pids: list) -> list:
    """The processes of ``pids`` whose parent is not among them (not forked children)."""
    s = set(pids)
    out = []
    for p in pids:
        try:
            if int(_stat(p)[1]) not in s:
                out.append(p)
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    """The command line of ``pid``, space-separated ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
