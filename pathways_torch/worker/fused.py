"""Recorded graphs whose executions run fused: one XLA launch for a run of programs.

A ``pw.graph()`` submission reaches an executor as one gang op holding the graph's ops
for its slice. Launching each execution costs ~24-35 µs here whatever the program does
(docs/architecture.md, Decision 20), so a graph of many small programs is bound by
launches. The executor can instead trace a run of consecutive executions into
torch_xla's lazy graph (each program is one user-computation node fed by the previous
nodes' outputs) and sync once: torch_xla compiles the run as one executable, cached by
its graph hash, and every output is materialised as before. The values are those of
running the programs one by one up to rounding: XLA optimises across the programs as
it does inside one (``((x + 1) + 1) + 1`` may become ``x + 3``), as a torch_xla user's
lazy graph or a JAX ``jit`` over the same functions would.

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
    """The executions gathered so far and not yet launched, with their wiring: which
    inputs come from the store (``ext``) and which from earlier executions here."""

    __slots__ = ("ops", "ext", "_ext_ids", "key", "device_bytes", "count", "hlo_bytes",
                 "_names", "_where")

    def __init__(self) -> None:
        self.ops: list = []         # (program, input sources, output ids)
        self.ext: list = []         # store tensors the run reads, in first-use order
        self._ext_ids: dict = {}    # buffer id -> index in ext
        self._where: dict = {}      # output id here -> (execution, output) index
        self.key: list = []         # programs and wiring: equal keys, equal graphs
        self._names: dict = {}
        self.device_bytes = self.count = self.hlo_bytes = 0

    def takes(self, prog) -> bool:
        """Whether ``prog`` may join (caps on programs and HLO bytes)."""
        return (self.count < MAX_PROGRAMS and
                self.hlo_bytes + prog.hlo_bytes <= MAX_HLO_BYTES)

    def source(self, buffer_id: int, tensor) -> int:
        """The index of a store tensor among ``ext`` (added on first use)."""
        k = self._ext_ids.get(buffer_id)
        if k is None:
            k = self._ext_ids[buffer_id] = len(self.ext)
            self.ext.append(tensor)
        return k

    def produced(self, buffer_id: int):
        """(execution index, output index) of an output made here, else None."""
        return self._where.get(buffer_id)

    def aval(self, where: tuple) -> tuple:
        """(dtype, shape) of the output at ``where`` (from ``produced``)."""
        return self.ops[where[0]][0].out_avals[where[1]]

    def add(self, prog, sources: tuple, outputs) -> None:
        """``sources``: per input, an index into ``ext`` (int) or the (execution,
        output) pair here that makes it."""
        k = len(self.ops)
        self.ops.append((prog, sources, tuple(outputs)))
        for j, b in enumerate(outputs):
            self._where[b] = (k, j)
        self.key.append((prog.program_id, sources))
        self.device_bytes += prog.out_device_bytes
        self.hlo_bytes += prog.hlo_bytes
        self.count += 1
        self._names[prog.name] = None

    def outputs(self):
        """(output id, program) of every execution, in order."""
        for prog, _, outs in self.ops:
            for b in outs:
                yield b, prog

    def names(self) -> str:
        return ", ".join(f"'{n}'" for n in self._names)


class Fusion:
    """Which gang ops run fused: those whose signature this executor has seen before."""

    def __init__(self) -> None:
        self._seen: set = set()
        self._fused: set = set()
        # a fused run's key -> (graph hash, feed) for _run_cached_graph, or None when
        # it cannot be launched that way (it is traced each time)
        self.plans: Dict[tuple, Optional[tuple]] = {}
        self.launches = 0           # fused runs launched, and the executions they held
        self.programs = 0
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
