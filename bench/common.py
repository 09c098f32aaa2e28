"""Shared helpers for the benchmarks: medians, JSON output, raw-TCP baseline."""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

MIB = 1 << 20


def median(xs):
    return statistics.median(xs)


def emit(result: dict) -> None:
    """Print one benchmark result as a JSON line (what `make bench` collects)."""
    print(json.dumps(result), flush=True)


def tcp_gbps(nbytes: int) -> float:
    """Raw TCP on loopback: one sendall of ``nbytes`` into recv_into, in GB/s."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    payload = bytearray(nbytes)

    def sink():
        conn, _ = srv.accept()
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            n = conn.recv_into(view[got:], min(nbytes - got, 8 * MIB))
            if n == 0:
                break
            got += n
        conn.sendall(b"k")
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    c = socket.create_connection(srv.getsockname())
    t0 = time.perf_counter()
    c.sendall(payload)
    c.recv(1)
    dt = time.perf_counter() - t0
    c.close()
    t.join()
    srv.close()
    return nbytes / dt / 1e9


def in_process_chain_us(steps: int) -> float:
    """µs per step of ``y = y + 1; torch_xla.sync()`` on this process's XLA device."""
    import torch
    import torch_xla
    dev = torch_xla.device()
    y = torch.zeros(8, 8, device=dev)
    torch_xla.sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        y = y + 1
        torch_xla.sync()
    y.cpu()
    dt = time.perf_counter() - t0
    assert float(y[0, 0]) == steps
    return dt / steps * 1e6


def ray_init():
    """Start a local Ray for a baseline (2 CPUs, quiet); the caller calls ray.shutdown()."""
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    return ray
