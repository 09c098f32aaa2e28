"""Runtime costs behind the design decisions in docs/architecture.md.

- ``slice_alloc_ms``: ``pw.slice((k,))`` + first put round trip, i.e. forking an
  executor from the host's zygote and bringing up its devices, beside
  ``cold_process_s``: a fresh Python process that imports torch + torch_xla and
  creates its first device (what an executor would cost without the zygote).
- ``put_gbps`` / ``fetch_gbps``: 64 MiB of float32 client -> slice and back over the
  control stream (4 MiB protobuf chunks), beside ``tcp_gbps``: raw TCP on loopback.

Prints one JSON object (medians of --runs).
    python bench/runtime.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from common import MIB, emit, median, tcp_gbps

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402


def cold_process_s() -> float:
    code = ("import time,os;t=time.perf_counter();import torch,torch_xla;"
            "torch_xla.device();torch.zeros(2).to(torch_xla.device()).cpu();"
            "print(time.perf_counter()-t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, CPU_NUM_DEVICES="2"), check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    nbytes = args.mib * MIB
    pw.init(devices_per_host=8)
    alloc, puts, fetches, tcp, cold = [], [], [], [], []
    try:
        for _ in range(args.runs):
            t0 = time.perf_counter()
            s = pw.slice((2,))
            pw.put(torch.ones(2), s).torch()
            alloc.append((time.perf_counter() - t0) * 1e3)
            x = torch.randn(nbytes // 4)
            t0 = time.perf_counter()
            a = pw.put(x, s)
            a.wait()
            puts.append(nbytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            back = a.torch()
            fetches.append(nbytes / (time.perf_counter() - t0) / 1e9)
            assert torch.equal(back, x)
            del a
            s.release()
            tcp.append(tcp_gbps(nbytes))
        for _ in range(max(1, args.runs // 2)):
            cold.append(cold_process_s())
    finally:
        pw.shutdown()
    med = median
    emit({
        "benchmark": "runtime_costs", "runs": args.runs, "payload_mib": args.mib,
        "slice_alloc_ms": round(med(alloc), 1), "cold_process_s": round(med(cold), 2),
        "put_gbps": round(med(puts), 3), "fetch_gbps": round(med(fetches), 3),
        "tcp_gbps": round(med(tcp), 3),
        "put_over_tcp": round(med(puts) / med(tcp), 3),
        "fetch_over_tcp": round(med(fetches) / med(tcp), 3),
    })


if __name__ == "__main__":
    main()
