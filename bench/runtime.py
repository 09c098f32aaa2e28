"""Runtime costs behind the design decisions in docs/architecture.md.

- ``slice_alloc_ms``: ``pw.slice((k,))`` + first put round trip, i.e. forking an
  executor from the host's zygote and bringing up its devices, beside
  ``cold_process_s``: a fresh Python process that imports torch + torch_xla and
  creates its first device (what an executor would cost without the zygote).
- Bulk bytes, client <-> a 2-device slice (64 MiB of float32), each round measuring
  in turn raw TCP on loopback (``sendall`` into ``recv_into``; first in even rounds,
  last in odd ones) and ``pw.put`` +
  wait and ``Array.torch()`` by three paths: the data plane through /dev/shm (what a
  client on the workers' machine gets), the data plane's socket (``PATHWAYS_SHM=0``:
  what a client on another machine gets), and the old control stream (4 MiB protobuf
  chunks, forced by raising ``PUT_MIN_BYTES``/``FETCH_MIN_BYTES``); a replicated tensor, and
  (``*_sharded``) one split over the 2 devices. ``*_over_tcp`` are medians of
  the per-round ratios, with their spread (``common.ratio_summary``). ``device_put_gbps``/``device_fetch_gbps``:
  torch_xla's own host<->device copies of the same tensor in the executor (the floor
  every path pays). ``small_round_trips``: put + wait and fetch of 16 KiB to 1 MiB on
  the stream and on the data plane, in µs (where the threshold between them sits).

Prints one JSON object.
    python bench/runtime.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from common import MIB, emit, median, ratio_summary, tcp_gbps

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402
from pathways_torch.client import connection  # noqa: E402


def cold_process_s() -> float:
    code = ("import time,os;t=time.perf_counter();import torch,torch_xla;"
            "torch_xla.device();torch.zeros(2).to(torch_xla.device()).cpu();"
            "print(time.perf_counter()-t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, CPU_NUM_DEVICES="2"), check=True)
    return float(out.stdout.strip().splitlines()[-1])


DEVICE_COPIES = """
import time, sys, torch, numpy as np, torch_xla
import torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
xr.use_spmd()
mesh = xs.Mesh(np.arange(2), (2,), ("x",))
x = torch.randn(int(sys.argv[1]) // 4)
puts, fetches = [], []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter(); y = x.to(torch_xla.device()); xs.mark_sharding(y, mesh, (None,))
    torch_xla.sync(); t1 = time.perf_counter(); torch_xla._XLAC._xla_get_cpu_tensors([y])
    t2 = time.perf_counter()
    puts.append(x.numel() * 4 / (t1 - t0) / 1e9); fetches.append(x.numel() * 4 / (t2 - t1) / 1e9)
print(sorted(puts)[len(puts) // 2], sorted(fetches)[len(fetches) // 2])
"""


def device_copies(nbytes: int, runs: int) -> tuple:
    """torch_xla's host->device (replicated over 2 devices) and device->host copy
    rates in a fresh process, as an executor does them (the read with
    ``_xla_get_cpu_tensors``: ``.cpu()`` copies once more)."""
    out = subprocess.run([sys.executable, "-c", DEVICE_COPIES, str(nbytes), str(runs)],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, CPU_NUM_DEVICES="2", PJRT_DEVICE="CPU"))
    put, fetch = out.stdout.strip().splitlines()[-1].split()
    return float(put), float(fetch)


def put_fetch(s, x: torch.Tensor, spec=None) -> tuple:
    nbytes = x.numel() * x.element_size()
    t0 = time.perf_counter()
    a = pw.put(x, s, spec)
    a.wait()
    t1 = time.perf_counter()
    back = a.torch()
    t2 = time.perf_counter()
    assert torch.equal(back, x)
    return nbytes / (t1 - t0) / 1e9, nbytes / (t2 - t1) / 1e9


def latencies(s, reps: int) -> dict:
    """Put + wait and fetch round trips (µs, medians) of small tensors on the control
    stream and on the data plane (/dev/shm): where the thresholds should be."""
    out = {}
    for kib in (16, 64, 256, 1024):
        x = torch.randn(kib * 256)
        row = {}
        for way, least in (("stream", 1 << 62), ("plane", 0)):
            set_least(least)
            puts, fetches = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                a = pw.put(x, s)
                a.wait()
                t1 = time.perf_counter()
                a.torch()
                puts.append((t1 - t0) * 1e6)
                fetches.append((time.perf_counter() - t1) * 1e6)
            row[way] = {"put_us": round(median(puts)), "fetch_us": round(median(fetches))}
        out[f"{kib}KiB"] = row
    set_least(None)
    return out


DEFAULTS = (connection.PUT_MIN_BYTES, connection.FETCH_MIN_BYTES)


def set_least(least) -> None:
    """Both data-plane thresholds to ``least`` (None: their defaults)."""
    connection.PUT_MIN_BYTES, connection.FETCH_MIN_BYTES = \
        DEFAULTS if least is None else (least, least)


PATHS = {   # name: (PATHWAYS_SHM, the data plane's least bytes (None: default), spec)
    "shm": ("1", None, None),
    "socket": ("0", None, None),
    "stream": ("1", 1 << 62, None),
    "shm_sharded": ("1", None, pw.P("data")),
    "stream_sharded": ("1", 1 << 62, pw.P("data")),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    nbytes = args.mib * MIB
    pw.init(devices_per_host=8)
    alloc, cold, tcp = [], [], []
    rates = {p: ([], []) for p in PATHS}
    try:
        x = torch.randn(nbytes // 4)
        for r in range(args.runs):
            t0 = time.perf_counter()
            s = pw.slice((2,), axis_names=("data",))
            pw.put(torch.ones(2), s).torch()
            alloc.append((time.perf_counter() - t0) * 1e3)
            if r == 0:
                put_fetch(s, x)          # first-use costs (connections, compiles)
            if r % 2 == 0:                  # raw TCP first in even rounds, last in odd
                tcp.append(tcp_gbps(nbytes))
            order = list(PATHS) if r % 2 == 0 else list(reversed(PATHS))
            for path in order:
                shm, least, spec = PATHS[path]
                os.environ["PATHWAYS_SHM"] = shm
                set_least(least)
                put, fetch = put_fetch(s, x, spec)
                rates[path][0].append(put)
                rates[path][1].append(fetch)
            os.environ.pop("PATHWAYS_SHM", None)
            set_least(None)
            if r % 2 == 1:
                tcp.append(tcp_gbps(nbytes))
            if r == args.runs - 1:
                small = latencies(s, 15)
            s.release()
        for _ in range(max(1, args.runs // 2)):
            cold.append(cold_process_s())
        dev_put, dev_fetch = device_copies(nbytes, args.runs)
    finally:
        pw.shutdown()

    def ratio(xs):
        return ratio_summary(xs, tcp)

    out = {"benchmark": "runtime_costs", "runs": args.runs, "rounds": args.runs, "payload_mib": args.mib,
           "slice_alloc_ms": round(median(alloc), 1), "cold_process_s": round(median(cold), 2),
           "tcp_gbps": round(median(tcp), 3),
           "device_put_gbps": round(dev_put, 3), "device_fetch_gbps": round(dev_fetch, 3),
           "small_round_trips": small}
    for path, (puts, fetches) in rates.items():
        key = "" if path == "shm" else f"_{path}"
        out[f"put{key}_gbps"] = round(median(puts), 3)
        out[f"fetch{key}_gbps"] = round(median(fetches), 3)
        out[f"put{key}_over_tcp"] = ratio(puts)
        out[f"fetch{key}_over_tcp"] = ratio(fetches)
    emit(out)


if __name__ == "__main__":
    main()
