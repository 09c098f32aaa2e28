"""DCN bandwidth: 64 MiB of float32 moved island to island, beside raw TCP on loopback.

- ``wire_gbps``: what the data plane achieves on the wire, measured by the receiving
  executor from the first header byte to the last payload byte (the part comparable
  with raw TCP).
- ``end_to_end_gbps``: ``y = x.to(other_island)`` until ``y`` exists as a device buffer
  there: includes reading the source buffer off the device and writing it to the
  destination device, which on CPU XLA are copies of their own.
- ``tcp_gbps``: one ``sendall`` into ``recv_into`` on loopback, in this process.

Prints one JSON object (medians of --runs).
    python bench/dcn.py [--mib 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import time

from common import MIB, emit, median, tcp_gbps

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402
from pathways_torch import P  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    nbytes = args.mib * MIB
    pw.init(islands=2, hosts_per_island=1, devices_per_host=2)
    wire, e2e, tcp = [], [], []
    try:
        a = pw.slice((2,), island=0)
        b = pw.slice((2,), island=1)
        x = pw.put(torch.randn(nbytes // 4), a, P("data"))
        x.wait()
        x.to(b, P("data")).wait()                              # warm the path
        for _ in range(args.runs):
            before = b.stats()
            t0 = time.perf_counter()
            y = x.to(b, P("data"))
            y.wait()
            e2e.append(nbytes / (time.perf_counter() - t0) / 1e9)
            after = b.stats()
            got = after.bytes_received - before.bytes_received
            assert got == nbytes, got
            wire.append(got / (after.recv_seconds - before.recv_seconds) / 1e9)
            del y
            tcp.append(tcp_gbps(nbytes))
        check = x.to(b).torch()
        assert torch.equal(check, x.torch())
    finally:
        pw.shutdown()
    emit({"benchmark": "dcn_bandwidth", "payload_mib": args.mib, "runs": args.runs,
          "wire_gbps": round(median(wire), 3), "end_to_end_gbps": round(median(e2e), 3),
          "tcp_gbps": round(median(tcp), 3),
          "wire_over_tcp": round(median(wire) / median(tcp), 3),
          "end_to_end_over_tcp": round(median(e2e) / median(tcp), 3)})


if __name__ == "__main__":
    main()
