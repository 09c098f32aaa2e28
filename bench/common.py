"""Shared helpers for the benchmarks: medians, interleaved rounds and their per-round
ratios, JSON output, raw-TCP baseline."""

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


# Rounds from which a ratio's spread is its interquartile range instead of min-max.
IQR_FROM = 7


def ratio_summary(subject, baseline=None, digits: int = 3) -> dict:
    """The headline form of a ratio measured in paired rounds.

    ``subject[i] / baseline[i]`` is round i's ratio (with ``baseline=None``, ``subject``
    already holds the per-round ratios). Returns ``{"median", "lo", "hi", "rounds",
    "spread", "per_round"}``: the median of the per-round ratios (never a ratio of
    medians), and their spread: min-max when there are fewer than ``IQR_FROM`` (7) rounds,
    the interquartile range (25th-75th percentile, ``statistics.quantiles`` inclusive)
    from 7 rounds up; ``spread`` says which ("min-max" or "iqr"). The report calls a bar
    met or not met only when the whole spread lies on one side of it.
    """
    rs = list(subject) if baseline is None else [s / b for s, b in zip(subject, baseline)]
    if baseline is not None and len(subject) != len(baseline):
        raise ValueError(f"{len(subject)} subject rounds against {len(baseline)} baseline")
    if not rs:
        raise ValueError("no rounds")
    if len(rs) >= IQR_FROM:
        q = statistics.quantiles(rs, n=4, method="inclusive")
        lo, hi, how = q[0], q[2], "iqr"
    else:
        lo, hi, how = min(rs), max(rs), "min-max"
    return {"median": round(statistics.median(rs), digits), "lo": round(lo, digits),
            "hi": round(hi, digits), "rounds": len(rs), "spread": how,
            "per_round": [round(r, digits) for r in rs]}


def interleaved(cases: dict, rounds: int, warmup: int = 0, between=None) -> dict:
    """Run every case of ``cases`` (name -> callable returning one measurement) once per
    round, for ``rounds`` rounds: in the given order on even rounds and reversed on odd
    ones (A,B then B,A), so warm-up and drift weigh on baseline and subject alike.
    ``warmup`` rounds run first and are dropped; ``between(r)``, if given, runs before
    round r. Returns name -> list of measurements, one per round, index-aligned across
    cases (pair them with ``ratio_summary``)."""
    out = {name: [] for name in cases}
    order = list(cases)
    for r in range(-warmup, rounds):
        if between is not None and r >= 0:
            between(r)
        for name in (order if r % 2 == 0 else order[::-1]):
            m = cases[name]()
            if r >= 0:
                out[name].append(m)
    return out


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
