"""DCN bandwidth: 64 MiB of float32 moved island to island, beside raw TCP on loopback.

- ``wire_gbps``: what the data plane achieves on the wire, measured by the receiving
  executor from the first header byte to the last payload byte (the part comparable
  with raw TCP).
- ``end_to_end_gbps``: ``y = x.to(other_island)`` until ``y`` exists as a device buffer
  there: includes reading the source buffer off the device and writing it to the
  destination device, which on CPU XLA are copies of their own. For a buffer split
  over the 2 devices on both sides (``P("data")``), a replicated one, and one
  resharded on the way (split -> replicated); ``*_over_tcp`` (and ``wire_over_tcp``, a
  round's wire rate being the median over its cases): medians of the per-round ratios
  to raw TCP, with their spread (``common.ratio_summary``). Raw TCP runs first in even
  rounds and last in odd ones.
- ``tcp_gbps``: one ``sendall`` into ``recv_into`` on loopback, in this process.

Prints one JSON object (medians of --runs; the cases interleaved in each round).
    python bench/dcn.py [--mib 64] [--runs 9]
"""

from __future__ import annotations

import argparse
import time

from common import MIB, emit, median, ratio_summary, tcp_gbps

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402
from pathways_torch import P  # noqa: E402


CASES = {"sharded": (P("data"), P("data")), "replicated": (P(), P()),
         "resharded": (P("data"), P())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    nbytes = args.mib * MIB
    pw.init(islands=2, hosts_per_island=1, devices_per_host=2)
    wire, tcp = [], []
    e2e = {c: [] for c in CASES}
    try:
        a = pw.slice((2,), axis_names=("data",), island=0)
        b = pw.slice((2,), axis_names=("data",), island=1)
        value = torch.randn(nbytes // 4)
        xs = {c: pw.put(value, a, src) for c, (src, _) in CASES.items()}
        for c, (_, dst) in CASES.items():
            xs[c].to(b, dst).wait()                              # warm the path
        for r in range(args.runs):
            if r % 2 == 0:
                tcp.append(tcp_gbps(nbytes))
            wire.append([])
            for c in (list(CASES) if r % 2 == 0 else list(CASES)[::-1]):
                before = b.stats()
                t0 = time.perf_counter()
                y = xs[c].to(b, CASES[c][1])
                y.wait()
                e2e[c].append(nbytes / (time.perf_counter() - t0) / 1e9)
                after = b.stats()
                got = after.bytes_received - before.bytes_received
                assert got == nbytes, got
                wire[-1].append(got / (after.recv_seconds - before.recv_seconds) / 1e9)
                del y
            wire[-1] = median(wire[-1])          # this round's wire rate, every case
            if r % 2 == 1:
                tcp.append(tcp_gbps(nbytes))
        for c, (_, dst) in CASES.items():
            assert torch.equal(xs[c].to(b, dst).torch(), value)
    finally:
        pw.shutdown()

    def ratio(xs):
        return ratio_summary(xs, tcp)

    emit({"benchmark": "dcn_bandwidth", "payload_mib": args.mib, "runs": args.runs,
          "rounds": args.runs,
          "wire_gbps": round(median(wire), 3), "tcp_gbps": round(median(tcp), 3),
          "wire_over_tcp": ratio(wire),
          "end_to_end_gbps": round(median(e2e["sharded"]), 3),
          "end_to_end_over_tcp": ratio(e2e["sharded"]),
          **{f"end_to_end_{c}_gbps": round(median(v), 3) for c, v in e2e.items()
             if c != "sharded"},
          **{f"end_to_end_{c}_over_tcp": ratio(v) for c, v in e2e.items() if c != "sharded"}})


if __name__ == "__main__":
    main()
