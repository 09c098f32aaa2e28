"""Recorded graphs whose executions run fused: one XLA launch for a run of programs.

A ``pw.graph()`` submission reaches an executor as one gang op holding the graph's ops
for its slice. Launching each execution costs ~24-35 µs here whatever the program does
(docs/architecture.md, Decision 20), so a graph of many small programs is bound by
launches. The executor can instead trace a run of consecutive executions into
torch_xla's lazy graph (each program is one user-computation node fed by the previous
nodes' outputs) and sync once: torch_xla compiles the run as one executable, cached by
its graph hash, and every output is materialised as before. The values are those of
running the programs one by one (XLA fuses element-wise work without reordering
floating-point arithmetic).

The first submission of a graph runs op by op and only records its signature (the
programs in order): a graph seen once never pays a fused compile, a training loop's
step graph pays one on its second step. Runs are capped in programs and HLO bytes, so a
graph of big programs (where launches do not matter) never becomes one huge compile.

Example (what the executor does for a gang op)::

    seg = fusion.segment(ops, profiling=False)   # None: run each op on its own
"""

from __future__ import annotations

import os
from typing import Dict, Optional

MAX_PROGRAMS = 256          # executions in one fused launch
MAX_HLO_BYTES = 1 << 20     # their HLO, together: bigger programs gain nothing by fusing
MAX_SIGNATURES = 64         # distinct fused graphs (compiles) per executor


class Segment:
    """The executions traced so far and not yet launched: their outputs by buffer id."""

    __slots__ = ("entries", "_tensors", "device_bytes", "count", "hlo_bytes", "_names")

    def __init__(self) -> None:
        self.entries: Dict[int, object] = {}   # buffer id -> store.Entry (traced tensor)
        self._tensors: list = []
        self._names: dict = {}
        self.device_bytes = 0
        self.count = 0
        self.hlo_bytes = 0

    def takes(self, prog) -> bool:
        """Whether ``prog`` may join (caps on programs and HLO bytes)."""
        return (self.count < MAX_PROGRAMS and
                self.hlo_bytes + prog.hlo_bytes <= MAX_HLO_BYTES)

    def add(self, prog, outputs, outs) -> None:
        from .store import Entry
        for b, o, n, k in zip(outputs, outs, prog.out_nbytes, prog.out_shards):
            self.entries[b] = Entry(o, None, n, prog.name, None, k)
        self._tensors.extend(outs)
        self.device_bytes += prog.out_device_bytes
        self.hlo_bytes += prog.hlo_bytes
        self.count += 1
        self._names[prog.name] = None

    def tensors(self) -> list:
        return self._tensors

    def names(self) -> str:
        return ", ".join(f"'{n}'" for n in self._names)

    def view(self, store_entries: dict) -> "_View":
        """The store's entries with this segment's on top (for lookups and checks)."""
        return _View(self.entries, store_entries)

    def clear(self) -> None:
        self.entries, self._tensors, self._names = {}, [], {}
        self.device_bytes = self.count = self.hlo_bytes = 0


class _View:
    __slots__ = ("_top", "_under")

    def __init__(self, top: dict, under: dict) -> None:
        self._top, self._under = top, under

    def get(self, key, default=None):
        e = self._top.get(key)
        return e if e is not None else self._under.get(key, default)

    def __contains__(self, key) -> bool:
        return key in self._top or key in self._under


class Fusion:
    """Which gang ops run fused: those whose signature this executor has seen before."""

    def __init__(self) -> None:
        self._seen: set = set()
        self._fused: set = set()
        self.enabled = os.environ.get("PATHWAYS_FUSE", "1") != "0"

    def segment(self, ops, profiling: bool) -> Optional[Segment]:
        """A fresh Segment for the gang op's ``ops``, or None to run them one by one
        (profiling wants a span per program; a first sighting; fusion switched off)."""
        if not self.enabled or profiling:
            return None
        sig, executions = [], 0
        for op in ops:
            which = op.WhichOneof("kind")
            if which == "execute":
                executions += 1
                sig.append(op.execute.program_id)
            else:
                sig.append(which)
        if executions < 2:
            return None
        sig = tuple(sig)
        if sig not in self._seen:
            if len(self._seen) < 4 * MAX_SIGNATURES:
                self._seen.add(sig)
            return None
        if sig not in self._fused:
            if len(self._fused) >= MAX_SIGNATURES:
                return None             # a program of ever-new graphs: compile no more
            self._fused.add(sig)
        return Segment()
